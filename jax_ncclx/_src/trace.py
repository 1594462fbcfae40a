"""Collective tracing (CollTrace-style): what every jax_ncclx call did, on every rank.

Programs compiled with ``JAX_NCCLX_TRACE=1`` record each call in their handler: the op, its sequence number
on its communicator (the n-th call of that rank on it; the same n on every rank names the same collective),
axis, group, bytes, dtype, transport and algorithm, and per rank the host time the call was queued
(``enqueue_ns``), began (``start_ns``; on GPU a CUDA event before the work) and ended (``end_ns``; an event
after it). On CPU ``arrive_ns`` is when every peer had arrived. Times are nanoseconds of the host's system
clock, comparable across the processes of a host. With tracing off (the default) nothing is recorded and the
handlers pay nothing. Calls inside CUDA graphs (command buffers) are not recorded: replays never reach the host.

:func:`records` reads them, :func:`dump` writes a Chrome-trace / Perfetto JSON file per process,
:func:`summary` gives latency percentiles per op, and ``python -m jax_ncclx.trace merge DUMP...`` lines up
the dumps of all ranks and names, per call, the slowest rank and any rank that never started.

NVLink kernels compiled with tracing also stamp their own device timeline (:func:`device_timeline`), from the
GPU's ``%globaltimer``: when the kernel started, saw its peers, sent, received and finished.
"""

import json
import logging
import os
import socket
import statistics

import jax
import numpy as np

from jax_ncclx._src import comm
from jax_ncclx._src import config
from jax_ncclx._src import contract
from jax_ncclx._src import lib

logger = logging.getLogger("jax_ncclx")

_MAX_HISTORY = 1 << 20

_sites: dict[int, dict] = {}
_history: list[dict] = []


def register_call_site(module, site: int, info: dict):
    """Remembers what call site ``site`` is (op, axis, groups, bytes, dtype, transport, algorithm) and names
    its axis to ``module``'s handlers for their error messages. Called by the lowering."""
    _sites[site] = info
    module.name_call_site(site, repr(info["axis"]))


def _device_ids() -> dict[int, int]:
    return {d.local_hardware_id: d.id for d in jax.local_devices() if d.platform == "gpu"}


def _describe(r: dict, on_gpu: bool, device_ids: dict[int, int]) -> dict:
    """A record as :func:`records` gives it, from one of the native modules' ``call_records()``."""
    info = _sites.get(r["site"], {})
    groups = info.get("groups", [])
    if on_gpu:
        device_id = device_ids.get(r["device"])
        group = next((g for g in groups if device_id in g), [])
    else:
        group = groups[r["group_index"]] if 0 <= r["group_index"] < len(groups) else []
    injected = r.pop("injected")
    return dict(op=info.get("op", "?"), seq=r["seq"], axis=info.get("axis"), group=list(group), rank=r["rank"],
                size=len(group), process=jax.process_index(), host=socket.gethostname(), device=r["device"],
                bytes=info.get("bytes"), dtype=info.get("dtype"), transport=info.get("transport"),
                algorithm=info.get("algorithm"), enqueue_ns=r["enqueue_ns"], start_ns=r["start_ns"],
                arrive_ns=r["arrive_ns"], end_ns=r["end_ns"],
                failed=None if on_gpu else bool(r["end_ns"] and not r["arrive_ns"]),  # CPU: its round abandoned
                injected=contract.FAULT_KINDS[injected] if injected >= 0 else None, site=r["site"], comm=r["comm"])


def records() -> list[dict]:
    """Every call traced in this process so far (since :func:`reset`), oldest first per backend.

    Each is a dict: ``op``, ``seq``, ``axis``, ``group`` (the group's device ids on GPU, partition ids on CPU),
    ``rank`` (in the group), ``size``, ``process``, ``host``, ``device``, ``bytes`` / ``dtype`` of the
    operand, ``transport`` ("nvlink", "nccl" or "cpu"), ``algorithm``, ``enqueue_ns``, ``start_ns``,
    ``arrive_ns`` (CPU), ``end_ns`` (0: not reached, e.g. a call still running or that never started),
    ``failed`` (CPU: True for a call that ended without its peers, a timeout; None on GPU, where
    :func:`jax_ncclx.check_errors` reports failures), ``injected`` (the fault injected into the call, or
    None), ``site`` and ``comm``. Reading a GPU call's times needs its CUDA events to have completed; calls
    still running read as not ended.
    """
    device_ids = None
    for module, on_gpu in ((lib.cpu_module(), False), (lib.cuda_module_if_available(), True)):
        if module is None:
            continue
        raw = module.call_records()
        if raw and on_gpu and device_ids is None:
            device_ids = _device_ids()
        _history.extend(_describe(r, on_gpu, device_ids or {}) for r in raw)
    del _history[:-_MAX_HISTORY]
    return list(_history)


def reset():
    """Forgets every recorded call."""
    records()
    _history.clear()


def _percentiles(values_ns: list[int]) -> dict:
    us = np.asarray(values_ns, dtype=np.float64) / 1e3
    return dict(p50_us=float(np.percentile(us, 50)), p90_us=float(np.percentile(us, 90)),
                p99_us=float(np.percentile(us, 99)), max_us=float(us.max()))


