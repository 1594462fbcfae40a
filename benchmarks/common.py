"""Shared helpers of the benchmark scripts: run metadata, timing of jitted functions, result files, progress.

Importing this module sets the environment every benchmark wants before JAX starts (the scripts import it
before ``jax``); a value already in the environment wins:

- ``XLA_PYTHON_CLIENT_PREALLOCATE=false``: JAX allocates GPU memory as needed instead of taking 75 % of it up
  front, which leaves room for NCCL's own buffers and gives each size's arrays back when they are deleted.
- ``NCCL_NVLS_ENABLE=0``, ``NCCL_NVLINK_MULTICAST_ENABLE=0``: NVLink multicast stays off on the shared machines.
"""

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NCCL_NVLINK_MULTICAST_ENABLE", "0")

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_DIR = Path(__file__).resolve().parent.parent
ENV_PREFIXES = ("XLA_", "NCCL_", "JAX_NCCLX_", "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES")


# ---- progress ----------------------------------------------------------------------------------------------

class Progress:
    """Prints timestamped progress lines (seconds since start), flushed at once so long runs can be followed."""

    def __init__(self):
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, message: str):
        print(f"[{self.elapsed():7.1f} s] {message}", flush=True)

    def warn(self, message: str):
        self(f"WARNING: {message}")


