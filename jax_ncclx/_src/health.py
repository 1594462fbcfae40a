"""What went wrong with this process's collectives, and, with several processes, which remote ranks are to
blame: :func:`check_errors` and the progress that processes publish to each other through JAX's key-value
store. The communicators themselves are :mod:`comm`'s; this module keeps only what it learned about them,
forgotten with them (``comm.destroy_all``).
"""

import atexit
import functools
import hashlib
import json
import logging
import threading
import time

import jax
import numpy as np

from jax_ncclx._src import checksum
from jax_ncclx._src import comm
from jax_ncclx._src import compat
from jax_ncclx._src import lib

logger = logging.getLogger("jax_ncclx")

_lock = threading.Lock()  # guards what this module remembers


class CollectiveError(RuntimeError):
    """A collective went wrong: it timed out (or was aborted because a peer's did), or its payload failed the
    checksum (``JAX_NCCLX_CHECKSUM=1``)."""


def check_errors():
    """Raises :class:`CollectiveError` naming every communicator of this process that stopped working and
    every checksum mismatch seen since the last call.

    A GPU collective whose peers do not arrive within its timeout stops waiting on the device (NVLink kernels)
    or is aborted by the watchdog (NCCL; with several processes, which remote rank is missing is asked of the
    other processes here, waiting up to 3 s for their answer); the program that contained it completes with
    undefined outputs, and every later jax_ncclx call on that communicator fails with the same message (until
    :func:`shutdown`). With several processes, an NCCL call that finished only after half its timeout is
    also checked with the other processes (up to 3 s, once): a peer's abort can end it early with garbage
    and no NCCL error, so if another process found it hung, it fails here too. Call this after
    ``jax.block_until_ready`` to learn of it at once. CPU-backend collectives raise from the program itself.

    Returns:
      None, when nothing failed.

    Raises:
      CollectiveError: one message per failed communicator (the op, the call and the ranks that did not
        arrive, or the fault) and per checksum mismatch.
    """
    module = lib.cuda_module_if_available()
    problems = []
    if module is not None:
        several = jax.process_count() > 1
        remote = _check_late_calls(module) if several else {}
        unnamed = dict(module.watchdog_state()[1]) if several else {}
        for comm_id, message in module.faults():
            sequence = unnamed.get(comm_id, remote.get(comm_id))
            if sequence is not None:
                message += "; in other processes: " + _remote_progress(module, comm_id, sequence)
            problems.append(f"communicator {comm_id}: {message}")
    problems += checksum.take_mismatches()
    if problems:
        raise CollectiveError("jax_ncclx: " + "\n".join(problems))


_PROGRESS_WAIT_S = 3.0
_remote_progress_seen: dict[tuple[int, int], str] = {}
_late_calls_checked: set[tuple[int, int]] = set()


def _check_late_calls(module) -> dict[int, int]:
    """Asks the other processes about NCCL calls of this process that finished only after half their timeout.
    Within a host NCCL reports no error when a peer aborts its communicator, and that abort can end this
    rank's kernel early, with garbage outputs, just before its own watchdog would have fired. If another
    process published its progress for such a call (its watchdog found the call hung or ended by a peer), the
    outputs here are undefined too: the local communicator is aborted with a message naming the call.
    Publishes this process's progress first, so that those processes learn that its ranks reached the call.
    Waits up to 3 s per late call (each is asked about once).

    Returns:
      comm_id -> sequence of each communicator aborted here.
    """
    client = compat.distributed_client()
    if client is None:
        return {}
    module.watch_now()  # a call that just finished is seen now, not at the watchdog's next pass
    faulty = {comm_id for comm_id, _ in module.faults()}
    me, aborted = jax.process_index(), {}
    for comm_id, sequence, description in module.watchdog_state()[2]:
        if comm_id in faulty or (comm_id, sequence) in _late_calls_checked:
            continue
        _late_calls_checked.add((comm_id, sequence))
        group = comm.group_devices(comm_id)
        if group is None:
            continue
        _publish_progress(module, client, me, comm_id, sequence)
        key = _progress_key(group, sequence)
        deadline = time.monotonic() + _PROGRESS_WAIT_S
        while True:
            reporters = sorted(int(k.rstrip("/").rsplit("/", 1)[-1]) for k, _ in client.key_value_dir_get(key))
            reporters = [p for p in reporters if p != me]
            if reporters or time.monotonic() > deadline:
                break
            time.sleep(_PUBLISH_POLL_S)
        if reporters:
            module.abort_comm(comm_id, f"{description}, and process(es) {', '.join(map(str, reporters))} found it "
                              "hung or ended by a peer: its outputs here are undefined; the communicator is aborted")
            aborted[comm_id] = sequence
    return aborted


