"""The communicator bootstrap (jax_ncclx/_src/bootstrap.py): group membership from the mesh shape alone, the
unique-id exchange, its cost at up to 100,000 simulated ranks, and nx.init / nx.shutdown."""

import logging
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ncclx as nx
from jax_ncclx._src import bootstrap
from jax_ncclx._src import comm
from jax_ncclx._src import config
from jax_ncclx._src import nvlink

from conftest import gpu_devices, gpu_skip_reason

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bootstrap_simulation  # noqa: E402


@pytest.mark.parametrize("shape", [(8,), (2, 4), (4, 2), (2, 3, 4), (3, 1, 5)])
@pytest.mark.parametrize("per_process", [1, 2, 4])
def test_axis_groups_match_the_mesh(shape, per_process):
    """Every process's groups, ranks and roots equal what slicing the mesh of positions along the axis gives:
    each local device in exactly one group, one group per line holding local devices, keys distinct."""
    size = int(np.prod(shape))
    positions = np.arange(size).reshape(shape)
    process_of = lambda p: p // per_process  # noqa: E731
    for axis in range(len(shape)):
        lines = np.moveaxis(positions, axis, -1).reshape(-1, shape[axis])  # each row: a group in rank order
        want = {}
        for line in lines:
            for rank, position in enumerate(line):
                want[int(position)] = (tuple(int(p) for p in line), rank)
        for process in range(-(-size // per_process)):
            local = [p for p in range(size) if process_of(p) == process]
            groups = bootstrap.axis_groups(shape, axis, local, process_of)
            members = [position for group in groups for _, position in group.members]
            assert sorted(members) == local
            assert len(groups) == len({want[p][0] for p in local}) == len({group.key for group in groups})
            for group in groups:
                assert group.size == shape[axis]
                assert len({want[position][0] for _, position in group.members}) == 1  # one line of the mesh
                for rank, position in group.members:
                    line, want_rank = want[position]
                    assert rank == want_rank and group.root_processes == (process_of(line[0]),)


def test_unique_id_is_made_once_and_read_by_the_others():
    store = bootstrap_simulation.CountingStore()
    made = []

    def new_id():
        made.append(len(made).to_bytes(4, "little"))
        return made[-1]

    split = bootstrap.AxisGroup("g", size=2, members=((0, 0),), root_processes=(0,))
    store.caller = 0
    root = bootstrap.read_ids("g", split, store, bootstrap.publish_ids("g", split, 0, store, new_id))
    other = bootstrap.AxisGroup("g", size=2, members=((1, 1),), root_processes=(0,))
    store.caller = 1
    assert bootstrap.read_ids("g", other, store, bootstrap.publish_ids("g", other, 1, store, new_id)) == root
    assert len(made) == 1 and store.ops == {0: 1, 1: 1}


class _BlockingStore(bootstrap.KeyValueStore):
    """A key-value store shared by threads standing for processes; get blocks until the key is set."""

    def __init__(self):
        self._values, self._changed, self.sets = {}, threading.Condition(), 0

    def set(self, key, value):
        with self._changed:
            assert key not in self._values, f"{key} set twice"
            self._values[key] = value
            self.sets += 1
            self._changed.notify_all()

    def get(self, key):
        with self._changed:
            assert self._changed.wait_for(lambda: key in self._values, timeout=10), f"{key} never set"
            return self._values[key]


def test_address_all_gather_inside_one_process_needs_no_store():
    """Two groups of 2 ranks, all four devices local: each device gets its own group's blobs in rank order."""
    entries = [(0, 0, b"a0"), (1, 1, b"a1"), (2, 0, b"b0"), (3, 1, b"b1")]
    got = bootstrap.all_gather_blobs("x", entries, lambda d: "ab"[d // 2], 2, kv=None)
    assert got == [[b"a0", b"a1"], [b"a0", b"a1"], [b"b0", b"b1"], [b"b0", b"b1"]]


def test_address_all_gather_across_processes():
    """A group of 4 ranks over 2 processes (2 devices each) and one group inside a third: every process gets
    every rank's blob; only the split group touches the store (one set per local rank); without a store the
    split group is an error."""
    store = _BlockingStore()
    results = {}

    def process(pid, entries, group_of, size):
        results[pid] = bootstrap.all_gather_blobs("k", entries, group_of, size, store)

    split = lambda d: "g"  # noqa: E731
    threads = [threading.Thread(target=process, args=(0, [(0, 0, b"r0"), (1, 1, b"r1")], split, 4)),
               threading.Thread(target=process, args=(1, [(0, 2, b"r2"), (1, 3, b"r3")], split, 4)),
               threading.Thread(target=process, args=(2, [(0, 0, b"s0"), (1, 1, b"s1")], lambda d: "h", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    everyone = [b"r0", b"r1", b"r2", b"r3"]
    assert results == {0: [everyone, everyone], 1: [everyone, everyone], 2: [[b"s0", b"s1"], [b"s0", b"s1"]]}
    assert store.sets == 4
    with pytest.raises(RuntimeError, match="jax.distributed is not initialised"):
        bootstrap.all_gather_blobs("k2", [(0, 0, b"r0")], split, 2, kv=None)


@pytest.mark.parametrize("per_process", [8, 1])
@pytest.mark.slow  # bootstraps a simulated mesh of processes
def test_bootstrap_cost_per_process_does_not_grow_with_the_mesh(per_process):
    """Simulated up to 100,000 ranks: with one root per communicator, key-value operations and positions
    examined per process stay the same (O(1) in N), while a membership all-gather would move N entries per
    rank. With several roots (large groups, NCCL's scalable init) a process touches each root's id once per
    group it is in: at most init_max_roots per group, whatever N."""
    one_root = config.Config(init_ranks_per_root=0)
    small = bootstrap_simulation.simulate((4096 // 32, 4, 8), per_process, one_root)
    large = bootstrap_simulation.simulate((100000 // 32, 4, 8), per_process, one_root)
    assert large["kv_ops_max"] == small["kv_ops_max"] <= 3 * per_process
    assert large["positions_max"] == small["positions_max"] == 3 * per_process
    assert large["allgather_entries"] == 100000
    shape, defaults = (100000 // 32, 4, 8), config.Config()
    roots = [defaults.init_roots(extent) for extent in shape]
    assert roots == [4, 1, 1]  # 3125 ranks along the first axis: one root per 1024 ranks
    many = bootstrap_simulation.simulate(shape, per_process, defaults)
    assert many["kv_ops_max"] <= per_process * sum(roots) <= 3 * per_process * defaults.init_max_roots


def test_roots_per_communicator_are_capped(monkeypatch):
    """JAX_NCCLX_INIT_MAX_ROOTS caps the roots however many ranks a communicator has."""
    assert config.Config(init_max_roots=2).init_roots(3125) == 2
    assert config.Config(init_max_roots=2).init_roots(1024) == 1
    monkeypatch.setenv("JAX_NCCLX_INIT_MAX_ROOTS", "3")
    monkeypatch.setenv("JAX_NCCLX_INIT_RANKS_PER_ROOT", "100")
    assert [config.current().init_roots(n) for n in (100, 101, 250, 100000)] == [1, 2, 3, 3]


@pytest.mark.parametrize(("size", "roots", "want"), [(8, 1, [0]), (10, 3, [0, 4, 7]), (12, 4, [0, 3, 6, 9]),
                                                     (3125, 4, [0, 782, 1563, 2344])])
def test_root_ranks_follow_nccls_rule(size, roots, want):
    """NCCL's rule for ncclCommInitRankScalable: blocks of size // roots ranks, the first size % roots one
    longer, each led by a root."""
    assert bootstrap.root_ranks(size, roots) == want


def test_several_roots_publish_before_reading():
    """Two processes, each holding one of a group's two roots: both publish first, so neither waits on the
    other; every member gets both ids, in root order; a group inside one process makes its ids itself."""
    store = _BlockingStore()
    group_of = {p: bootstrap.axis_groups((4,), 0, [2 * p, 2 * p + 1], lambda q: q // 2, roots=2)[0]
                for p in (0, 1)}
    assert group_of[0].root_processes == (0, 1)
    made = {p: bootstrap.publish_ids("g", group_of[p], p, store, lambda p=p: bytes([p])) for p in (0, 1)}
    assert made == {0: {0: b"\x00"}, 1: {1: b"\x01"}} and store.sets == 2
    for p in (0, 1):
        assert bootstrap.read_ids("g", group_of[p], store, made[p]) == [b"\x00", b"\x01"]
    local = bootstrap.axis_groups((4,), 0, range(4), lambda q: 0, roots=2)[0]
    counter = iter(range(10))
    assert bootstrap.publish_ids("h", local, 0, None, lambda: bytes([next(counter)])) == {0: b"\x00", 1: b"\x01"}
    with pytest.raises(RuntimeError, match="jax.distributed is not initialised"):
        bootstrap.publish_ids("i", group_of[0], 0, None, lambda: b"x")


class _FakeCudaModule:
    """Stands in for the CUDA module so that comm.py's communicator bookkeeping runs on CPU devices."""

    def __init__(self):
        self.registered, self.created = [], []

    def register_comm(self, nranks, ranks, devices):
        self.registered.append((nranks, tuple(ranks), tuple(devices)))
        return len(self.registered)

    def unique_id(self):
        return bytes(len(self.created))

    def init_comm(self, comm_id, ids, max_ctas=0):
        self.created.append((comm_id, sorted(ids)))

    def destroy_all(self):
        pass


def test_communicator_for_makes_each_axis_communicator_once(monkeypatch):
    """The first lowering along an axis registers its communicator; every later one (other ops, other
    programs) finds it in the cache: a miss would create NCCL communicators again (and, across processes,
    republish their ids). Its NCCL communicators are made by the first op that needs them, once."""
    fake = _FakeCudaModule()
    monkeypatch.setattr(comm.lib, "cuda_module", lambda: fake)
    comm.destroy_all()
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:4]).reshape(2, 2), ("a", "b"))
    first = {axis: comm.communicator_for(mesh, axis) for axis in ("a", "b")}
    assert [comm.communicator_for(mesh, axis) for axis in ("a", "b", "a")] == [first["a"], first["b"], first["a"]]
    assert fake.registered == [(2, (0, 1, 0, 1), (0, 2, 1, 3)), (2, (0, 1, 0, 1), (0, 1, 2, 3))]
    assert comm.all_comm_ids() == sorted(first.values())
    assert fake.created == []  # registering makes no NCCL communicator
    comm.ensure_nccl(first["b"])
    comm.ensure_nccl(first["b"])
    assert fake.created == [(first["b"], [0, 1, 2, 3])]
    comm.destroy_all()


def test_communicator_for_a_tuple_of_axes(monkeypatch):
    """Axes taken as one make one group of the whole 2x2 mesh, ranked as jax.lax.axis_index of the tuple
    (the first axis major): ("b", "a") puts device 2 (a=1, b=0) at rank 1. Each order is a communicator of
    its own, and a 1-tuple is its axis."""
    fake = _FakeCudaModule()
    monkeypatch.setattr(comm.lib, "cuda_module", lambda: fake)
    comm.destroy_all()
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:4]).reshape(2, 2), ("a", "b"))
    ids = [comm.communicator_for(mesh, axes) for axes in (("a", "b"), ("b", "a"), ("a", "b"), "a", ("a",))]
    assert ids[0] == ids[2] and ids[3] == ids[4] and len(set(ids)) == 3
    assert fake.registered[:2] == [(4, (0, 1, 2, 3), (0, 1, 2, 3)), (4, (0, 1, 2, 3), (0, 2, 1, 3))]
    comm.destroy_all()


def test_failed_nccl_creation_is_repeated_not_retried(monkeypatch):
    """A failed NCCL creation fails every later op on that communicator with the first error: trying again
    would republish its unique ids (the key-value store refuses) or wait for peers that moved on."""
    fake = _FakeCudaModule()
    fake.init_comm = lambda *args: (_ for _ in ()).throw(RuntimeError("ncclCommInitRankConfig failed"))
    monkeypatch.setattr(comm.lib, "cuda_module", lambda: fake)
    comm.destroy_all()
    comm_id = comm.communicator_for(jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:2]), ("x",)), "x")
    with pytest.raises(RuntimeError, match="ncclCommInitRankConfig failed"):
        comm.ensure_nccl(comm_id)
    with pytest.raises(RuntimeError, match="failed earlier: ncclCommInitRankConfig failed"):
        comm.ensure_nccl(comm_id)
    comm.destroy_all()


def test_communicator_without_nvlink_takes_nccl_unless_nvlink_is_forced(monkeypatch, caplog):
    """A communicator whose ranks cannot reach each other through NVLink: its NVLink step runs once however
    often it is asked, one warning gives the reason, and with the default transport its ops take NCCL;
    JAX_NCCLX_TRANSPORT=nvlink makes routing fail with that reason. A route that asks before the step fails
    loudly rather than guess."""
    reason = "rank 1 (device 1) cannot reach rank 0 (device 0) through CUDA peer access"
    asked = []
    fake = _FakeCudaModule()
    fake.connect_symmetric = lambda comm_id, exchange: asked.append(comm_id) or reason
    monkeypatch.setattr(comm.lib, "cuda_module", lambda: fake)
    comm.destroy_all()
    comm_id = comm.communicator_for(jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:2]), ("x",)), "x")
    monkeypatch.delenv("JAX_NCCLX_TRANSPORT", raising=False)
    with pytest.raises(RuntimeError, match=r"jax_ncclx\.all_reduce: communicator \d+ was routed before its "
                                           r"NVLink step"):
        nvlink.usable("all_reduce", comm_id)
    with caplog.at_level(logging.WARNING, logger="jax_ncclx"):
        assert comm.connect_nvlink(comm_id) == reason and comm.connect_nvlink(comm_id) == reason
        assert not nvlink.usable("all_reduce", comm_id)
        assert not nvlink.usable("all_to_allv_dynamic", comm_id)
    assert asked == [comm_id]
    warnings = [record.getMessage() for record in caplog.records if "cannot use NVLink" in record.getMessage()]
    assert len(warnings) == 1 and reason in warnings[0] and "use NCCL" in warnings[0], warnings
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "nvlink")
    with pytest.raises(RuntimeError, match=r"jax_ncclx\.all_gather: JAX_NCCLX_TRANSPORT=nvlink but this "
                                           r"communicator cannot use NVLink: rank 1 \(device 1\) cannot reach"):
        nvlink.usable("all_gather", comm_id)
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "nccl")
    assert not nvlink.usable("all_reduce", comm_id)
    comm.destroy_all()
    assert comm.nvlink_reason(comm_id) is None  # forgotten with the communicator