def stop_on_sigterm():
    """Makes SIGTERM (from ``timeout`` or a job scheduler) raise ``SystemExit`` in the main thread, so that
    :func:`run_then_write` writes the rows measured so far, marked incomplete, instead of the process dying with
    nothing written. The exception comes when the main thread is next in Python: after the GPU work it waits
    on, not in the middle of it."""
    def stop(signum, frame):
        raise SystemExit(f"stopped by {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, stop)


def error_line(error: BaseException) -> str:
    """``Type: first line of the message`` (300 characters at most), for a table row or a log line."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"


def run_then_write(measure, write, log, *, writer: bool = True):
    """Runs ``measure()`` (the measurements and the run's closing metadata), then ``write()`` where ``writer``
    (process 0). An error or SIGTERM before the write still writes the rows so far, as
    ``write(aborted=why)``, and is raised again."""
    try:
        measure()
    except BaseException as e:
        why = error_line(e)
        log(f"ABORTED: {why}; writing the rows so far")
        if writer:
            write(aborted=why)
        raise
    if writer:
        write()


@contextlib.contextmanager
def _sigterm_ignored():
    """SIGTERM ignored meanwhile (in the main thread; elsewhere signals cannot be set and arrive there anyway):
    results are never left half written."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _write_whole(path: Path, write):
    """``path`` holds what ``write(partial_path)`` writes, or what it held before, never a part: written beside
    it, then renamed over it, with SIGTERM ignored meanwhile."""
    partial = path.with_name(path.name + ".partial")
    with _sigterm_ignored():
        write(partial)
        os.replace(partial, path)


class TablePrinter:
    """Prints a fixed-width table row by row as results arrive.

    Args:
      columns: ``(key, header, width, format)`` tuples; ``format`` is a format spec applied to numbers (other
        values are printed with ``str``), missing values print as ``-``.
    """

    def __init__(self, columns):
        self.columns = columns
        self.printed_header = False

    def header(self):
        line = " ".join(f"{header:>{width}}" for _, header, width, _ in self.columns)
        print(line, flush=True)
        print("-" * len(line), flush=True)
        self.printed_header = True

    def row(self, row: dict):
        if not self.printed_header:
            self.header()
        print(" ".join(f"{format_value(row.get(key), fmt):>{width}}" for key, _, width, fmt in self.columns),
              flush=True)


def format_value(value, fmt: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and fmt:
        return format(value, fmt)
    return str(value)


# ---- metadata ----------------------------------------------------------------------------------------------

def metadata(devices=None) -> dict:
    """Where and with what a benchmark ran.

    Args:
      devices: the devices the benchmark uses (default ``jax.devices()``); their kind and count are recorded.

    Returns:
      A JSON-serialisable dict: date (UTC, ISO 8601), hostname, platform and kind of the devices used, their
      count, the GPUs visible to this process, process count, Python/NumPy/JAX/jaxlib/jax_ncclx versions,
      ``jax_ncclx.build_info()`` with the NCCL version spelled out, the git commit and whether the tree is
      dirty (None outside a checkout), the command line and the relevant environment (XLA_*, NCCL_*,
      JAX_NCCLX_*, JAX_PLATFORMS, CUDA_VISIBLE_DEVICES).
    """
    import jax
    import jaxlib
    import numpy as np

    import jax_ncclx

    devices = list(devices) if devices is not None else jax.devices()
    try:
        gpu_count = len(jax.devices("gpu"))
    except RuntimeError:
        gpu_count = 0
    try:
        build = jax_ncclx.build_info()
    except Exception as e:  # noqa: BLE001 - metadata must not stop a benchmark
        build = {"error": repr(e)}
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "num_devices": len(devices),
        "gpu_count": gpu_count,
        "process_count": jax.process_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "jax_ncclx": jax_ncclx.__version__,
        "nccl_version": nccl_version_string(build.get("nccl_version")),
        "build_info": {k: list(v) if isinstance(v, tuple) else v for k, v in build.items()},
        "git": git_state(),
        "argv": sys.argv,
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
    }


def nccl_version_string(code):
    """22809 -> "2.28.9" (NCCL's version code); None stays None."""
    if not isinstance(code, int):
        return None
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def git_state() -> dict | None:
    """``{"commit": sha, "dirty": bool}`` of the checkout holding this file, or None where git or the checkout
    is missing.

    ``BENCH_GIT_COMMIT`` overrides it, for copies of a clean checkout whose ``.git`` is not the checkout's own
    (the GPU machines receive the working tree with a stale ``.git``); the result then says ``"from": "env"``.
    """
    if os.environ.get("BENCH_GIT_COMMIT"):
        return {"commit": os.environ["BENCH_GIT_COMMIT"], "dirty": False, "from": "env"}

    def git(*args):
        return subprocess.run(["git", "-C", str(REPO_DIR), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def pick_devices(parser, smoke: bool, min_gpus: int = 2) -> list:
    """The devices a benchmark runs on: the CPU devices with --smoke, else every GPU (at least ``min_gpus``,
    and a jax_ncclx built with its CUDA handlers); anything else ends the script through ``parser.error``."""
    import jax

    import jax_ncclx as nx

    if smoke:
        return jax.devices("cpu")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if len(gpus) < min_gpus:
        parser.error(f"needs at least {min_gpus} GPU{'s' if min_gpus > 1 else ''} (found {len(gpus)}); --smoke runs "
                     "on 8 virtual CPU devices")
    if not nx.build_info()["cuda"]:
        parser.error(f"jax_ncclx has no CUDA handlers: {nx.build_info()['cuda_status']}")
    return gpus


@contextlib.contextmanager
def lowering_settings(values: dict):
    """Sets (a string) or unsets (None) the environment variables in ``values`` while programs are lowered, and
    restores them after; JAX's caches are dropped when anything changes, so that a program compiled under other
    settings is not reused."""
    import jax

    before = {key: os.environ.get(key) for key in values}

    def apply(settings):
        for key, value in settings.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    changed = dict(values) != before
    if changed:
        apply(values)
        jax.clear_caches()
    try:
        yield
    finally:
        if changed:
            apply(before)
            jax.clear_caches()


# ---- timing ------------------------------------------------------------------------------------------------

def ffi_targets(hlo_text: str) -> list:
    """The jax_ncclx FFI targets a compiled program calls."""
    return sorted(set(re.findall(r'custom_call_target="(ncclx_\w+)"', hlo_text)))


def time_jitted(fn, *args, ops_per_call: int = 1, feedback: bool = False, warmup: int = 2, reps: int = 20,
                min_reps: int = 3, max_seconds: float = 2.0, pipeline: int = 1, on_compile=None,
                dispatch_reps: int = 0) -> dict:
    """Times a jitted function: compile, warm up, then timed samples, each ended by ``block_until_ready``.

    A sample is ``pipeline`` calls dispatched back to back and waited for once. With ``pipeline`` > 1 the host
    prepares the next call while the GPUs run the current one, as in a training loop, so the time per op is
    what the ops cost in steady state; with 1, every sample also pays one dispatch and one wait (hundreds of
    µs for a program on several GPUs), spread over the ops of one call.

    Args:
      fn: a ``jax.jit`` function (compiled here for ``args``, so compile time is recorded apart) or any
        callable.
      ops_per_call: how many operations one call performs (e.g. an unrolled chain); times are divided by it.
      feedback: pass each call's output as the first argument of the next call (for functions that donate
        their first argument and return a value of the same shape: chains of dependent ops with no copies).
      warmup: untimed calls after compiling; the second is skipped when the first took over max_seconds / 4.
      reps: the most timed calls.
      min_reps: the fewest timed calls, whatever max_seconds says.
      max_seconds: stop timing once this much time went into timed calls (at least min_reps are made), so
        large shapes take few repetitions.
      pipeline: calls per timed sample, dispatched without waiting in between; fewer (at least 1) when
        ``min_reps`` samples of that many calls would take over ``max_seconds`` (judged by the last warm-up
        call). The number used is returned as ``pipeline``.
      on_compile: called with the compiled executable (e.g. to read its HLO); its result is ``compiled_info``.
      dispatch_reps: after the samples, this many more calls, each waited for before the next, timed until the
        call returns: the host's work before the program launches (every op's prepare stage, the launch).

    Returns:
      A dict: ``median_us`` and ``min_us`` per op, ``samples_us`` (every timed call, per op), ``reps``,
      ``ops_per_call``, ``pipeline``, ``compile_s`` (None when fn was not a jit function), ``compiled_info``,
      ``warmup_s`` (the warm-up calls, whole calls), ``dispatch_us`` (with ``dispatch_reps``: the median time
      until a call returned, whole call) and ``final``, the last call's output (delete it to free its memory at once).
      With several processes (one per GPU, :func:`run_processes`) every process must make the same calls, and
      clocks that differ would make them choose differently: exactly ``warmup`` warm-up calls and ``reps``
      samples of ``pipeline`` calls are made (``max_seconds`` and ``min_reps`` are ignored), the medians are
      this process's, and ``median_us_by_process`` has every process's.
    """
    import jax

    fixed = jax.process_count() > 1
    args = list(args)
    compile_s = None
    if hasattr(fn, "lower"):
        start = time.perf_counter()
        fn = fn.lower(*args).compile()
        compile_s = time.perf_counter() - start
    compiled_info = on_compile(fn) if on_compile is not None else None

    def call(calls=1):
        for _ in range(calls):
            out = fn(*args)
            if feedback:
                args[0] = out
        return jax.block_until_ready(out)

    warmup_s = []
    for i in range(warmup):
        start = time.perf_counter()
        call()
        warmup_s.append(time.perf_counter() - start)
        if not fixed and warmup_s[-1] > max_seconds / 4:
            break
    if warmup_s and not fixed:
        pipeline = max(1, min(pipeline, int(max_seconds / (min_reps * warmup_s[-1]))))
    samples = []
    spent = 0.0
    while len(samples) < (reps if fixed else max(reps, min_reps)):
        start = time.perf_counter()
        out = call(pipeline)
        samples.append(time.perf_counter() - start)
        spent += samples[-1]
        if not fixed and len(samples) >= min_reps and spent >= max_seconds:
            break
    per_op_us = [s / (ops_per_call * pipeline) * 1e6 for s in samples]
    by_process = {"median_us_by_process": gathered([statistics.median(per_op_us)]).tolist()} if fixed else {}
    dispatch = {}
    if dispatch_reps:
        returned = []
        for _ in range(dispatch_reps):
            start = time.perf_counter()
            out = fn(*args)
            returned.append(time.perf_counter() - start)
            if feedback:
                args[0] = out
            jax.block_until_ready(out)
        dispatch["dispatch_us"] = statistics.median(returned) * 1e6
    return {
        **by_process,
        **dispatch,
        "median_us": statistics.median(per_op_us),
        "min_us": min(per_op_us),
        "samples_us": per_op_us,
        "reps": len(samples),
        "ops_per_call": ops_per_call,
        "pipeline": pipeline,
        "compile_s": compile_s,
        "compiled_info": compiled_info,
        "warmup_s": warmup_s,
        "final": out,
    }


# ---- one process per GPU -----------------------------------------------------------------------------------

def _add_process_arguments(parser):
    """``--processes N``, and the two hidden arguments :func:`run_processes` gives each process it starts."""
    parser.add_argument("--processes", type=int,
                        help="one process per GPU: start N processes on this host, each driving one GPU (the first "
                        "N) through jax.distributed, every GPU visible to each (as CUDA IPC needs). GPU only. Every "
                        "process makes the same calls, so each measurement takes exactly --iters samples of "
                        "--pipeline calls; process 0 prints and writes the results")
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator-port", type=int, help=argparse.SUPPRESS)


def parse_arguments(parser, argv, defaults: dict):
    """A benchmark's arguments: ``parser``'s, the process ones (``--processes``), checked, then each one left unset
    taken from ``defaults`` (name -> (full run's value, --smoke's value))."""
    _add_process_arguments(parser)
    args = parser.parse_args(argv)
    _check_processes(parser, args)
    for key, (full, smoke) in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, smoke if args.smoke else full)
    return args


# How long processes stopped by SIGTERM get to write their rows before they are killed.
STOP_GRACE_S = 60


def run_processes(args, argv) -> int:
    """Starts ``args.processes`` copies of this script with ``argv`` plus their process id and a coordinator
    port, and waits for them. Process 0 writes to this terminal, the others to temporary files, whose last lines
    are printed if they fail. Returns 0, or the exit code of the first process that failed (the others are then
    stopped: they would wait for it until jax.distributed gave up). SIGTERM goes on to every process, which
    then writes its rows (:func:`run_then_write`) within ``STOP_GRACE_S``."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    logs, procs = [], []
    for pid in range(args.processes):
        command = [sys.executable, sys.argv[0], *argv, "--process-id", str(pid), "--coordinator-port", str(port)]
        log = None if pid == 0 else tempfile.TemporaryFile("w+")
        logs.append(log)
        procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT if log else None, text=True))

    def first_failed():
        return next((pid for pid, p in enumerate(procs) if p.poll() not in (None, 0)), None)

    stopping = threading.Event()

    def forward(signum, frame):  # each process then writes what it has (process 0 the results) and ends
        stopping.set()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        while first_failed() is None and any(p.poll() is None for p in procs) and not stopping.is_set():
            time.sleep(0.2)
        deadline = time.monotonic() + STOP_GRACE_S
        while stopping.is_set() and any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        signal.signal(signal.SIGTERM, previous)
    failed = first_failed()
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for pid, log in enumerate(logs):
        if log is not None and procs[pid].returncode != 0:
            log.seek(0)
            print(f"---- process {pid} (exit {procs[pid].returncode}), last lines:\n" + "".join(log.readlines()[-40:]),
                  flush=True)
    return 0 if failed is None else procs[failed].returncode or 1


def run_or_join(args, argv) -> int | None:
    """The multi-process start of a benchmark's main: with ``--processes`` the first call starts the processes
    and returns their exit status, which main returns; a started process joins jax.distributed. None where main
    goes on to measure."""
    if args.processes and args.process_id is None:
        return run_processes(args, sys.argv[1:] if argv is None else argv)
    if args.process_id is not None:
        join_distributed(args)
    return None


def join_distributed(args):
    """In a process that :func:`run_processes` started: ``jax.distributed.initialize`` for its one GPU (before
    anything else touches JAX's backends)."""
    import jax

    jax.distributed.initialize(f"127.0.0.1:{args.coordinator_port}", num_processes=args.processes,
                               process_id=args.process_id, local_device_ids=[args.process_id])


def _check_processes(parser, args):
    """Ends the script through ``parser.error`` where ``--processes`` cannot apply."""
    if args.processes is not None and (args.processes < 2 or args.smoke):
        parser.error("--processes needs at least 2 (GPU) processes, and not --smoke")


def gathered(values):
    """Every process's ``values`` (a sequence or NumPy array), concatenated along the first axis in process order;
    ``values`` as a NumPy array where one process runs everything."""
    import jax
    import numpy as np

    values = np.asarray(values)
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(values, tiled=True))


def local_values(array):
    """This process's shards of ``array`` as one float32 NumPy array, in the order of their indices (a whole
    array when one process drives every device)."""
    import numpy as np

    shards = sorted(array.addressable_shards, key=lambda s: tuple(i.start or 0 for i in s.index))
    return np.concatenate([np.asarray(s.data, dtype=np.float32).reshape(-1) for s in shards])


def choices(parser, text, allowed, flag: str) -> list:
    """A comma separated command-line list whose items must be among ``allowed``; anything else ends the script
    through ``parser.error`` naming ``flag``."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    unknown = sorted(set(items) - set(allowed))
    if unknown:
        parser.error(f"{flag}: unknown {unknown}; choose from {list(allowed)}")
    return items


def byte_sizes(parser, text, flag: str) -> list:
    """A comma separated command-line list of byte counts with optional K / M / G suffixes (8, 64K, 16M);
    anything else ends the script through ``parser.error`` naming ``flag``."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for item in str(text).split(","):
        if not item.strip():
            continue
        match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", item.upper())
        if not match:
            parser.error(f"{flag}: bad size {item!r}: use e.g. 8, 64K, 16M")
        sizes.append(int(match.group(1)) * units[match.group(2)])
    return sizes


def start(parser, args, axis: str, skip=(), min_gpus: int = 2) -> tuple:
    """(devices, a one-axis mesh named ``axis`` over them, metadata, run config) for a benchmark run: the
    devices of :func:`pick_devices`, the config of :func:`run_config`. A ``{topology}`` in ``args.name`` becomes
    :func:`topology` of the devices. From here on SIGTERM stops the run with its rows written
    (:func:`stop_on_sigterm`)."""
    import jax
    import numpy as np

    stop_on_sigterm()

    devices = pick_devices(parser, args.smoke, min_gpus)
    args.name = args.name.replace("{topology}", topology(devices))
    return devices, jax.sharding.Mesh(np.asarray(devices), (axis,)), metadata(devices), run_config(args, skip)


def topology(devices) -> str:
    """The part of a results name that says where it ran: ``<N>gpu`` (``<N>cpu`` on CPU devices), then
    ``_<P>proc`` when P > 1 processes share them, then ``_cmdbuf`` when ``XLA_FLAGS`` ask XLA to record custom
    calls into command buffers (``--xla_gpu_enable_command_buffer`` naming CUSTOM_CALL)."""
    import jax

    name = f"{len(devices)}{'gpu' if devices[0].platform == 'gpu' else 'cpu'}"
    if jax.process_count() > 1:
        name += f"_{jax.process_count()}proc"
    flags = re.findall(r"--xla_gpu_enable_command_buffer=(\S*)", os.environ.get("XLA_FLAGS", ""))
    if flags and "CUSTOM_CALL" in flags[-1].upper() and "-CUSTOM_CALL" not in flags[-1].upper():
        name += "_cmdbuf"
    return name


def name_help(stem: str) -> str:
    """The ``--name`` help of a benchmark whose results are called ``stem`` (:func:`settle_output`)."""
    return (f"file stem of the results (default: {stem}_<N>gpu[_<P>proc][_cmdbuf] in benchmarks/results, {stem} in a "
            "folder given with --out or with --smoke; a {topology} in it becomes that suffix)")


def settle_output(args, stem: str):
    """Fills ``args.out`` and ``args.name`` when not given. ``args.out``: the JSON's folder with ``--from-json``,
    a temporary folder with ``--smoke``, else ``benchmarks/results``. ``args.name``: that run's file stem with
    ``--from-json`` (so that its files are rewritten whatever ``--name`` says); ``<stem>_{topology}`` for a run
    into ``benchmarks/results``, which keeps one current set per benchmark and topology
    (``all_to_allv_4gpu``, ``collectives_2gpu_cmdbuf``, ...); ``stem`` in any other folder."""
    if args.from_json:
        args.name = args.from_json.stem
    elif args.name is None:
        args.name = stem + "_{topology}" if args.out is None and not args.smoke else stem
    if args.out is None:
        args.out = (args.from_json.parent if args.from_json else
                    Path(tempfile.gettempdir()) / "jax_ncclx_bench_smoke" if args.smoke else RESULTS_DIR)


def run_config(args, skip=()) -> dict:
    """The command line's settings as JSON values (paths as strings), for the result files; ``from_json`` and
    the names in ``skip`` left out."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if k != "from_json" and k not in skip}


# ---- result files ------------------------------------------------------------------------------------------

def device_epochs() -> dict:
    """The newest traced NVLink call per (communicator, device), to tell a measurement's calls from earlier ones
    (programs compiled with JAX_NCCLX_TRACE=1 or device record them)."""
    from jax_ncclx._src import trace
    newest = {}
    for r in trace.device_timeline():
        key = (r["comm_id"], r["device"])
        newest[key] = max(newest.get(key, 0), r["epoch"])
    return newest


def device_breakdown(before: dict) -> dict:
    """Where the GPU time of the NVLink calls made since ``before`` went (jax_ncclx._src.trace.summarize), as
    ``dev_*`` columns; empty when there were none (e.g. the NCCL path)."""
    from jax_ncclx._src import trace
    records = [r for r in trace.device_timeline() if r["epoch"] > before.get((r["comm_id"], r["device"]), 0)]
    return {f"dev_{k}": v for k, v in trace.summarize(records).items()} if records else {}


def write_results(name: str, rows: list, meta: dict, plot_fn=None, *, out_dir=RESULTS_DIR, columns=None,
                  title: str | None = None, notes: str = "", extra: dict | None = None, log=print,
                  replot_hint: str = "") -> dict:
    """Writes ``<out_dir>/<name>.json``, ``<name>.md`` and (with matplotlib) ``<name>.png``.

    Args:
      name: file stem.
      rows: result rows (dicts of JSON-serialisable values); all of them go into the JSON.
      meta: ``metadata()``; goes into the JSON and, summarised, on top of the markdown.
      plot_fn: ``plot_fn(plt, rows) -> matplotlib Figure``, called with ``matplotlib.pyplot`` (Agg backend).
        When matplotlib is missing the PNG is skipped with a warning (``log``) and the other files are written.
      columns: markdown table columns as ``(key, header, format)``; default every key of the first row.
      title, notes: markdown heading and a markdown paragraph (column definitions, ...) above the table.
      extra: more top-level JSON entries (configuration, shapes, ...). An ``aborted`` entry (why the run
        stopped early) also heads the markdown as an incomplete run.
      log: where warnings and the written paths are reported.
      replot_hint: the command that redraws the plot from the JSON, named in the missing-matplotlib warning.

    Returns:
      ``{"json": path, "md": path, "png": path or None}``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "md": out_dir / f"{name}.md", "png": None}

    document = {"name": name, "meta": meta, **(extra or {}), "rows": rows}
    _write_whole(paths["json"], lambda p: p.write_text(json.dumps(document, indent=1, default=_json_default) + "\n"))

    if columns is None:
        columns = [(key, key, "") for key in (rows[0] if rows else {})]
    lines = [f"# {title or name}", "", _meta_line(meta), ""]
    if (extra or {}).get("aborted"):
        lines += [f"**Incomplete run**: it stopped early ({extra['aborted']}); the table holds the rows measured "
                  "before that.", ""]
    if notes:
        lines += [notes.strip(), ""]
    lines.append("| " + " | ".join(header for _, header, _ in columns) + " |")
    lines.append("|" + "|".join(" --- " for _ in columns) + "|")
    for row in rows:
        lines.append("| " + " | ".join(format_value(row.get(key), fmt) for key, _, fmt in columns) + " |")
    _write_whole(paths["md"], lambda p: p.write_text("\n".join(lines) + "\n"))

    if plot_fn is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log(f"WARNING: matplotlib is not installed: skipped the plot {out_dir / f'{name}.png'}; the JSON "
                f"and markdown are written. Draw it later where matplotlib is: {replot_hint or paths['json']}")
        else:
            figure = plot_fn(plt, rows)
            paths["png"] = out_dir / f"{name}.png"
            _write_whole(paths["png"], lambda p: figure.savefig(p, format="png", dpi=120, bbox_inches="tight"))
            plt.close(figure)
    log("wrote " + ", ".join(str(p) for p in paths.values() if p is not None))
    return paths


def _meta_line(meta: dict) -> str:
    git = meta.get("git") or {}
    commit = (git.get("commit") or "?")[:12] + (" (dirty)" if git.get("dirty") else "") if git else "unknown"
    if git.get("note"):  # what the commit alone does not say, e.g. a tree built with a changed file
        commit += f" ({git['note']})"
    env = meta.get("env") or {}
    return (f"{meta.get('num_devices')} × {meta.get('device_kind')} ({meta.get('platform')}), "
            f"{meta.get('process_count')} process(es), jax {meta.get('jax')}, NCCL {meta.get('nccl_version')}, "
            f"commit {commit}, {meta.get('date_utc')}, host {meta.get('hostname')}"
            + (f"; env: {', '.join(f'`{k}={v}`' for k, v in env.items())}" if env else ""))


def _json_default(value):
    if hasattr(value, "tolist"):  # NumPy scalars and arrays
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
