"""Device timelines of the NVLink kernels: what each GPU did during each call, from its own clock.

A program compiled with ``JAX_NCCLX_TRACE=1`` makes its NVLink kernels stamp every call with the GPU's
``%globaltimer`` (nanoseconds): when the kernel started, when the last block saw its peer enter the call,
when the last block had sent its rows, when the last block saw its data arrive, and when the last block
finished. Each communicator keeps the last
1024 calls per rank in device memory; reading them waits for the GPUs to go idle.

Times of one GPU compare with each other exactly. Across GPUs they compare only as well as the GPUs'
timers agree, so the summary keeps to per-GPU differences.
"""

import statistics

from jax_ncclx._src import comm
from jax_ncclx._src import lib

KERNELS = {1: "all_to_allv_dynamic", 2: "all_reduce", 3: "all_gather", 4: "all_to_all"}  # TraceKernel
_FIELDS = ("epoch", "start_ns", "peers_ns", "sent_ns", "data_ns", "end_ns", "blocks", "kernel")


def device_timeline(comm_ids=None) -> list[dict]:
    """Every recorded call on every local rank, oldest first per rank.

    Args:
      comm_ids: communicators to read (default: every communicator made so far).

    Returns:
      One dict per (call, rank): ``comm_id``, ``device``, ``rank``, ``epoch`` (the call's number on its
      communicator), ``kernel`` (name), ``blocks``, and ``start_ns``, ``peers_ns``, ``sent_ns``, ``data_ns``, ``end_ns``
      (GPU clock; a ``*_ns`` that no block of the call set holds an older call's time). Empty on a CPU-only
      build or when no traced program ran.
    """
    module = lib.cuda_module_if_available()
    if module is None:
        return []
    records = []
    for comm_id in comm.all_comm_ids() if comm_ids is None else comm_ids:
        for device, rank, calls in module.device_trace(comm_id):
            for call in calls:
                record = dict(zip(_FIELDS, call), comm_id=comm_id, device=device, rank=rank)
                record["kernel"] = KERNELS.get(record["kernel"], str(record["kernel"]))
                records.append(record)
    return records


def summarize(records: list[dict]) -> dict:
    """Medians, in µs over all ranks, of where each call's time went.

    Returns:
      ``calls`` (records summarized), ``kernel_us`` (start to end), ``wait_peers_us`` (start until the last
      block's peer entered: lateness of the other GPUs), ``send_us`` (peers entered until the last block had
      sent its rows), ``wait_data_us`` (peers entered until the last block's data arrived), ``finish_us`` (data arrived until the end), and ``gap_us``: from the end of one
      call to the start of the next call on the same GPU, for consecutive calls (idle GPU time between
      kernels, e.g. waiting for the host to launch). A value is None when no record has it.
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
                finish_us=median(spans("data_ns", "end_ns")), gap_us=median(gaps))