def _progress_key(group: tuple[int, ...], sequence: int) -> str:
    return f"jax_ncclx/progress/{hashlib.sha1(repr(group).encode()).hexdigest()}/{sequence}/"


def _publish_progress(module, client, me: int, comm_id: int, sequence: int) -> None:
    """Puts in the key-value store how far this process's ranks of ``comm_id`` got (once per hung call)."""
    group = comm.group_devices(comm_id)
    with _lock:
        if group is None or (comm_id, sequence) in _progress_published:
            return
        _progress_published.add((comm_id, sequence))
    mine = {rank: reached for c, rank, reached in module.watchdog_state()[0] if c == comm_id}
    client.key_value_set(_progress_key(group, sequence) + str(me), json.dumps(mine))
    logger.debug("jax_ncclx: published the progress of communicator %d for call #%d: %s", comm_id, sequence, mine)


_progress_published: set[tuple[int, int]] = set()
_publisher_started = threading.Event()
_publisher_stop = threading.Event()
_PUBLISH_POLL_S = 0.05


def _start_progress_publisher() -> None:
    """With several processes, a thread publishes this process's progress as soon as the watchdog finds an
    NCCL call hung or ended by a peer's failure: the main thread may stay blocked for long (``ncclCommAbort``
    waits on NCCL's own threads), and the other processes' :func:`check_errors` only wait a few seconds for
    the answer. The thread touches no JAX state, and stops at exit."""
    client = compat.distributed_client()
    if client is None or jax.process_count() == 1 or _publisher_started.is_set():
        return
    _publisher_started.set()
    module, me = lib.cuda_module(), jax.process_index()

    def publish_until_exit():
        while not _publisher_stop.wait(_PUBLISH_POLL_S):
            try:
                for comm_id, sequence in module.watchdog_state()[1]:
                    _publish_progress(module, client, me, comm_id, sequence)
            except Exception:  # noqa: BLE001 - check_errors publishes too
                logger.warning("jax_ncclx: the progress publisher stopped", exc_info=True)
                return

    atexit.register(_publisher_stop.set)
    threading.Thread(target=publish_until_exit, name="jax_ncclx-progress", daemon=True).start()


def _remote_progress(module, comm_id: int, sequence: int) -> str:
    """Names the ranks of other processes that did not reach NCCL call ``sequence`` on ``comm_id``, which NCCL
    cannot tell: every process publishes how far its ranks got in JAX's key-value store (its publisher thread
    when its watchdog finds the hang, or this function) and reads the others'. A process that does not answer
    within a few seconds died, hangs elsewhere or never joined the call, and is so named."""
    if (comm_id, sequence) in _remote_progress_seen:
        return _remote_progress_seen[comm_id, sequence]
    client = compat.distributed_client()
    group = comm.group_devices(comm_id)
    if client is None or group is None:
        return "unknown (no jax.distributed key-value store)"
    process_of = {d.id: d.process_index for d in jax.devices()}
    me = jax.process_index()
    key = _progress_key(group, sequence)
    try:
        _publish_progress(module, client, me, comm_id, sequence)
    except Exception:  # noqa: BLE001 - the others then name this process's ranks as silent
        logger.warning("jax_ncclx: could not publish this process's progress", exc_info=True)
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
                     f"{_PROGRESS_WAIT_S:g} s (their process died, hangs elsewhere, or never joined this call)")
    answer = "; ".join(parts) or "every rank reached it"
    _remote_progress_seen[comm_id, sequence] = answer
    return answer


def _forget() -> None:
    with _lock:
        _progress_published.clear()
        _remote_progress_seen.clear()
        _late_calls_checked.clear()


comm._on_destroy.append(_forget)
comm._on_register.append(_start_progress_publisher)


def warn_drops(op: str, dropped, axis_name, *, capacity: int, unit: str, detail: str = ""):
    """``JAX_NCCLX_WARN_DROPS=1`` (the caller checks it): a host callback that logs one warning per member that
    dropped anything past ``capacity``, with ``dropped`` int ``[..., N]`` per destination member."""
    jax.debug.callback(functools.partial(_log_drops, op=op, capacity=capacity, unit=unit, detail=detail),
                       dropped, jax.lax.axis_index(axis_name))


def _log_drops(dropped, member, *, op, capacity, unit, detail):
    dropped, member = np.asarray(dropped), np.asarray(member)
    if dropped.any():
        logger.warning("jax_ncclx.%s: member %s dropped %d %s past capacity %d%s; per destination member: %s", op,
                       member.tolist(), int(dropped.sum()), unit, capacity, detail, dropped.tolist())
