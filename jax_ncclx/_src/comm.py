"""NCCL communicators for the CUDA handlers: one per way of grouping a mesh's devices along one of its axes
(or along several taken as one), made on first use (or by :func:`init`) and cached.

Why our own communicators instead of borrowing XLA's (jaxlib's collectives FFI extension): they carry state
XLA's do not have (symmetric buffers registered per communicator, abort on timeout, memory accounting).

When they are made: while a program that needs them is being lowered, before it can run, from the Python
thread, for all local devices at once (one NCCL group). A communicator is first only its ranks (what the
NVLink kernels need); its NCCL communicators are created when the first op that goes through NCCL is lowered
(or by :func:`init`), so NVLink-only use never pays NCCL's few hundred MiB per GPU. Making them inside a
handler would risk a deadlock: ``ncclCommInitRank`` allocates device memory while other devices may already
be spinning in a collective. Every process of a multi-process job lowers the same program, so all of them
make the same communicators in the same order.

A communicator's life, each step collective and taken while lowering (or by :func:`init`), never inside a
handler:

1. :func:`communicator_for` registers its ranks;
2. :func:`connect_nvlink`, before the first call site of an op with an NVLink kernel is routed: control blocks
   and peer tables, and whether the ranks reach each other over NVLink (the answer every route reads);
3. :func:`ensure_nccl`, when the first call site goes through NCCL;
4. :func:`grow_symmetric`, for each call site routed to an NVLink kernel: the data region grows to the sizes
   its route names (``lowering.CudaRoute``);
5. :func:`destroy_all` (or :func:`shutdown`) frees it all.

How the ranks meet (``bootstrap.py``, ``docs/bootstrap.md``): each process computes from the mesh shape alone
which groups its devices are in and their ranks (the coordinate along the axis, ``jax.lax.axis_index``); the
process holding a group's rank 0 (for a large group, each of its few roots) makes an NCCL unique id and
publishes it in JAX's distributed key-value store, the others read it, and every local device joins its
group with ``ncclCommInitRank`` (``ncclCommInitRankScalable`` with several roots). No membership all-gather,
and no key-value traffic when a group lives in one process.
"""

import dataclasses
import functools
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jax_ncclx._src import bootstrap
from jax_ncclx._src import compat
from jax_ncclx._src import config
from jax_ncclx._src import lib

logger = logging.getLogger("jax_ncclx")

_lock = threading.Lock()
_KV_TIMEOUT_MS = 10 * 60 * 1000


@dataclasses.dataclass
class _Registry:
    """Every communicator of this process, guarded by ``_lock``; :func:`destroy_all` forgets it all at once."""

    axis_comms: dict = dataclasses.field(default_factory=dict)  # (device ids, mesh shape, axis) -> comm_id
    groups: dict = dataclasses.field(default_factory=dict)  # comm_id -> device ids of its ranks (first group)
    exchanges: dict = dataclasses.field(default_factory=dict)  # comm_id -> how ranks swap symmetric addresses
    nccl_pending: dict = dataclasses.field(default_factory=dict)  # comm_id -> creates its NCCL communicators
    nccl_failed: dict = dataclasses.field(default_factory=dict)  # comm_id -> why creating them failed
    nvlink_reasons: dict = dataclasses.field(default_factory=dict)  # comm_id -> why not NVLink ("": it can)


_registry = _Registry()
_generation = 0  # shutdowns so far: names this generation's keys in the key-value store; survives destroy_all
# What other modules keep per communicator and must forget with them (health.py's answers), and what starts
# with the first communicator (its progress publisher): registered by those modules, so this one needs none.
_on_destroy: list[Callable[[], None]] = []
_on_register: list[Callable[[], None]] = []


class _JaxKeyValueStore(bootstrap.KeyValueStore):
    def __init__(self, client):
        self._client = client

    def set(self, key: str, value: bytes) -> None:
        self._client.key_value_set_bytes(key, value)

    def get(self, key: str) -> bytes:
        return self._client.blocking_key_value_get_bytes(key, _KV_TIMEOUT_MS)


