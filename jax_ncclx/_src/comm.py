"""NCCL communicators for the CUDA handlers: one world communicator per set of devices, and one communicator
per way of grouping those devices along a mesh axis, split from the world communicator and cached.

Why our own communicators instead of borrowing XLA's (jaxlib's collectives FFI extension): later work needs to
own them (symmetric buffers registered per communicator, abort on timeout, memory accounting), and splitting
lets every mesh axis reuse one bootstrap.

When they are made: while a program that needs them is being lowered, before it can run, from the Python
thread, for all local devices at once (ncclGroupStart/End). Making them inside a handler would risk a deadlock:
``ncclCommInitRank`` allocates device memory while other devices may already be spinning in a collective.
Every process of a multi-process job lowers the same program, so all of them make the same communicators in
the same order; the NCCL unique id travels through JAX's distributed key-value store.

Ranks: the world rank of a device is its position among the devices sorted by id; inside a group the rank is
the position along the mesh axis (``jax.lax.axis_index``), which ``ncclCommSplit`` gets as its key.
"""

import hashlib
import json
import logging
import threading
import time
from collections.abc import Sequence

import jax

from jax_ncclx._src import compat
from jax_ncclx._src import lib

logger = logging.getLogger("jax_ncclx")

_lock = threading.Lock()
_world_comms: dict[tuple[int, ...], int] = {}
_group_comms: dict[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]], int] = {}
_KV_TIMEOUT_MS = 10 * 60 * 1000


def _wait_for_device_work():
    # NCCL init allocates device memory; let programs still running on the GPUs finish first.
    for array in jax.live_arrays():
        try:
            array.block_until_ready()
        except RuntimeError:  # deleted or donated while we looked
            pass


def _unique_id(world: tuple[int, ...], local_ranks: list[int]) -> bytes:
    """A fresh id when this process holds the whole world; otherwise the id rank 0's process publishes."""
    cuda = lib.cuda_module()
    if len(local_ranks) == len(world):
        return cuda.unique_id()
    client = compat.distributed_client()
    if client is None:
        raise RuntimeError(
            "jax_ncclx: the mesh spans several processes but jax.distributed is not initialised; call "
            "jax.distributed.initialize() before the first collective"
        )
    key = "jax_ncclx/world/" + hashlib.sha1(repr(world).encode()).hexdigest()
    if 0 in local_ranks:
        uid = cuda.unique_id()
        client.key_value_set_bytes(key, uid)
        return uid
    return client.blocking_key_value_get_bytes(key, _KV_TIMEOUT_MS)


def _world_comm(devices: Sequence[jax.Device]) -> int:
    world = tuple(sorted(d.id for d in devices))
    if world in _world_comms:
        return _world_comms[world]
    by_id = {d.id: d for d in devices}
    local = [by_id[i] for i in world if by_id[i].process_index == jax.process_index()]
    ranks = [world.index(d.id) for d in local]
    _wait_for_device_work()
    uid = _unique_id(world, ranks)
    comm_id = lib.cuda_module().init_comm(uid, len(world), ranks, [d.local_hardware_id for d in local])
    logger.info("jax_ncclx: world communicator %d over %d devices (local ranks %s)", comm_id, len(world), ranks)
    _world_comms[world] = comm_id
    return comm_id


def communicator_for(mesh_devices: Sequence[jax.Device], groups: Sequence[Sequence[int]]) -> int:
    """The comm_id of the communicator for ``groups`` (partition ids, i.e. positions in ``mesh_devices``).

    Every local device of the mesh gets the communicator of its group, ranked by its position in the group.
    """
    devices = list(mesh_devices)
    world = tuple(sorted(d.id for d in devices))
    group_ids = tuple(tuple(devices[p].id for p in group) for group in groups)
    key = (world, group_ids)
    with _lock:
        if key in _group_comms:
            return _group_comms[key]
        world_id = _world_comm(devices)
        if group_ids == (world,):  # one group in world-rank order: the world communicator itself
            _group_comms[key] = world_id
            return world_id
        position = {dev: (color, rank) for color, group in enumerate(group_ids) for rank, dev in enumerate(group)}
        local = [d for d in sorted(devices, key=lambda d: d.id) if d.process_index == jax.process_index()]
        _wait_for_device_work()
        comm_id = lib.cuda_module().split_comm(
            world_id,
            [d.local_hardware_id for d in local],
            [position[d.id][0] for d in local],
            [position[d.id][1] for d in local],
        )
        logger.info("jax_ncclx: communicator %d = split of %d into groups %s", comm_id, world_id, group_ids)
        _group_comms[key] = comm_id
        return comm_id


def destroy_all():
    """Frees every communicator and its symmetric memory (after their work finished), so that the next
    lowering makes fresh ones; programs compiled before keep stale comm_ids and fail clearly. The way out of
    a communicator that stopped working (:func:`check_errors`)."""
    module = lib.cuda_module_if_available()
    with _lock:
        if module is not None:
            module.destroy_all()
        _world_comms.clear()
        _group_comms.clear()
        _nvlink_refusals_logged.clear()


def all_comm_ids() -> list[int]:
    """Every communicator made so far (world and split ones), by comm_id."""
    with _lock:
        return sorted(set(_world_comms.values()) | set(_group_comms.values()))


_nvlink_refusals_logged: set[int] = set()