def test_init_and_shutdown_on_cpu():
    """On CPU there is nothing to create: init is a no-op and jitted functions keep working across shutdown."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:4]), ("x",))
    nx.init(mesh)
    f = jax.jit(jax.shard_map(lambda v: nx.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    before = comm._generation
    np.testing.assert_array_equal(f(jnp.ones((4, 2)))[0], 4.0)
    nx.shutdown()
    assert comm._generation == before + 1
    np.testing.assert_array_equal(f(jnp.ones((4, 2)))[0], 4.0)
    with pytest.raises(ValueError, match="pass a jax.sharding.Mesh"):
        nx.init()


@pytest.mark.parametrize("axes", [["c"], [("a", "a")], [()], [("a", "c")], "ab"], ids=str)
def test_init_refuses_axes_outside_the_mesh(axes):
    """A string is one axis name, not a list of its letters ("ab" is neither axis)."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:4]).reshape(2, 2), ("a", "b"))
    nx.init(mesh, axes="a")
    with pytest.raises(ValueError, match=r"jax_ncclx.init: .* is not an axis of the mesh \(axes \('a', 'b'\)\)"):
        nx.init(mesh, axes=axes)


@pytest.mark.gpu
def test_init_makes_the_communicators_and_shutdown_frees_them():
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    devices = gpu_devices()
    mesh = jax.sharding.Mesh(np.asarray(devices).reshape(1, len(devices)), ("a", "b"))
    nx.shutdown()
    nx.init(mesh)
    made = comm.all_comm_ids()
    assert len(made) == 2  # one per axis
    stats = nx.memory_stats()
    assert {s["comm_id"] for s in stats} == set(made)
    assert all(s["nccl_init_bytes"] >= 0 and s["symmetric_data_bytes"] == 0 for s in stats)  # nothing lazy yet
    f = jax.jit(jax.shard_map(lambda v: nx.all_reduce(v, "b"), mesh=mesh, in_specs=P("a", "b"),
                              out_specs=P("a", "b")))
    x = jnp.ones((1, len(devices) * 2))
    np.testing.assert_array_equal(np.asarray(f(x)), len(devices))
    assert comm.all_comm_ids() == made  # init's communicators were used, not new ones
    nx.shutdown()
    assert comm.all_comm_ids() == [] and nx.memory_stats() == []
    np.testing.assert_array_equal(np.asarray(f(x)), len(devices))  # recompiled with fresh communicators
    assert comm.all_comm_ids() and set(comm.all_comm_ids()).isdisjoint(made)