class _AddressExchange:
    """The host all-gather through which one communicator's ranks swap symmetric-memory addresses
    (``bootstrap.all_gather_blobs``); each call is a new exchange with its own keys."""

    def __init__(self, prefix: str, group_of: dict[int, str], size: int, kv: bootstrap.KeyValueStore | None):
        self._prefix, self._group_of, self._size, self._kv = prefix, group_of, size, kv
        self._count = 0

    def __call__(self, entries):
        self._count += 1
        return bootstrap.all_gather_blobs(f"{self._prefix}/symmetric/{self._count}", entries,
                                          self._group_of.__getitem__, self._size, self._kv)


def _wait_for_device_work():
    # NCCL init allocates device memory; let programs still running on the GPUs finish first.
    for array in jax.live_arrays():
        try:
            array.block_until_ready()
        except RuntimeError:  # deleted or donated while we looked
            pass


def communicator_for(mesh: jax.sharding.Mesh, axis_name) -> int:
    """The comm_id of the communicators along mesh axis ``axis_name`` (or a tuple of axes, taken together as
    one): every local device of ``mesh`` gets the communicator of its group (the devices sharing its
    coordinates on the other axes), ranked by its coordinate along the axis (``jax.lax.axis_index``; over
    several axes the first is major). Registers the ranks only; the NCCL communicators come with the first op
    that needs them (:func:`ensure_nccl`). Collective: every process lowering the program calls it in the same
    order."""
    named = [mesh.axis_names.index(name) for name in (axis_name if isinstance(axis_name, tuple) else (axis_name,))]
    others = [i for i in range(mesh.devices.ndim) if i not in named]
    # The mesh seen with the named axes moved last and merged into one, the first named axis major: the
    # groups and ranks below are then those of one axis.
    grid = np.transpose(mesh.devices, others + named)
    grid = grid.reshape(*grid.shape[:len(others)], -1)
    devices = list(grid.flat)
    shape = tuple(grid.shape)
    axis = len(shape) - 1
    key = (tuple(d.id for d in devices), shape, axis)
    with _lock:
        if key in _registry.axis_comms:
            return _registry.axis_comms[key]
        me = jax.process_index()
        local = [p for p, d in enumerate(devices) if d.process_index == me]
        roots = config.current().init_roots(shape[axis])
        groups = bootstrap.axis_groups(shape, axis, local, lambda p: devices[p].process_index, roots)
        client = compat.distributed_client()
        kv = _JaxKeyValueStore(client) if client is not None else None
        mesh_key = hashlib.sha1(repr((_generation, key)).encode()).hexdigest()
        ranks, ordinals, group_of = [], {}, {}  # ordinals: mesh position -> CUDA ordinal; group_of: by ordinal
        for group in groups:
            for rank, position in group.members:
                ranks.append(rank)
                ordinals[position] = devices[position].local_hardware_id
                group_of[ordinals[position]] = group.key
        comm_id = lib.cuda_module().register_comm(shape[axis], ranks, list(ordinals.values()))
        _registry.nccl_pending[comm_id] = functools.partial(_create_nccl, comm_id, mesh_key, groups, ordinals, me, kv)
        _registry.exchanges[comm_id] = _AddressExchange(f"jax_ncclx/{mesh_key}", group_of, shape[axis], kv)
        if groups:
            first = groups[0].members[0][1]
            _registry.groups[comm_id] = tuple(devices[bootstrap.position_of_rank(shape, axis, first, r)].id
                                          for r in range(shape[axis]))
        logger.info("jax_ncclx: communicator %d along axis %r of a %s mesh (%d local group(s), %d root(s) each)",
                    comm_id, axis_name, "x".join(map(str, mesh.devices.shape)), len(groups), roots)
        _registry.axis_comms[key] = comm_id
    for hook in _on_register:
        hook()
    return comm_id


def _create_nccl(comm_id: int, mesh_key: str, groups, ordinals: dict[int, int], me: int,
                 kv: bootstrap.KeyValueStore | None):
    """Creates the NCCL communicators of ``comm_id``: each group's roots make and publish unique ids, every
    member reads them, and all local devices join in one NCCL group."""
    cuda = lib.cuda_module()
    _wait_for_device_work()
    id_keys = [f"jax_ncclx/{mesh_key}/{group.key}" for group in groups]
    made = [bootstrap.publish_ids(k, group, me, kv, cuda.unique_id) for k, group in zip(id_keys, groups)]
    ids = {}
    for id_key, group, own in zip(id_keys, groups, made):
        group_ids = bootstrap.read_ids(id_key, group, kv, own)
        ids.update((ordinals[position], group_ids) for _, position in group.members)
    cuda.init_comm(comm_id, ids, config.current().nccl_max_ctas)
    logger.info("jax_ncclx: NCCL communicators of communicator %d created", comm_id)


