"""The communicator bootstrap (jax_ncclx/_src/bootstrap.py): group membership from the mesh shape alone, the
unique-id exchange, its cost at up to 100,000 simulated ranks, and nx.init / nx.shutdown."""

import os
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ncclx as nx
from jax_ncclx._src import bootstrap
from jax_ncclx._src import comm

from conftest import gpu_devices, gpu_skip_reason

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bootstrap_simulation  # noqa: E402


@pytest.mark.parametrize("shape", [(8,), (2, 4), (4, 2), (2, 3, 4), (3, 1, 5)])
@pytest.mark.parametrize("per_process", [1, 2, 4])
def test_axis_groups_match_the_mesh(shape, per_process):
    """Every process's groups, ranks and roots equal what slicing the mesh of positions along the axis gives."""
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
            for group in bootstrap.axis_groups(shape, axis, local, process_of):
                assert group.size == shape[axis]
                for rank, position in group.members:
                    line, want_rank = want[position]
                    assert rank == want_rank and group.root_process == process_of(line[0])


def test_unique_id_is_made_once_and_read_by_the_others():
    store = bootstrap_simulation.CountingStore()
    made = []

    def new_id():
        made.append(len(made).to_bytes(4, "little"))
        return made[-1]

    store.caller = 0
    root = bootstrap.unique_id("g", root_process=0, all_local=False, me=0, kv=store, new_id=new_id)
    store.caller = 1
    assert bootstrap.unique_id("g", root_process=0, all_local=False, me=1, kv=store, new_id=new_id) == root
    assert len(made) == 1 and store.ops == {0: 1, 1: 1}
    assert bootstrap.unique_id("h", root_process=0, all_local=True, me=1, kv=None, new_id=new_id) == made[-1]
    with pytest.raises(RuntimeError, match="jax.distributed is not initialised"):
        bootstrap.unique_id("i", root_process=0, all_local=False, me=1, kv=None, new_id=new_id)


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
def test_bootstrap_cost_per_process_does_not_grow_with_the_mesh(per_process):
    """Simulated up to 100,000 ranks: key-value operations and positions examined per process stay the same
    (O(1) in N), while a membership all-gather would move N entries per rank."""
    small = bootstrap_simulation.simulate((4096 // 32, 4, 8), per_process)
    large = bootstrap_simulation.simulate((100000 // 32, 4, 8), per_process)
    assert large["kv_ops_max"] == small["kv_ops_max"] <= 3 * per_process
    assert large["positions_max"] == small["positions_max"] == 3 * per_process
    assert large["allgather_entries"] == 100000


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
def test_nvlink_set_up_allocates_no_nccl_buffers(monkeypatch):
    """The first NVLink call on a fresh communicator adds only jax_ncclx's symmetric memory (a few MiB): the
    addresses travel through the host, so NCCL never connects its rings (hundreds of MiB per GPU)."""
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    from jax_ncclx._src import lib

    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "nvlink")
    devices = gpu_devices()
    mesh = jax.sharding.Mesh(np.asarray(devices), ("x",))
    x = jax.device_put(jnp.ones((len(devices), 256)), jax.sharding.NamedSharding(mesh, P("x")))
    plain = jax.jit(jax.shard_map(lambda v: v * 2, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    jax.block_until_ready(plain(x))  # XLA's own first-use allocations, not counted below
    nx.shutdown()
    nx.init(mesh)
    cuda = lib.cuda_module()
    before = [cuda.device_memory_used(d.local_hardware_id) for d in devices]
    f = jax.jit(jax.shard_map(lambda v: nx.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    np.testing.assert_array_equal(np.asarray(f(x)), len(devices))
    added = max(cuda.device_memory_used(d.local_hardware_id) - b for d, b in zip(devices, before))
    held = max(s["symmetric_data_bytes"] + s["control_bytes"] for s in nx.memory_stats())
    assert 0 < held <= added + (4 << 20)
    assert added < 64 << 20, f"the first NVLink all_reduce added {added / 2**20:.0f} MiB per GPU"