def nvlink_symmetric_memory(comm_id: int, op: str, *, staging_bytes: int = 0, slot_bytes: int = 0) -> str:
    """Makes ``comm_id``'s symmetric memory big enough for ``op``'s NVLink kernel: ``staging_bytes`` of
    all_to_allv_dynamic staging and ``slot_bytes`` of low-latency slots per call parity.

    Collective, like communicator creation: every process lowering the program calls it in the same order.
    The memory is allocated on the first call and grown (never shrunk) by later ones.

    Returns:
      "" when the NVLink kernels can run on the communicator; otherwise why not (a rank cannot reach a peer
      through NVLink peer access, ...), the same on every rank and logged once per communicator.
    """
    with _lock:
        reason = lib.cuda_module().ensure_symmetric(comm_id, staging_bytes, slot_bytes)
        if reason and comm_id not in _nvlink_refusals_logged:
            _nvlink_refusals_logged.add(comm_id)
            logger.warning("jax_ncclx: communicator %d cannot use NVLink kernels (%s); %s and later ops on it use "
                           "NCCL", comm_id, reason, op)
    return reason


def memory_stats() -> list[dict]:
    """Device memory jax_ncclx holds outside XLA's allocator, per communicator and local GPU.

    Returns:
      One dict per (communicator, local device) that holds symmetric memory: ``comm_id``, ``device`` (CUDA
      ordinal), ``symmetric_data_bytes`` (the data region, sized by the largest calls lowered so far),
      ``low_latency_bytes`` (the part of it that the small-message collectives use, both call parities) and
      ``control_bytes`` (flags and peer table, fixed). Empty when no GPU op has needed any, or on a CPU-only
      build.
    """
    module = lib.cuda_module_if_available()
    if module is None:
        return []
    return [dict(comm_id=comm_id, device=device, symmetric_data_bytes=data, low_latency_bytes=low_latency,
                 control_bytes=control)
            for comm_id, device, data, low_latency, control in module.symmetric_memory()]


class CollectiveError(RuntimeError):
    """A collective went wrong: it timed out (or was aborted because a peer's did), or its payload failed the
    checksum (``JAX_NCCLX_CHECKSUM=1``)."""


def check_errors():
    """Raises :class:`CollectiveError` naming every communicator of this process that stopped working and
    every checksum mismatch seen since the last call.

    A GPU collective whose peers do not arrive within its timeout stops waiting on the device (NVLink kernels)
    or is aborted by the watchdog (NCCL; with several processes, which remote rank is missing is asked of the
    other processes here, waiting up to 3 s for their answer); the program that contained it completes with
    undefined outputs, and
    every later jax_ncclx call on that communicator fails with the same message (until
    :func:`destroy_all`). Call this after ``jax.block_until_ready`` to learn of it at once. CPU-backend
    collectives raise from the program itself.
    """
    from jax_ncclx._src import checksum  # the ops import this module

    module = lib.cuda_module_if_available()
    problems = []
    if module is not None:
        unnamed = dict(module.watchdog_state()[1]) if jax.process_count() > 1 else {}
        for comm_id, message in module.faults():
            if comm_id in unnamed:
                message += "; in other processes: " + _remote_progress(module, comm_id, unnamed[comm_id])
            problems.append(f"communicator {comm_id}: {message}")
    problems += checksum.take_mismatches()
    if problems:
        raise CollectiveError("jax_ncclx: " + "\n".join(problems))


_PROGRESS_WAIT_S = 3.0
_remote_progress_seen: dict[tuple[int, int], str] = {}


def _group_of(comm_id: int) -> tuple[int, ...] | None:
    """The device ids of ``comm_id``'s ranks, in rank order (the group holding this process's devices)."""
    local = {d.id for d in jax.local_devices()}
    for world, world_id in _world_comms.items():
        if world_id == comm_id:
            return world
    for (_, groups), group_id in _group_comms.items():
        if group_id == comm_id:
            return next((g for g in groups if local & set(g)), None)
    return None


def _remote_progress(module, comm_id: int, sequence: int) -> str:
    """Names the ranks of other processes that did not reach NCCL call ``sequence`` on ``comm_id``, which NCCL
    cannot tell: every process that checks publishes how far its ranks got in JAX's key-value store and reads
    the others'. A process that does not answer within a few seconds is dead or stuck, and so named."""
    if (comm_id, sequence) in _remote_progress_seen:
        return _remote_progress_seen[comm_id, sequence]
    client, group = compat.distributed_client(), _group_of(comm_id)
    if client is None or group is None:
        return "unknown (no jax.distributed key-value store)"
    process_of = {d.id: d.process_index for d in jax.devices()}
    me = jax.process_index()
    key = f"jax_ncclx/progress/{hashlib.sha1(repr(group).encode()).hexdigest()}/{sequence}/"
    mine = {rank: reached for c, rank, reached in module.watchdog_state()[0] if c == comm_id}
    try:
        client.key_value_set(key + str(me), json.dumps(mine))
    except Exception:  # noqa: BLE001 - published by an earlier check of this process
        pass
    deadline = time.monotonic() + _PROGRESS_WAIT_S
    behind, silent = [], []
    for process in sorted({process_of[d] for d in group} - {me}):
        ranks = [r for r, d in enumerate(group) if process_of[d] == process]
        try:
            wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
            theirs = json.loads(client.blocking_key_value_get(key + str(process), wait_ms))
        except Exception:  # noqa: BLE001 - no answer in time
            silent += ranks
            continue
        behind += [r for r in ranks if theirs.get(str(r), -1) < sequence]
    parts = []
    if behind:
        parts.append(f"rank(s) {', '.join(map(str, behind))} never reached it (their processes say so)")
    if silent:
        parts.append(f"rank(s) {', '.join(map(str, silent))} did not report their progress within "
                     f"{_PROGRESS_WAIT_S:g} s (process dead or stuck)")
    answer = "; ".join(parts) or "every rank reached it"
    _remote_progress_seen[comm_id, sequence] = answer
    return answer