def ensure_nccl(comm_id: int):
    """Creates the NCCL communicators of ``comm_id`` unless they exist: called while lowering an op that goes
    through NCCL, so that a communicator used only by the NVLink kernels never holds NCCL's memory (hundreds of
    MiB per GPU). Collective, like :func:`communicator_for`.

    Raises:
      RuntimeError: creating them failed (now, or at an earlier attempt, whose error it repeats).
    """
    with _lock:
        if comm_id in _registry.nccl_failed:
            raise RuntimeError(f"jax_ncclx: creating the NCCL communicators of communicator {comm_id} failed "
                               f"earlier: {_registry.nccl_failed[comm_id]}")
        create = _registry.nccl_pending.pop(comm_id, None)
        if create is None:
            return
        try:
            create()
        except Exception as error:
            _registry.nccl_failed[comm_id] = str(error)
            raise


def init(mesh: jax.sharding.Mesh | None = None, axes: Sequence | None = None):
    """Makes now, instead of at the first collective, the communicators of ``mesh``'s axes, NCCL's included
    (which the first collective makes only if it goes through NCCL), and connects their ranks for the NVLink
    kernels (:func:`connect_nvlink`; not with ``JAX_NCCLX_TRANSPORT=nccl``). Collective: every process calls it with
    the same arguments. Does nothing more than check them for a mesh of CPU devices (the CPU backend needs no
    communicators).

    Args:
      mesh: the mesh (default: the mesh of ``jax.set_mesh``).
      axes: the ``axis_name`` of each communicator to make, as the ops take it: a mesh axis, or a tuple of
        axes taken as one (each order its own communicator), e.g. ``["data", ("data", "expert")]``; one axis
        name alone (a string) stands for a list of it. Default: every axis of the mesh, one by one.

    Returns:
      None.

    Raises:
      ValueError: no mesh given and none set; an entry of ``axes`` that is not a mesh axis or a tuple of
        distinct ones.
      RuntimeError: on GPU, NCCL failed to make a communicator (NCCL's message).
    """
    mesh = mesh if mesh is not None else compat.concrete_context_mesh()
    if mesh is None or mesh.empty:
        raise ValueError("jax_ncclx.init: pass a jax.sharding.Mesh or call it under jax.set_mesh(mesh)")
    if isinstance(axes, str):  # one axis, not its letters
        axes = [axes]
    wanted = [tuple(a) if isinstance(a, (tuple, list)) else a for a in (mesh.axis_names if axes is None else axes)]
    for axis_name in wanted:
        names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        if not names or len(set(names)) != len(names) or not set(names) <= set(mesh.axis_names):
            raise ValueError(f"jax_ncclx.init: {axis_name!r} in axes is not an axis of the mesh (axes "
                             f"{mesh.axis_names}) or a tuple of distinct ones")
    if mesh.devices.flat[0].platform != "gpu":
        return
    for axis_name in wanted:
        comm_id = communicator_for(mesh, axis_name)
        ensure_nccl(comm_id)
        if config.current().transport != "nccl":
            connect_nvlink(comm_id)


def shutdown():
    """Frees every communicator and all their memory (after the work queued on them finished) and drops JAX's
    compiled programs, so that the next call of a jitted function compiles anew and makes fresh communicators:
    jax_ncclx works again after it. On GPU a program object compiled before (``.lower().compile()``) fails with
    a clear error; on CPU, which has no communicators, it still runs. Also restarts every rank's call numbers
    (the trace's ``seq``, and ``JAX_NCCLX_FAULT``'s) at 0. Collective: every process calls it. Also the way out
    of a communicator that stopped working (:func:`check_errors`). Returns None."""
    global _generation
    destroy_all()
    jax.clear_caches()
    # GPU calls are numbered per communicator, and the next ones are fresh. A CPU group keeps its key, and a
    # rank that a fault let run ahead (docs/reliability.md) would stay ahead.
    lib.cpu_module().restart_sequences()
    with _lock:
        _generation += 1


