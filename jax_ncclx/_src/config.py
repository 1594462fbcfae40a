"""Process-wide settings of jax_ncclx, read from ``JAX_NCCLX_*`` environment variables.

The variables are read when a collective is lowered (compiled), so a test or a program can change them between
compilations; a bad value raises at once with the variable's name and what it accepts. They are also read once at
import, so that a bad value in the environment fails there; a ``JAX_NCCLX_*`` name that is no variable (a typo)
is logged as a warning, with the nearest variable's name, once per name.
"""

import dataclasses
import difflib
import logging
import math
import os
import re

from jax_ncclx._src import contract


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings that apply to every collective compiled from now on.

    Attributes:
      timeout_s: seconds a participant waits for its peers before the collective fails with an error that
        names the call and the ranks that did not arrive (``JAX_NCCLX_TIMEOUT_S``, default 600);
        ``JAX_NCCLX_TIMEOUT_S_<OP>`` (e.g. ``JAX_NCCLX_TIMEOUT_S_ALL_TO_ALLV_DYNAMIC``) overrides it for one
        op, see :meth:`timeout_s_for`. 0 waits forever (no device deadline, no watchdog on NCCL calls).
      op_timeouts_s: those per-op overrides, by op name.
      warn_after_s: seconds a participant waits for late peers before one warning on stderr names the call and
        the ranks still missing; it goes on waiting until the timeout (``JAX_NCCLX_WARN_AFTER_S``, default 20;
        0: no warning). Every path warns except calls replayed from a CUDA graph (command buffers).
      transport: how GPU ops that have an NVLink kernel move data (``JAX_NCCLX_TRANSPORT``): ``"auto"``
        (default) uses the NVLink kernel when every rank of the communicator reaches every other through
        NVLink peer access and NCCL otherwise, logging why; ``"nvlink"`` makes the fallback an error;
        ``"nccl"`` always uses NCCL.
      nvlink_blocks: thread blocks per NVLink kernel launch (``JAX_NCCLX_NVLINK_BLOCKS``); 0 (default) picks
        by message size. Capped at 64 and one block per SM; all_to_allv_dynamic takes up to 64 per peer and
        as many as fit on the GPU at once.
      nvlink_oneshot_max_bytes: all_reduce inputs up to this many bytes per rank use the one-shot NVLink
        kernel, larger ones two-shot (``JAX_NCCLX_NVLINK_ONESHOT_MAX_BYTES``); None (default): the
        measured crossover for the GPU count, :func:`nvlink_thresholds`.
      nvlink_max_bytes: all_reduce / all_gather / all_to_all / reduce_scatter inputs up to this many bytes per
        rank use NVLink kernels, larger ones NCCL (``JAX_NCCLX_NVLINK_MAX_BYTES``, every op); None (default):
        by GPU count and op. 0 sends every one of these ops to NCCL.
      nvlink_protocol: how one-shot NVLink collectives (all_reduce, all_gather, all_to_all, reduce_scatter)
        move segments (what one rank sends one peer) of up to 64 KiB (``JAX_NCCLX_NVLINK_PROTOCOL``, NCCL's
        names): ``"ll"`` 8-byte words of 4 payload bytes and a tag (twice the bytes; the lowest latency);
        ``"ll128"`` 128-byte lines of 120 payload bytes and a flag (1/16 flags; about 0.5 us more latency on
        H200, and it relies on NVLink delivering a warp's 128-byte store whole, as NCCL's LL128 does);
        ``"simple"`` the payload, then a flag per thread block; ``"auto"`` (default) LL below
        ``nvlink_ll128_min_bytes`` per segment, LL128 from there.
        Larger segments, and those not a multiple of 4 bytes, always use simple.
      nvlink_ll128_min_bytes: with ``"auto"``, the segment size from which LL128 replaces LL, every op
        (``JAX_NCCLX_NVLINK_LL128_MIN_BYTES``); None (default): the measured crossover for the GPU count and
        op, :func:`ll128_min_bytes`.
      nvlink_direct: when one process drives every GPU of the communicator, NVLink kernels write rows
        straight into the peers' outputs (``JAX_NCCLX_NVLINK_DIRECT=1``, default) instead of staging them in
        symmetric memory and copying them out (0; what one process per GPU always does): all_to_allv_dynamic,
        the two-shot all_reduce's all-gather, and all_gather / all_to_all from ``nvlink_direct_min_bytes``.
      nvlink_direct_min_bytes: all_gather / all_to_all write into the peers' outputs (with ``nvlink_direct``)
        once a receiver would copy at least this many bytes out of the slots, (N - 1) times the segment
        (``JAX_NCCLX_NVLINK_DIRECT_MIN_BYTES``, default 4 MiB): below that the wait for the peers to enter the
        call, which writes into their outputs must await, costs more than the copy it saves.
      trace: programs compiled from now on record every collective call (``JAX_NCCLX_TRACE=1``; default 0,
        and then they record nothing): op, sequence number, axis, bytes, algorithm and per-rank times, read
        with :mod:`jax_ncclx.trace`; NVLink kernels also stamp their device timeline.
      trace_device: NVLink kernels stamp their device timeline (``JAX_NCCLX_TRACE=1`` or ``device``; the
        latter records nothing on the host, so it adds no host work per call).
      faults: faults to inject into calls of programs compiled from now on (``JAX_NCCLX_FAULT``; default
        none), see :class:`Fault`.
      checksum: collectives traced from now on verify their payload end to end (``JAX_NCCLX_CHECKSUM=1``),
        see docs/reliability.md, "Checksum mode".
      init_ranks_per_root: communicators of more ranks than this are created with NCCL's multi-root
        ``ncclCommInitRankScalable``, one unique id (root) per this many ranks, at most ``init_max_roots``
        (``JAX_NCCLX_INIT_RANKS_PER_ROOT``, default 1024; 0 always uses one root).
      init_max_roots: the most roots of one communicator (``JAX_NCCLX_INIT_MAX_ROOTS``, default 32): every
        member reads every root's id, so this bounds each process's key-value reads per communicator.
      nccl_command_buffers: the NCCL path of all_reduce, all_gather, reduce_scatter, all_to_all and ppermute
        (not all_to_allv_dynamic's) lowers to handlers marked command-buffer compatible
        (``JAX_NCCLX_NCCL_COMMAND_BUFFERS=1``; default 0), so that XLA records their NCCL launches into the
        CUDA graphs of its command buffers with the rest of the program (XLA records custom calls there by
        default, in runs of at least 5 recordable ops), which makes them faster than XLA's own collectives
        (``benchmarks/results/collectives_2gpu_cmdbuf.md``; docs/performance.md, "Small collectives"). The cost:
        a replayed graph does not come back to the host, so the watchdog times those calls only with
        ``watch_replays``; without it a peer that never arrives hangs them instead of failing with its name.
        The NVLink kernels bound their own waits and are recorded either way. Where ``XLA_FLAGS`` record loops
        or conditionals (:func:`xla_records_loops`), a call lowered inside a loop body, a branch or a nested
        jitted function (which a loop may call) keeps the un-recorded handler: NCCL's graph-mixing nodes make
        those graphs fail to instantiate.
      watch_replays: calls that XLA replays from CUDA graphs are watched (``JAX_NCCLX_WATCH_REPLAYS=1``;
        default 0). The NCCL ones are timed like the others (read when XLA captures a call): a call whose peers
        do not arrive within its timeout fails, naming the call and the local ranks that never reached it, and
        its communicator is revoked (``ncclCommRevoke``, which keeps the resources the graphs use); that costs
        a one-thread kernel after each captured call, which counts the replays that get past it
        (``xla_ffi/common/replay_watch.h``). And every call that XLA may record into a graph (NVLink, and NCCL
        with ``nccl_command_buffers``) lowers (at compile time) to a handler with a prepare stage that makes an
        execution fail once its communicator has failed, instead of replaying on it with undefined outputs.
        That costs host time per call in every execution, before the program launches (the ``nx-watched`` rows
        of ``benchmarks/results/launch_floor_1gpu.md``).
      nccl_max_ctas: the most thread blocks (channels) NCCL may use per call on communicators created from
        now on (``JAX_NCCLX_NCCL_MAX_CTAS``, NCCL's ``ncclConfig_t.maxCTAs``; default 0: NCCL's choice, 24-32
        on H200). NCCL allocates a few KiB per channel at init, each in its own 2 MiB cuMem granule, so an idle
        communicator holds about 6 MiB per channel: fewer channels make it leaner, at the cost of NCCL's
        bandwidth on large messages (docs/performance.md, "Start-up and memory").
      warn_drops: ``jax_ncclx.moe.dispatch`` and ``ragged_all_to_all`` calls traced from now on log a warning
        from the host whenever a member drops pairs or rows past ``capacity`` / ``max_recv_per_peer``, naming
        the member and the count per destination (``JAX_NCCLX_WARN_DROPS=1``; default 0: moe's drops are
        counted in ``handle.dropped`` only, ragged_all_to_all's nowhere). A host callback
        per call: for finding a capacity, not for production runs.
    """

    timeout_s: float = 600.0
    op_timeouts_s: tuple[tuple[str, float], ...] = ()
    warn_after_s: float = 20.0
    transport: str = "auto"
    nvlink_blocks: int = 0
    nvlink_oneshot_max_bytes: int | None = None
    nvlink_max_bytes: int | None = None
    nvlink_protocol: str = "auto"
    nvlink_ll128_min_bytes: int | None = None
    nvlink_direct: bool = True
    nvlink_direct_min_bytes: int = 4 << 20
    trace: bool = False
    trace_device: bool = False
    faults: tuple["Fault", ...] = ()
    checksum: bool = False
    init_ranks_per_root: int = 1024
    init_max_roots: int = 32
    nccl_command_buffers: bool = False
    watch_replays: bool = False
    nccl_max_ctas: int = 0
    warn_drops: bool = False

    def init_roots(self, size: int) -> int:
        """How many unique ids (roots) a communicator of ``size`` ranks is created with."""
        if self.init_ranks_per_root == 0 or size <= self.init_ranks_per_root:
            return 1
        return max(1, min(self.init_max_roots, -(-size // self.init_ranks_per_root)))

    @property
    def trace_attr(self) -> int:
        """The handlers' ``trace`` attribute: 0 nothing, 1 host records and device timeline, 2 device only."""
        return 1 if self.trace else 2 if self.trace_device else 0

    def timeout_s_for(self, op: str) -> float:
        """The timeout of ``op`` ("all_reduce", ...): its ``JAX_NCCLX_TIMEOUT_S_<OP>`` if set, else timeout_s."""
        return dict(self.op_timeouts_s).get(op, self.timeout_s)

    @property
    def warn_ms(self) -> int:
        """The handlers' ``warn_ms`` attribute: the warning's grace in whole milliseconds, rounded up (0: none)."""
        return math.ceil(self.warn_after_s * 1000)

    def timeout_ms_for(self, op: str) -> int:
        """The handlers' ``timeout_ms`` attribute for ``op``: its timeout in whole milliseconds, rounded up, so that
        a positive timeout under 1 ms stays a timeout rather than becoming 0 (wait forever)."""
        return math.ceil(self.timeout_s_for(op) * 1000)




@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault: rank ``rank`` of a communicator, at its call number ``seq`` on it (0 = its first
    jax_ncclx call on that communicator, as the trace numbers calls).

    Kinds: ``delay`` (the rank starts the call ``ms`` milliseconds late), ``skip`` (the rank does not take
    part: its peers wait for it until they time out; its outputs are left unwritten), ``corrupt_counts``
    (all_to_allv_dynamic: the rank's send counts are replaced by huge negative and positive values, which
    the op must clamp and report in ``dropped``), ``corrupt_payload`` (4 bytes in the middle of the rank's
    output are overwritten with 0xA5 after the call, which checksum mode must catch), ``stall`` (GPU: a kernel
    on the rank's stream spins for ``ms`` milliseconds before the call, so the rank arrives late in every
    replay of a CUDA graph that captured it too; CPU: as ``delay``).
    """

    kind: str
    rank: int
    seq: int
    ms: int = 0


MAX_FAULTS = 1024  # the handlers look faults up by (rank, call number) in every call


def parse_faults(text: str) -> tuple[Fault, ...]:
    """Parses ``JAX_NCCLX_FAULT``: faults separated by ``;``, each ``kind:rank=R,seq=S[,ms=M]``, where ``seq``
    may be a range ``A-B`` (calls A to B, both included), e.g. ``"skip:rank=2,seq=3;stall:rank=0,seq=5-9,ms=20"``.
    At most :data:`MAX_FAULTS` faults in all."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, _, fields = item.partition(":")
        try:
            values = {}
            for field in filter(None, (field.strip() for field in fields.split(","))):
                key, value = (part.strip() for part in field.split("=", 1))
                first, dash, last = value.partition("-") if key == "seq" else (value, "", "")
                values[key] = (int(first), int(last if dash else first))
        except ValueError:
            values = None
        if kind not in contract.FAULT_KINDS or values is None or not {"rank", "seq"} <= set(values) or \
                not set(values) <= {"rank", "seq", "ms"} or min(min(pair) for pair in values.values()) < 0 or \
                values["seq"][0] > values["seq"][1]:
            raise ValueError(
                f"JAX_NCCLX_FAULT: cannot parse {item!r}; expected kind:rank=R,seq=S[,ms=M] (seq may be a range "
                f"A-B with A <= B) with kind one of {', '.join(contract.FAULT_KINDS)} and non-negative integers")
        (rank, _), (first, last), (ms, _) = values["rank"], values["seq"], values.get("ms", (0, 0))
        if len(faults) + last - first + 1 > MAX_FAULTS:
            raise ValueError(f"JAX_NCCLX_FAULT: more than {MAX_FAULTS} faults ({text!r})")
        faults.extend(Fault(kind, rank, seq, ms) for seq in range(first, last + 1))
    return tuple(faults)


def describe_faults(faults: tuple[Fault, ...]) -> str:
    """``faults`` in ``JAX_NCCLX_FAULT``'s syntax, with runs of consecutive calls written as ranges."""
    runs: list[list] = []  # [kind, rank, ms, first seq, last seq]
    for f in faults:
        if runs and runs[-1][:3] == [f.kind, f.rank, f.ms] and runs[-1][4] == f.seq - 1:
            runs[-1][4] = f.seq
        else:
            runs.append([f.kind, f.rank, f.ms, f.seq, f.seq])
    return ";".join(f"{kind}:rank={rank},seq={first}" + (f"-{last}" if last > first else "") +
                    (f",ms={ms}" if ms else "") for kind, rank, ms, first, last in runs)


TRANSPORTS = ("auto", "nvlink", "nccl")


_MAX_TIMEOUT_S = 1e9  # about 32 years, and its nanoseconds still fit the watchdog's uint64

# Read by the build (CMake through pip), not at run time.
BUILD_VARIABLES = ("JAX_NCCLX_CUDA", "JAX_NCCLX_CUDA_ARCHITECTURES", "JAX_NCCLX_TESTING")
_known_names: set[str] = set(BUILD_VARIABLES)  # grows with every variable current() reads
_warned_names: set[str] = set()
logger = logging.getLogger("jax_ncclx")


def _env(name: str, default=None):
    """os.environ.get(name, default), with `name` recorded as a variable of jax_ncclx."""
    _known_names.add(name)
    return os.environ.get(name, default)


def _warn_unknown_names() -> None:
    """Logs each JAX_NCCLX_* name in the environment that is no variable (once), with the nearest one."""
    for name in os.environ:
        if (not name.startswith("JAX_NCCLX_") or name.startswith(_TIMEOUT_PREFIX) or name in _known_names
                or name in _warned_names):
            continue
        _warned_names.add(name)
        nearest = difflib.get_close_matches(name, sorted(_known_names), n=1)
        logger.warning("%s is not a jax_ncclx variable and is ignored%s (docs/configuration.md lists them)", name,
                       f"; did you mean {nearest[0]}?" if nearest else "")


def _seconds(name: str, default: float, zero: str = "no timeout") -> float:
    raw = _env(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= _MAX_TIMEOUT_S:  # also refuses nan and inf: the handlers take whole milliseconds
        raise ValueError(f"{name}={raw!r} is not valid: it must be a number of seconds from 0 to {_MAX_TIMEOUT_S:.0e} "
                         f"(0: {zero})")
    return value


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = _env(name, "")
    value = raw.strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={raw!r} is not valid: it must be one of {', '.join(choices)}")
    return value


def _non_negative_int(name: str, default):
    raw = _env(name, "")
    if raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}={raw!r} is not valid: it must be an integer >= 0")
    return value


# GPU count -> (one-shot all_reduce max, {op: NVLink max}) bytes per rank; other counts take the entry of the
# nearest count above. Measured with benchmarks/collectives.py (--impls xla,nx-oneshot,nx-twoshot,nx-nccl):
# 2xH200: one-shot beats two-shot up to 4 MiB, NVLink beats NCCL and XLA up to 64 MiB; capped at 16 MiB,
# where the slots take 64 MiB. 4xH200 (collectives_4gpu_algorithms.md): one-shot all_reduce beats two-shot up
# to 512 KiB (12.9 vs 14.6 us), two-shot from 1 MiB; NVLink beats XLA up to 16 MiB for all three ops and
# loses at 64 MiB (all_reduce, all_gather). 8xH200 (collectives_8gpu_algorithms.md): one-shot beats two-shot
# up to 256 KiB (15.3 vs 21.0 us), two-shot from 1 MiB (23.0 vs 34.2); NVLink all_reduce and all_to_all beat
# XLA up to 16 MiB, all_gather up to 4 MiB (1.14x) and not at 16 MiB (0.90x); every op loses at 64 MiB.
# reduce_scatter (one-shot, with all_to_all's traffic: block j of every rank to rank j) takes all_to_all's
# limits: on 2xH200 (benchmarks/results/collectives_2gpu) it beats psum_scatter and NCCL up to 16 MiB (1.40x there);
# 4 and 8 GPUs not measured.
_EVERY_OP_UP_TO_16_MIB = {"all_reduce": 16 << 20, "all_gather": 16 << 20, "all_to_all": 16 << 20,
                          "reduce_scatter": 16 << 20}
NVLINK_THRESHOLDS = {
    2: (4 << 20, _EVERY_OP_UP_TO_16_MIB),
    4: (512 << 10, _EVERY_OP_UP_TO_16_MIB),
    8: (256 << 10, {"all_reduce": 16 << 20, "all_gather": 4 << 20, "all_to_all": 16 << 20,
                    "reduce_scatter": 16 << 20}),
}

# GPU count -> {op: segment bytes (what one rank sends one peer) from which "auto" takes LL128 over LL}, by
# the same nearest-count rule; counts above 4 take the 4-GPU entry (protocols not measured on 8).
# 2xH200: LL is 0.1-0.3 us faster at 8 B, level at 4 KiB, and LL128 moves
# all_to_all's 8 KiB segments 0.4 us faster. 4xH200 (plain and in command
# buffers): LL128 is 0.3-0.8 us faster for all_gather and all_to_all at every size from 8 B, while all_reduce
# keeps LL up to 4 KiB (0.1-0.2 us faster) and is faster in LL128 from 16 KiB (8 KiB, between the two, was
# not measured: it keeps the 2-GPU value). reduce_scatter takes all_reduce's values (its receivers reduce the
# words they poll, as one-shot all_reduce's do); on 2xH200 LL and LL128
# were level at 8 B, LL 0.2 us faster at 4 KiB and LL128 0.5 us faster at 16 KiB; 4 GPUs not measured.
NVLINK_LL128_MIN_BYTES = {
    2: {"all_reduce": 8 << 10, "all_gather": 8 << 10, "all_to_all": 8 << 10, "reduce_scatter": 8 << 10},
    4: {"all_reduce": 8 << 10, "all_gather": 0, "all_to_all": 0, "reduce_scatter": 8 << 10},
}


def _for_gpu_count(table: dict, size: int):
    """The entry of ``table`` (GPU count -> value) for ``size`` GPUs: the nearest count above, else the largest."""
    counts = sorted(table)
    return table[next((c for c in counts if c >= size), counts[-1])]


def nvlink_thresholds(size: int, op: str, settings: "Config | None" = None) -> tuple[int, int]:
    """(one-shot all_reduce max, NVLink max for ``op``) bytes per rank for a communicator of ``size`` GPUs:
    the environment's values where set, else the measured defaults of :data:`NVLINK_THRESHOLDS`."""
    settings = settings or current()
    oneshot, largest = _for_gpu_count(NVLINK_THRESHOLDS, size)
    largest = largest[op]
    if settings.nvlink_oneshot_max_bytes is not None:
        oneshot = settings.nvlink_oneshot_max_bytes
    if settings.nvlink_max_bytes is not None:
        largest = settings.nvlink_max_bytes
    return oneshot, largest


def ll128_min_bytes(size: int, op: str, settings: "Config | None" = None) -> int:
    """The segment bytes from which "auto" sends ``op``'s one-shot segments as LL128 lines rather than LL
    words on a communicator of ``size`` GPUs: ``JAX_NCCLX_NVLINK_LL128_MIN_BYTES`` where set, else the
    measured default of :data:`NVLINK_LL128_MIN_BYTES`."""
    settings = settings or current()
    if settings.nvlink_ll128_min_bytes is not None:
        return settings.nvlink_ll128_min_bytes
    return _for_gpu_count(NVLINK_LL128_MIN_BYTES, size)[op]


_LOOP_COMMANDS = {"WHILE", "CONDITIONAL"}


def xla_records_loops(xla_flags: str | None = None) -> bool:
    """Whether ``XLA_FLAGS`` (default: the environment's) make XLA record loops or conditionals into command
    buffers (``--xla_gpu_enable_command_buffer`` with WHILE or CONDITIONAL). XLA 0.11.2's default records
    neither. Each occurrence of the flag either edits the set (every entry +X / -X) or replaces it."""
    enabled: set[str] = set()
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    for value in re.findall(r"--xla_gpu_enable_command_buffer=(\S*)", flags):
        entries = [e.strip().upper() for e in value.strip("'\"").split(",") if e.strip()]
        if entries and all(e[0] in "+-" for e in entries):
            for e in entries:
                (enabled.add if e[0] == "+" else enabled.discard)(e[1:])
        else:
            enabled = set(entries)
    return bool(enabled & _LOOP_COMMANDS)


_TIMEOUT_PREFIX = "JAX_NCCLX_TIMEOUT_S_"
# The ops that JAX_NCCLX_TIMEOUT_S_<OP> can name: every primitive that communicates. jax_ncclx.moe runs on
# all_to_allv_dynamic; ragged_all_to_all's offsets travel by all_to_all.
TIMED_OPS = ("all_gather", "all_reduce", "all_to_all", "all_to_allv_dynamic", "ppermute", "ragged_all_to_all",
             "reduce_scatter")


def _op_timeouts() -> tuple[tuple[str, float], ...]:
    timeouts = []
    for name, raw in os.environ.items():
        if not name.startswith(_TIMEOUT_PREFIX) or not raw:
            continue
        op = name[len(_TIMEOUT_PREFIX):].lower()
        if op not in TIMED_OPS:
            raise ValueError(f"{name}: {op!r} is not an op with its own timeout; set one of "
                             + ", ".join(_TIMEOUT_PREFIX + o.upper() for o in TIMED_OPS)
                             + " (jax_ncclx.moe runs on ALL_TO_ALLV_DYNAMIC)")
        timeouts.append((op, _seconds(name, 0.0)))
    return tuple(sorted(timeouts))


def current() -> Config:
    """The settings in force now, from the environment."""
    op_timeouts = _op_timeouts()
    settings = Config(
        timeout_s=_seconds("JAX_NCCLX_TIMEOUT_S", Config.timeout_s),
        op_timeouts_s=op_timeouts,
        warn_after_s=_seconds("JAX_NCCLX_WARN_AFTER_S", Config.warn_after_s, zero="no warning"),
        transport=_choice("JAX_NCCLX_TRANSPORT", Config.transport, TRANSPORTS),
        nvlink_blocks=_non_negative_int("JAX_NCCLX_NVLINK_BLOCKS", Config.nvlink_blocks),
        nvlink_oneshot_max_bytes=_non_negative_int("JAX_NCCLX_NVLINK_ONESHOT_MAX_BYTES", None),
        nvlink_max_bytes=_non_negative_int("JAX_NCCLX_NVLINK_MAX_BYTES", None),
        nvlink_protocol=_choice("JAX_NCCLX_NVLINK_PROTOCOL", Config.nvlink_protocol,
                                ("auto",) + contract.NVLINK_PROTOCOLS),
        nvlink_ll128_min_bytes=_non_negative_int("JAX_NCCLX_NVLINK_LL128_MIN_BYTES", None),
        nvlink_direct=_choice("JAX_NCCLX_NVLINK_DIRECT", "1", ("0", "1")) == "1",
        nvlink_direct_min_bytes=_non_negative_int("JAX_NCCLX_NVLINK_DIRECT_MIN_BYTES",
                                                  Config.nvlink_direct_min_bytes),
        trace=_choice("JAX_NCCLX_TRACE", "0", ("0", "1", "device")) == "1",
        trace_device=_choice("JAX_NCCLX_TRACE", "0", ("0", "1", "device")) != "0",
        faults=parse_faults(_env("JAX_NCCLX_FAULT", "")),
        checksum=_choice("JAX_NCCLX_CHECKSUM", "0", ("0", "1")) == "1",
        init_ranks_per_root=_non_negative_int("JAX_NCCLX_INIT_RANKS_PER_ROOT", Config.init_ranks_per_root),
        init_max_roots=_non_negative_int("JAX_NCCLX_INIT_MAX_ROOTS", Config.init_max_roots),
        nccl_command_buffers=_choice("JAX_NCCLX_NCCL_COMMAND_BUFFERS", "0", ("0", "1")) == "1",
        watch_replays=_choice("JAX_NCCLX_WATCH_REPLAYS", "0", ("0", "1")) == "1",
        nccl_max_ctas=_non_negative_int("JAX_NCCLX_NCCL_MAX_CTAS", Config.nccl_max_ctas),
        warn_drops=_choice("JAX_NCCLX_WARN_DROPS", "0", ("0", "1")) == "1",
    )
    _warn_unknown_names()
    return settings


current()  # at import: a bad value in the environment fails here, naming its variable