@pytest.mark.gpu
def test_init_makes_the_communicator_of_a_tuple_of_axes():
    """init(mesh, axes=...) makes the communicator of both axes taken as one, which a program over that tuple
    then uses. On a 1 x n mesh both orders rank the devices alike, so they share one communicator."""
    reason = gpu_skip_reason(minimum=1)
    if reason:
        pytest.skip(reason)
    devices = gpu_devices()
    mesh = jax.sharding.Mesh(np.asarray(devices).reshape(1, len(devices)), ("a", "b"))
    nx.shutdown()
    nx.init(mesh, axes=[("a", "b"), ["b", "a"]])
    made = comm.all_comm_ids()
    assert len(made) == 1
    f = jax.jit(jax.shard_map(lambda v: nx.all_reduce(v, ("a", "b")), mesh=mesh, in_specs=P("a", "b"),
                              out_specs=P("a", "b")))
    np.testing.assert_array_equal(np.asarray(f(jnp.ones((1, len(devices) * 2)))), len(devices))
    assert comm.all_comm_ids() == made
    nx.shutdown()


@pytest.mark.gpu
def test_nvlink_only_use_makes_no_nccl_communicator(monkeypatch):
    """A communicator used only by NVLink kernels never creates its NCCL communicators: its first call adds
    only jax_ncclx's symmetric memory (a few MiB; the addresses travel through the host, not an NCCL
    collective). The first op that needs NCCL on it creates them, and works."""
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    from jax_ncclx._src import lib

    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "nvlink")
    devices = gpu_devices()
    n = len(devices)
    mesh = jax.sharding.Mesh(np.asarray(devices), ("x",))
    x = jax.device_put(jnp.ones((n, 256)), jax.sharding.NamedSharding(mesh, P("x")))
    plain = jax.jit(jax.shard_map(lambda v: v * 2, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    jax.block_until_ready(plain(x))  # XLA's own first-use allocations, not counted below
    nx.shutdown()
    cuda = lib.cuda_module()
    before = [cuda.device_memory_used(d.local_hardware_id) for d in devices]
    f = jax.jit(jax.shard_map(lambda v: nx.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    np.testing.assert_array_equal(np.asarray(f(x)), n)
    added = max(cuda.device_memory_used(d.local_hardware_id) - b for d, b in zip(devices, before))
    stats = nx.memory_stats()
    assert len(stats) == n and all(s["nccl_init_bytes"] == 0 for s in stats)
    held = max(s["symmetric_data_bytes"] + s["control_bytes"] for s in stats)
    assert 0 < held <= added + (4 << 20)
    assert added < 64 << 20, f"the first NVLink all_reduce added {added / 2**20:.0f} MiB per GPU"
    # ppermute has no NVLink kernel: it makes the NCCL communicators.
    ring = [(i, (i + 1) % n) for i in range(n)]
    g = jax.jit(jax.shard_map(lambda v: nx.ppermute(v, "x", ring), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    np.testing.assert_array_equal(np.asarray(g(jnp.ones((n, 8)))), 1)
    assert all(s["nccl_init_bytes"] > 0 for s in nx.memory_stats())
    nx.shutdown()


@pytest.mark.gpu
def test_several_roots_make_a_working_communicator(monkeypatch):
    """NCCL's multi-root init (ncclCommInitRankScalable), forced on a small group: one root per rank."""
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("JAX_NCCLX_INIT_RANKS_PER_ROOT", "1")
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "nccl")
    devices = gpu_devices()
    mesh = jax.sharding.Mesh(np.asarray(devices), ("x",))
    nx.shutdown()
    f = jax.jit(jax.shard_map(lambda v: nx.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jax.device_put(jnp.arange(len(devices) * 4.0).reshape(len(devices), 4),
                       jax.sharding.NamedSharding(mesh, P("x")))
    np.testing.assert_array_equal(np.asarray(f(x)), np.tile(np.asarray(x).sum(0), (len(devices), 1)))
    nx.shutdown()


@pytest.mark.gpu
def test_shutdown_forgets_the_watched_calls(monkeypatch):
    """nx.shutdown() leaves no per-communicator watchdog state behind: comm ids are never reused, so the
    entries of destroyed communicators would only pile up across re-inits."""
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    from jax_ncclx._src import lib

    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "nccl")  # the watchdog watches NCCL calls
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", "60")
    devices = gpu_devices()
    mesh = jax.sharding.Mesh(np.asarray(devices), ("x",))
    nx.shutdown()
    f = jax.jit(jax.shard_map(lambda v: nx.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jax.device_put(jnp.ones((len(devices), 4)), jax.sharding.NamedSharding(mesh, P("x")))
    jax.block_until_ready(f(x))
    module = lib.cuda_module()
    reached = module.watchdog_state()[0]
    assert sorted(rank for _, rank, _ in reached) == list(range(len(devices))), reached
    nx.shutdown()
    assert module.watchdog_state() == ([], [], [])


@pytest.mark.gpu
def test_nccl_max_ctas_makes_a_leaner_communicator(monkeypatch):
    """JAX_NCCLX_NCCL_MAX_CTAS caps NCCL's channels, and with them the 2 MiB granules NCCL takes per channel
    at init; the communicator still reduces correctly."""
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "nccl")
    devices = gpu_devices()
    nx.shutdown()
    nx.init(jax.sharding.Mesh(np.asarray(devices), ("x",)))  # NCCL's once-per-process costs land here
    nx.init(jax.sharding.Mesh(np.asarray(devices[::-1]), ("x",)))
    second = max(comm.all_comm_ids())
    default = max(s["nccl_init_bytes"] for s in nx.memory_stats() if s["comm_id"] == second)
    monkeypatch.setenv("JAX_NCCLX_NCCL_MAX_CTAS", "2")
    mesh = jax.sharding.Mesh(np.asarray(devices).reshape(1, len(devices)), ("a", "b"))
    f = jax.jit(jax.shard_map(lambda v: nx.all_reduce(v, "b"), mesh=mesh, in_specs=P("a", "b"),
                              out_specs=P("a", "b")))
    x = jax.device_put(jnp.arange(len(devices) * 1024.0).reshape(1, -1),
                       jax.sharding.NamedSharding(mesh, P("a", "b")))
    expected = np.tile(np.asarray(x).reshape(len(devices), -1).sum(0), len(devices))
    np.testing.assert_array_equal(np.asarray(f(x)).reshape(-1), expected)
    lean = max(s["nccl_init_bytes"] for s in nx.memory_stats() if s["comm_id"] == comm.communicator_for(mesh, "b"))
    assert lean < default / 2, f"maxCTAs=2: {lean / 2**20:.0f} MiB, default: {default / 2**20:.0f} MiB"
    nx.shutdown()


def test_registry_bindings_check_their_arguments():
    """register_comm / init_comm of the CUDA module (no GPU needed: they fail before any CUDA or NCCL call)."""
    from jax_ncclx._src import lib

    module = lib.cuda_module_if_available()
    if module is None:
        pytest.skip(f"needs the CUDA module: {lib._load_cuda()[1]}")
    comm.destroy_all()
    comm_id = module.register_comm(4, [1, 3], [0, 1])
    assert module.comm_info(comm_id) == [(0, 1, 4), (1, 3, 4)]
    assert [row[:3] for row in module.comm_memory()] == [(comm_id, 0, 0), (comm_id, 1, 0)]  # no NCCL yet
    with pytest.raises(ValueError, match="rank 4 is outside"):
        module.register_comm(4, [4], [0])
    with pytest.raises(ValueError, match="device 0 twice"):
        module.register_comm(4, [0, 1], [0, 0])
    with pytest.raises(ValueError, match="device 1 of communicator .* needs 1 to nranks=4 unique ids, got 0"):
        module.init_comm(comm_id, {0: [bytes(128)]})
    with pytest.raises(ValueError, match="unique id of 5 bytes"):
        module.init_comm(comm_id, {0: [bytes(5)], 1: [bytes(128)]})
    with pytest.raises(ValueError, match="no communicator 999"):
        module.init_comm(999, {0: [bytes(128)]})
    module.watch_now()  # nothing watched: a pass finds nothing
    assert module.faults() == [] and module.watchdog_state() == ([], [], [])
    module.abort_comm(comm_id, "process 3 found call #1 hung")  # no NCCL communicator to abort: only recorded
    assert module.faults() == [(comm_id, "process 3 found call #1 hung")]
    module.destroy_all()
    assert module.faults() == []
    with pytest.raises(ValueError, match="unknown or destroyed"):
        module.comm_info(comm_id)


@pytest.mark.gpu
def test_fault_scan_never_waits_for_a_growing_communicator():
    """Growing a communicator's symmetric memory holds it through a device sync and a host exchange that can wait
    minutes for other processes; the fault scan of nx.check_errors and of the watchdog (every 20 ms, which also
    times NCCL calls) must not wait for it. A one-rank communicator on GPU 0 with a slow exchange."""
    from jax_ncclx._src import lib

    reason = gpu_skip_reason(minimum=1)
    if reason:
        pytest.skip(reason)
    module = lib.cuda_module_if_available()
    comm.destroy_all()
    comm_id = module.register_comm(1, [0], [0])

    def exchange(entries):
        return [[blob] for _, _, blob in entries]

    with pytest.raises(RuntimeError, match="grow_symmetric.*connect it first"):
        module.grow_symmetric(comm_id, 0, 1 << 16, exchange)
    assert module.connect_symmetric(comm_id, exchange) == ""
    module.grow_symmetric(comm_id, 0, 1 << 16, exchange)
    in_exchange = threading.Event()

    def slow_exchange(entries):
        in_exchange.set()
        time.sleep(2.0)
        return exchange(entries)

    grower = threading.Thread(target=module.grow_symmetric, args=(comm_id, 1 << 22, 1 << 16, slow_exchange))
    grower.start()
    assert in_exchange.wait(30)
    started = time.monotonic()
    assert module.faults() == []
    scan_s = time.monotonic() - started
    grower.join(30)
    assert scan_s < 1.0, f"the fault scan waited {scan_s:.1f} s for the growth"
    data_bytes = {row[0]: row[3] for row in module.comm_memory()}[comm_id]
    assert data_bytes >= (1 << 22) + 2 * (1 << 16), data_bytes  # the growth itself completed
    comm.destroy_all()