def destroy_all():
    """Frees every communicator and its symmetric memory (after their work finished), so that the next
    lowering makes fresh ones; programs compiled before keep stale comm_ids and fail clearly."""
    global _registry
    with _lock:
        if _registry.axis_comms:  # else there is nothing to free, and CUDA may not even be usable here
            lib.cuda_module().destroy_all()
        _registry = _Registry()
    for hook in _on_destroy:
        hook()


def group_devices(comm_id: int) -> tuple[int, ...] | None:
    """The device ids of ``comm_id``'s ranks (this process's first group of it), or None for an unknown one."""
    with _lock:
        return _registry.groups.get(comm_id)


def all_comm_ids() -> list[int]:
    """Every communicator made so far (one per mesh axis and device grouping), by comm_id."""
    with _lock:
        return sorted(set(_registry.axis_comms.values()))


def connect_nvlink(comm_id: int) -> str:
    """The NVLink step of ``comm_id``'s life, taken once: every rank allocates its symmetric control block and
    peer table, the ranks agree on whether each reaches every other through NVLink peer access, and map each
    other. Lowering takes it before routing a call site of an op with an NVLink kernel; :func:`init` takes it
    at once. Collective, like :func:`communicator_for`.

    Returns:
      "" when the NVLink kernels can run on the communicator; otherwise why not (a rank cannot reach a peer
      through NVLink peer access, ...), the same on every rank and logged once.
    """
    with _lock:
        if comm_id not in _registry.nvlink_reasons:
            reason = lib.cuda_module().connect_symmetric(comm_id, _registry.exchanges[comm_id])
            _registry.nvlink_reasons[comm_id] = reason
            if reason:
                logger.warning("jax_ncclx: communicator %d cannot use NVLink kernels (%s); its ops use NCCL",
                               comm_id, reason)
        return _registry.nvlink_reasons[comm_id]


def nvlink_reason(comm_id: int) -> str | None:
    """What :func:`connect_nvlink` answered for ``comm_id`` ("": NVLink usable), or None before it ran."""
    with _lock:
        return _registry.nvlink_reasons.get(comm_id)


def grow_symmetric(comm_id: int, *, staging_bytes: int = 0, slot_bytes: int = 0):
    """Makes ``comm_id``'s symmetric data region hold ``staging_bytes`` of all_to_allv_dynamic staging and
    ``slot_bytes`` of low-latency slots per call parity: grown (by half again at least), never shrunk, and
    remapped into every peer. Lowering calls it for each call site routed to an NVLink kernel, with the sizes
    of its route. Collective, like :func:`communicator_for`.

    Raises:
      RuntimeError: the communicator was not connected (:func:`connect_nvlink`) or cannot use NVLink, or the
        growth failed (the communicator then refuses further NVLink calls).
    """
    with _lock:
        lib.cuda_module().grow_symmetric(comm_id, staging_bytes, slot_bytes, _registry.exchanges[comm_id])


def memory_stats() -> list[dict]:
    """Memory jax_ncclx's communicators hold outside XLA's allocator, per communicator and local GPU.

    Returns:
      One dict per (communicator, local device): ``comm_id``, ``device`` (CUDA ordinal);
      ``nccl_init_bytes``: device memory ``ncclCommInitRank`` took (cudaMemGetInfo around it: NCCL does not
      report its own use; what NCCL allocates later, on a communicator's first NCCL call, is not included);
      0 while no op has needed the communicator's NCCL part, and once it was aborted (a revoked one keeps it);
      ``symmetric_data_bytes``: the NVLink kernels' data region, sized by the largest calls lowered so far
      (0 until an NVLink op needs it); ``low_latency_bytes``: the part of it that the small-message
      collectives use, both call parities; ``control_bytes``: flags and peer table; ``pinned_host_bytes``:
      pinned host memory (the fault record). Empty on a CPU-only build or before any GPU communicator exists.
    """
    module = lib.cuda_module_if_available()
    if module is None:
        return []
    return [dict(comm_id=comm_id, device=device, nccl_init_bytes=nccl_init, symmetric_data_bytes=data,
                 low_latency_bytes=low_latency, control_bytes=control, pinned_host_bytes=pinned)
            for comm_id, device, nccl_init, data, low_latency, control, pinned in module.comm_memory()]