def summary(calls: list[dict] | None = None) -> dict[str, dict]:
    """Latency percentiles per op and algorithm, over every rank's finished calls.

    Args:
      calls: the records to summarize (as :func:`records` returns them); None: :func:`records` itself.

    Returns:
      ``{"all_reduce/nvlink/one_shot": {"calls", "unfinished", "failed", "p50_us", "p90_us", "p99_us",
      "max_us", "queue_p50_us"}, ...}``: percentiles of end - start (µs) over the calls that finished, calls
      that never ended, calls that ended failed (CPU; left out of the percentiles), and the median time from
      the handler queueing the call to its start (on GPU, the work ahead of it on the stream).
    """
    calls = records() if calls is None else calls
    by_op: dict[str, list[dict]] = {}
    for c in calls:
        by_op.setdefault(f"{c['op']}/{c['transport']}/{c['algorithm']}", []).append(c)
    out = {}
    for key, group in sorted(by_op.items()):
        ended = [c for c in group if c["start_ns"] and c["end_ns"] >= c["start_ns"]]
        done = [c for c in ended if not c.get("failed")]
        entry = dict(calls=len(group), unfinished=len(group) - len(ended), failed=len(ended) - len(done))
        if done:
            entry.update(_percentiles([c["end_ns"] - c["start_ns"] for c in done]))
            entry["queue_p50_us"] = statistics.median((c["start_ns"] - c["enqueue_ns"]) / 1e3 for c in done)
        out[key] = entry
    return out


def dump(path: str | os.PathLike) -> str:
    """Writes this process's traced calls to ``path`` as Chrome-trace JSON (open it in https://ui.perfetto.dev
    or chrome://tracing): one track per rank, one slice per call from start to end, the record in its args.
    The raw records go under the ``"jax_ncclx"`` key for ``python -m jax_ncclx.trace merge``. Returns the path.
    With tracing off and nothing recorded, it still writes the (empty) trace, and logs a warning.
    """
    calls = records()
    if not calls and not config.current().trace:
        logger.warning("jax_ncclx.trace.dump: tracing is off, so %s holds no calls; set JAX_NCCLX_TRACE=1 before "
                       "the programs are compiled to record them", os.fspath(path))
    process = jax.process_index()
    events = [dict(name="process_name", ph="M", pid=process, args=dict(name=f"process {process}"))]
    tracks = {}
    for c in calls:
        tid = tracks.setdefault((c["transport"] == "cpu", c["device"]), len(tracks))
        if c["start_ns"] == 0:
            events.append(dict(name=f"{c['op']} #{c['seq']} never started", ph="i", s="t", pid=process, tid=tid,
                               ts=c["enqueue_ns"] / 1e3, cat="jax_ncclx", args=c))
            continue
        end = c["end_ns"] if c["end_ns"] >= c["start_ns"] else c["start_ns"]
        events.append(dict(name=f"{c['op']} #{c['seq']}", ph="X", pid=process, tid=tid, ts=c["start_ns"] / 1e3,
                           dur=(end - c["start_ns"]) / 1e3, cat=f"jax_ncclx,{c['transport']}", args=c))
    for (cpu, device), tid in tracks.items():
        events.append(dict(name="thread_name", ph="M", pid=process, tid=tid,
                           args=dict(name=f"{'partition' if cpu else 'GPU'} {device}")))
    with open(path, "w") as f:
        json.dump(dict(traceEvents=events, displayTimeUnit="ns",
                       jax_ncclx=dict(process=process, host=socket.gethostname(), calls=calls)), f)
    return os.fspath(path)


def merge(dumps: list) -> list[dict]:
    """Lines up the calls of several dumps (e.g. one per process) by group and sequence number.

    Args:
      dumps: each a file :func:`dump` wrote (a path), its JSON loaded, or that JSON's ``"jax_ncclx"`` part.

    Returns:
      One dict per collective, ordered by group and seq: ``group``, ``seq``, ``op`` (the ops seen, joined by
      "|" when ranks disagree), ``ranks`` (how many recorded it), ``never_started`` (ranks of the group with no
      record or a record that never started), ``unfinished`` (ranks that started but never ended),
      ``slowest_rank`` (the last to end), ``late_rank`` (the last to start), ``start_spread_us`` (last start -
      first start) and ``duration_us`` (first start to last end).

    A rank recorded twice for one collective (dumps of different runs, or one dump given twice) is logged as
    a warning.

    Raises:
      TypeError: an entry that is none of the three.
    """
    calls: dict[tuple, list[dict]] = {}
    for d in dumps:
        for c in _recorded_calls(d):
            calls.setdefault((tuple(c["group"]), c["seq"]), []).append(c)
    twice = sorted(key for key, seen in calls.items() if len({c["rank"] for c in seen}) < len(seen))
    if twice:  # one rank's call recorded more than once: not dumps of one run
        logger.warning("jax_ncclx.trace.merge: %d collective(s) hold two records of one rank (first: group %s, seq "
                       "%d): the dumps are of different runs, or one was given twice", len(twice), list(twice[0][0]),
                       twice[0][1])
    out = []
    for (group, seq), seen in sorted(calls.items()):
        size = max(len(group), max(c["size"] for c in seen))
        started = [c for c in seen if c["start_ns"]]
        ended = [c for c in started if c["end_ns"] >= c["start_ns"] > 0 and c["end_ns"]]
        entry = dict(group=list(group), seq=seq, op="|".join(sorted({c["op"] for c in seen})), ranks=len(seen),
                     never_started=sorted(set(range(size)) - {c["rank"] for c in started}),
                     unfinished=sorted({c["rank"] for c in started} - {c["rank"] for c in ended}),
                     slowest_rank=None, late_rank=None, start_spread_us=None, duration_us=None)
        if started:
            entry["late_rank"] = max(started, key=lambda c: c["start_ns"])["rank"]
            entry["start_spread_us"] = (max(c["start_ns"] for c in started) - min(c["start_ns"] for c in started)) / 1e3
        if ended:
            entry["slowest_rank"] = max(ended, key=lambda c: c["end_ns"])["rank"]
            entry["duration_us"] = (max(c["end_ns"] for c in ended) - min(c["start_ns"] for c in started)) / 1e3
        out.append(entry)
    return out


