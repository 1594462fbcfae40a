"""Process-wide settings of jax_ncclx, read from ``JAX_NCCLX_*`` environment variables.

The variables are read when a collective is lowered (compiled), so a test or a program can change them between
compilations; a bad value raises at once with the variable's name and what it accepts.
"""

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings that apply to every collective compiled from now on.

    Attributes:
      timeout_s: seconds a participant waits for its peers before the collective fails with an error that
        names the ranks that did not arrive (``JAX_NCCLX_TIMEOUT_S``, default 600). Enforced by the CPU
        backend today.
      transport: how GPU ops that have an NVLink kernel move data (``JAX_NCCLX_TRANSPORT``): ``"auto"``
        (default) uses the NVLink kernel when every rank of the communicator reaches every other through
        NVLink peer access and NCCL otherwise, logging why; ``"nvlink"`` makes the fallback an error;
        ``"nccl"`` always uses NCCL.
      nvlink_blocks: thread blocks per NVLink kernel launch (``JAX_NCCLX_NVLINK_BLOCKS``); 0 (default) picks
        by message size. Capped at one block per SM (and at 64, or 32 for two-shot all_reduce).
      nvlink_oneshot_max_bytes: all_reduce inputs up to this many bytes per rank use the one-shot NVLink
        kernel, larger ones two-shot (``JAX_NCCLX_NVLINK_ONESHOT_MAX_BYTES``); None (default): the
        measured crossover for the GPU count, :func:`nvlink_thresholds`.
      nvlink_max_bytes: all_reduce / all_gather / all_to_all inputs up to this many bytes per rank use NVLink
        kernels, larger ones NCCL (``JAX_NCCLX_NVLINK_MAX_BYTES``); None (default): by GPU count. 0 sends
        every one of these ops to NCCL.
      nvlink_direct: when one process drives every GPU of the communicator, NVLink kernels write rows
        straight into the peers' outputs (``JAX_NCCLX_NVLINK_DIRECT=1``, default) instead of staging them in
        symmetric memory and copying them out (0; what one process per GPU always does).
      trace: NVLink kernels of programs compiled from now on record each call's device timeline
        (``JAX_NCCLX_TRACE=1``; default 0, and then they record nothing); read it with
        ``jax_ncclx._src.trace.device_timeline()``.
    """

    timeout_s: float = 600.0
    transport: str = "auto"
    nvlink_blocks: int = 0
    nvlink_oneshot_max_bytes: int | None = None
    nvlink_max_bytes: int | None = None
    nvlink_direct: bool = True
    trace: bool = False


TRANSPORTS = ("auto", "nvlink", "nccl")


def _positive_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name}={raw!r} is not valid: it must be a positive number of seconds")
    return value


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(name, "")
    value = raw.strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={raw!r} is not valid: it must be one of {', '.join(choices)}")
    return value


def _non_negative_int(name: str, default):
    raw = os.environ.get(name, "")
    if raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}={raw!r} is not valid: it must be an integer >= 0")
    return value


# GPU count -> (one-shot max, NVLink max) bytes per rank; other counts take the entry of the nearest count
# above. 2 GPUs: measured on 2xH200 (benchmarks/collectives.py: one-shot beats two-shot up to 4 MiB, NVLink
# beats NCCL and XLA up to 64 MiB; capped at 16 MiB, where the slots take 64 MiB). 4 and 8: provisional.
NVLINK_THRESHOLDS = {2: (4 << 20, 16 << 20), 4: (256 << 10, 4 << 20), 8: (64 << 10, 2 << 20)}


def nvlink_thresholds(size: int, settings: "Config | None" = None) -> tuple[int, int]:
    """(one-shot max, NVLink max) bytes per rank for a communicator of ``size`` GPUs: the environment's
    values where set, else the measured defaults of :data:`NVLINK_THRESHOLDS`."""
    settings = settings or current()
    counts = sorted(NVLINK_THRESHOLDS)
    oneshot, largest = NVLINK_THRESHOLDS[next((c for c in counts if c >= size), counts[-1])]
    if settings.nvlink_oneshot_max_bytes is not None:
        oneshot = settings.nvlink_oneshot_max_bytes
    if settings.nvlink_max_bytes is not None:
        largest = settings.nvlink_max_bytes
    return oneshot, largest


def current() -> Config:
    """The settings in force now, from the environment."""
    return Config(
        timeout_s=_positive_float("JAX_NCCLX_TIMEOUT_S", Config.timeout_s),
        transport=_choice("JAX_NCCLX_TRANSPORT", Config.transport, TRANSPORTS),
        nvlink_blocks=_non_negative_int("JAX_NCCLX_NVLINK_BLOCKS", Config.nvlink_blocks),
        nvlink_oneshot_max_bytes=_non_negative_int("JAX_NCCLX_NVLINK_ONESHOT_MAX_BYTES", None),
        nvlink_max_bytes=_non_negative_int("JAX_NCCLX_NVLINK_MAX_BYTES", None),
        nvlink_direct=_choice("JAX_NCCLX_NVLINK_DIRECT", "1", ("0", "1")) == "1",
        trace=_choice("JAX_NCCLX_TRACE", "0", ("0", "1")) == "1",
    )