def _recorded_calls(dump_or_path) -> list[dict]:
    """The call records of one :func:`merge` argument."""
    part = dump_or_path
    if isinstance(part, (str, os.PathLike)):
        with open(part) as f:
            part = json.load(f)
    if isinstance(part, dict) and "jax_ncclx" in part:
        part = part["jax_ncclx"]
    if not isinstance(part, dict) or "calls" not in part:
        raise TypeError(f"jax_ncclx.trace.merge: expected a file written by jax_ncclx.trace.dump, its JSON or the "
                        f"JSON's 'jax_ncclx' part, got {type(dump_or_path).__name__} {str(dump_or_path)[:80]!r}")
    return part["calls"]


def device_timeline(comm_ids=None) -> list[dict]:
    """Every recorded call on every local rank, oldest first per rank.

    Args:
      comm_ids: communicators to read (default: every communicator made so far).

    Returns:
      One dict per (call, rank): ``comm_id``, ``device``, ``rank``, ``epoch`` (the call's number on its
      communicator), ``kernel`` (name), ``blocks``, and ``start_ns``, ``peers_ns``, ``sent_ns``, ``data_ns``, ``end_ns``
      and ``ready_ns`` (when the last block finished its work before its first write: moe.dispatch's plan)
      (GPU clock; a ``*_ns`` that no block of the call set holds an older call's time). Empty on a CPU-only
      build or when no traced NVLink kernel ran.
    """
    module = lib.cuda_module_if_available()
    if module is None:
        return []
    records = []
    for comm_id in comm.all_comm_ids() if comm_ids is None else comm_ids:
        for device, rank, calls in module.device_trace(comm_id):
            for call in calls:
                record = dict(call, comm_id=comm_id, device=device, rank=rank)
                record["kernel"] = contract.TRACE_KERNELS.get(record["kernel"], str(record["kernel"]))
                records.append(record)
    return records


def summarize(records: list[dict]) -> dict:
    """Medians, in µs over all ranks, of where each call's time went.

    Returns:
      ``calls`` (records summarized), ``kernel_us`` (start to end), ``wait_peers_us`` (start until the last
      block's peer entered: lateness of the other GPUs), ``send_us`` (peers entered until the last block had sent
      its rows), ``wait_data_us`` (peers entered until the last block's data arrived), ``finish_us`` (data arrived
      until the end), ``ready_us`` (start until the last block had done its own work before sending:
      moe.dispatch's plan; None for the other kernels), and ``gap_us``: from the end of one call to the start of
      the next call on the same GPU, for consecutive calls (idle GPU time between kernels, e.g. waiting for the
      host to launch). A value is None when no record has it.
    """
    def median(values):
        values = [v / 1e3 for v in values]
        return statistics.median(values) if values else None

    valid = [r for r in records if r["start_ns"] <= r["end_ns"]]
    def spans(a, b):
        return [r[b] - r[a] for r in valid if r[a] <= r[b] and r[a] >= r["start_ns"] and r[b] <= r["end_ns"]]
    gaps = []
    by_rank = {}
    for r in valid:
        by_rank.setdefault((r["comm_id"], r["device"]), []).append(r)
    for calls in by_rank.values():
        calls.sort(key=lambda r: r["epoch"])
        gaps += [b["start_ns"] - a["end_ns"] for a, b in zip(calls, calls[1:]) if b["epoch"] == a["epoch"] + 1]
    return dict(calls=len(valid), kernel_us=median(spans("start_ns", "end_ns")),
                wait_peers_us=median(spans("start_ns", "peers_ns")), send_us=median(spans("peers_ns", "sent_ns")),
                wait_data_us=median(spans("peers_ns", "data_ns")),
                finish_us=median(spans("data_ns", "end_ns")), ready_us=median(spans("start_ns", "ready_ns")),
                gap_us=median(gaps))
