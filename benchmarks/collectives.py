"""Small and large collectives: jax_ncclx's all_reduce / all_gather / all_to_all / reduce_scatter against
jax.lax's.

One process drives every local GPU on one mesh axis "x" (with --smoke: 8 virtual CPU devices and small
sizes; with --processes N: N processes, one per GPU, through jax.distributed). For each op and size, every
implementation (--impls) runs the same chain of --unroll dependent ops inside one jax.jit(jax.shard_map(...)),
after a check that it gives exactly jax.lax's result. Size = bytes of each rank's input: all_reduce reduces
that buffer, all_gather gathers N of them, all_to_all splits it into N blocks and reduce_scatter sums N blocks
(both rounded up to a multiple of N elements). Results go to
benchmarks/results/collectives_<N>gpu[_<P>proc][_cmdbuf].{json,md,png} (<out>/collectives.* with --out).

Implementations: xla (jax.lax), nx (jax_ncclx with its default thresholds), nx-oneshot / nx-twoshot (the NVLink
kernels forced at every size; two-shot is all_reduce only), nx-staged / nx-twoshot-staged (the same as nx /
nx-twoshot with JAX_NCCLX_NVLINK_DIRECT=0: data goes through the peers' symmetric slots, as one process per GPU
does, not straight into their outputs), nx-ll / nx-ll128 / nx-simple (one-shot segments up to 64 KiB in that
protocol at every size, instead of the default LL below 8 KiB and LL128 from there: JAX_NCCLX_NVLINK_PROTOCOL),
nx-nccl (JAX_NCCLX_TRANSPORT=nccl), nx-nccl-cmdbuf (the same, with the NCCL handlers recorded into XLA's
command buffers: JAX_NCCLX_NCCL_COMMAND_BUFFERS=1); and what
tracing and timeouts cost: nx-traced / nx-nccl-traced (JAX_NCCLX_TRACE=1), nx-nccl-nowatch (NCCL without the
watchdog's two CUDA events per call: JAX_NCCLX_TIMEOUT_S=0), nx-nowarn (NVLink without the watchdog's event per
call for the late-peer warning: JAX_NCCLX_WARN_AFTER_S=0).

    python benchmarks/collectives.py                          # 8 B .. 64 MB on all GPUs: xla, nx, nx-nccl
    python benchmarks/collectives.py --impls xla,nx-oneshot,nx-twoshot,nx-nccl   # where the crossovers are
    python benchmarks/collectives.py --ops all_reduce --sizes 8,64K
    python benchmarks/collectives.py --sizes 8,4K,16K,64K --impls xla,nx,nx-ll,nx-ll128,nx-simple --unroll 200
    python benchmarks/collectives.py --ops all_reduce --sizes 8,64K,1M \
        --impls xla,nx,nx-traced,nx-nccl,nx-nccl-nowatch,nx-nccl-traced
    python benchmarks/collectives.py --processes 2 --sizes 8,64K --impls xla,nx,nx-nccl-cmdbuf  # a process per GPU
    python benchmarks/collectives.py --smoke --out /tmp/coll  # CPU, small sizes
    python benchmarks/collectives.py --from-json benchmarks/results/collectives_2gpu.json  # redo the .md / .png

Timing is the harness of benchmarks/README.md: --pipeline calls dispatched back to back per sample, time per
op = sample time / (pipeline * unroll). Which jax_ncclx path ran (nccl, nvlink-1shot, nvlink-2shot) is read
from the compiled program and shown in the `path` column.
"""

import argparse
import contextlib
import functools
import json
import os
import re
import sys
from pathlib import Path

import common  # first: sets XLA_PYTHON_CLIENT_PREALLOCATE and NCCL_NVLS_ENABLE before JAX starts

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)  # only used by --smoke

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ncclx as nx  # noqa: E402
from jax_ncclx._src import lib  # noqa: E402

AXIS = "x"
NAME = "collectives"
OPS = ("all_reduce", "all_gather", "all_to_all", "reduce_scatter")
SPLIT_OPS = ("all_to_all", "reduce_scatter")  # split each rank's buffer into N blocks
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
DEFAULTS = {  # (GPU run, --smoke)
    "sizes": ("8,64,512,4K,32K,256K,1M,4M,16M,64M", "8,512,32K"),
    "unroll": (20, 4),
    "pipeline": (10, 2),
    "iters": (20, 3),
    "max_seconds": (1.0, 0.2),
}
EVERYTHING = str(1 << 40)
IMPLS = {  # name -> JAX_NCCLX_* settings while its programs compile (None: jax.lax)
    "xla": None,
    "nx": {},
    "nx-oneshot": {"JAX_NCCLX_TRANSPORT": "nvlink", "JAX_NCCLX_NVLINK_ONESHOT_MAX_BYTES": EVERYTHING,
                   "JAX_NCCLX_NVLINK_MAX_BYTES": EVERYTHING},
    "nx-twoshot": {"JAX_NCCLX_TRANSPORT": "nvlink", "JAX_NCCLX_NVLINK_ONESHOT_MAX_BYTES": "0",
                   "JAX_NCCLX_NVLINK_MAX_BYTES": EVERYTHING},
    "nx-staged": {"JAX_NCCLX_NVLINK_DIRECT": "0"},
    "nx-twoshot-staged": {"JAX_NCCLX_TRANSPORT": "nvlink", "JAX_NCCLX_NVLINK_ONESHOT_MAX_BYTES": "0",
                          "JAX_NCCLX_NVLINK_MAX_BYTES": EVERYTHING, "JAX_NCCLX_NVLINK_DIRECT": "0"},
    "nx-ll": {"JAX_NCCLX_NVLINK_PROTOCOL": "ll"},
    "nx-ll128": {"JAX_NCCLX_NVLINK_PROTOCOL": "ll128"},
    "nx-simple": {"JAX_NCCLX_NVLINK_PROTOCOL": "simple"},
    "nx-nccl": {"JAX_NCCLX_TRANSPORT": "nccl"},
    "nx-nccl-cmdbuf": {"JAX_NCCLX_TRANSPORT": "nccl", "JAX_NCCLX_NCCL_COMMAND_BUFFERS": "1"},
    # What the reliability machinery costs: traced calls, and NCCL calls without the watchdog's events.
    "nx-traced": {"JAX_NCCLX_TRACE": "1"},
    "nx-nccl-traced": {"JAX_NCCLX_TRANSPORT": "nccl", "JAX_NCCLX_TRACE": "1"},
    "nx-nccl-nowatch": {"JAX_NCCLX_TRANSPORT": "nccl", "JAX_NCCLX_TIMEOUT_S": "0"},
    "nx-nowarn": {"JAX_NCCLX_WARN_AFTER_S": "0"},
}
SETTINGS = sorted({key for env in IMPLS.values() if env for key in env} | {"JAX_NCCLX_TRACE"})
TRACED_IMPLS = ("nx-traced", "nx-nccl-traced")
TABLE = [
    ("op", "op", 10, ""), ("bytes", "bytes", 10, "d"), ("impl", "impl", 10, ""), ("path", "path", 12, ""),
    ("median_us", "median us", 10, ".1f"), ("min_us", "min us", 9, ".1f"), ("busbw_gbps", "busbw GB/s", 10, ".1f"),
    ("speedup", "x xla", 6, ".2f"), ("pipeline", "pipe", 4, "d"), ("handler_runs_per_op", "host/op", 7, ".2f"),
    ("status", "status", 8, ""),
]
MD_COLUMNS = [
    ("op", "op", ""), ("bytes", "bytes/rank", "d"), ("impl", "impl", ""), ("path", "path", ""),
    ("median_us", "median µs/op", ".1f"), ("min_us", "min µs/op", ".1f"), ("busbw_gbps", "bus GB/s", ".1f"),
    ("speedup", "speedup vs lax", ".2f"), ("reps", "reps", "d"), ("handler_runs_per_op", "handler runs/op", ".2f"),
    ("status", "status", ""),
]
TRACE_COLUMNS = [  # with --device-trace: (key, markdown header, table header, format)
    ("dev_kernel_us", "GPU kernel µs", "kernel us", ".1f"), ("dev_gap_us", "GPU idle gap µs", "gap us", ".1f"),
    ("dev_send_us", "send µs", "send us", ".1f"), ("dev_wait_data_us", "until data µs", "data us", ".1f"),
    ("dev_finish_us", "finish µs", "finish us", ".1f"),
]


class VerificationError(RuntimeError):
    """jax_ncclx gave a different result from jax.lax: the run stops."""


# ---- the ops and their chains (per rank) -------------------------------------------------------------------

def one_op(op: str, impl: str, x):
    """One op on this rank's 1-D buffer x; the result has x's shape, so ops chain without reshaping."""
    ours = impl != "xla"
    if op == "all_reduce":
        return nx.all_reduce(x, AXIS) if ours else jax.lax.psum(x, AXIS)
    if op == "all_gather":
        y = nx.all_gather(x, AXIS, tiled=True) if ours else jax.lax.all_gather(x, AXIS, tiled=True)
        return y[: x.shape[0]]  # this rank's block back: same shape for the next op (a copy, in both chains)
    if op == "all_to_all":
        return nx.all_to_all(x, AXIS, 0, 0, tiled=True) if ours else jax.lax.all_to_all(x, AXIS, 0, 0, tiled=True)
    if op == "reduce_scatter":
        y = nx.reduce_scatter(x, AXIS, tiled=True) if ours else jax.lax.psum_scatter(x, AXIS, tiled=True)
        return jnp.tile(y, x.shape[0] // y.shape[0])  # back to x's shape (a copy, in both chains)
    raise ValueError(op)


def applies(impl: str, op: str) -> bool:
    return not impl.startswith("nx-twoshot") or op == "all_reduce"


@contextlib.contextmanager
def settings_of(impl: str, trace: bool = False):
    """The JAX_NCCLX_* settings of ``impl`` (plus JAX_NCCLX_TRACE=1 with ``trace``) while its programs are
    lowered; JAX's caches are dropped when they change, so a program compiled under other settings is not
    reused."""
    wanted = dict(IMPLS[impl] or {}, **({"JAX_NCCLX_TRACE": "device"} if trace and impl != "xla" and
                                        impl not in TRACED_IMPLS else {}))
    after = {key: wanted.get(key, os.environ.get(key) if impl == "xla" else None) for key in SETTINGS}
    with common.lowering_settings(after):
        yield


def chain(x, *, op, impl, unroll):
    for _ in range(unroll):
        x = one_op(op, impl, x)
    return x


def bus_factor(op: str, n: int) -> float:
    """NCCL's bus bandwidth factor (nccl-tests PERFORMANCE.md): all_reduce 2(n-1)/n, the others (n-1)/n."""
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def bus_bytes(op: str, n: int, nbytes: int) -> float:
    """Bytes whose transfer time is the op's algorithm bandwidth, times the bus factor."""
    algo_bytes = nbytes * n if op == "all_gather" else nbytes  # all_gather: the gathered buffer
    return algo_bytes * bus_factor(op, n)


# ---- running -----------------------------------------------------------------------------------------------

def per_rank(mesh, fn, **kwargs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)), **kwargs)


def make_input(mesh, elements: int, dtype, seed: int):
    """[N * elements] small integers (exact in every dtype and under a few sums), split over the axis (every
    process draws the same values and places its own devices' parts)."""
    n = mesh.devices.size
    values = np.random.default_rng(seed).integers(-3, 4, size=n * elements).astype(dtype)
    return jax.make_array_from_callback(values.shape, NamedSharding(mesh, P(AXIS)), lambda index: values[index])


def verify(mesh, op, impl, x, want):
    """One op of ``impl`` (under its settings); raises VerificationError unless it gives exactly ``want`` (this
    process's part of the result, :func:`common.local_values`)."""
    with settings_of(impl):
        got = common.local_values(per_rank(mesh, functools.partial(one_op, op, impl))(x))
    if not np.array_equal(got, want):
        bad = int(np.sum(got != want))
        raise VerificationError(f"{impl} {op} differs from jax.lax in {bad} of {got.size} elements")


def ffi_path(hlo_text: str, platform: str) -> str:
    """What the compiled program calls: xla, cpu, nccl, nvlink-1shot or nvlink-2shot (joined by + if mixed)."""
    calls = [m.group(0) for m in re.finditer(r'custom_call_target="ncclx_\w+"[^\n]*', hlo_text)]
    if not calls:
        return "xla"
    if platform == "cpu":
        return "cpu"
    paths = set()
    for call in calls:
        if "_nvlink" not in call:
            paths.add("nccl")
            continue
        algorithm = re.search(r"algorithm\W+(\d)", call)
        paths.add("nvlink-2shot" if algorithm and algorithm.group(1) == "2" else "nvlink-1shot")
    return "+".join(sorted(paths))


def nvlink_handler_runs() -> tuple[int, int] | None:
    """(NVLink handler runs, of which under stream capture) so far in this process; None without the CUDA
    build."""
    module = lib.cuda_module_if_available()
    return tuple(module.nvlink_launch_counts()) if module is not None else None


def time_chain(mesh, op, impl, x, args) -> dict:
    fn = per_rank(mesh, functools.partial(chain, op=op, impl=impl, unroll=args.unroll), donate_argnums=0)
    # Zeros: sums of the checked values would grow N-fold per op and overflow over a long run.
    traced = args.device_trace and impl != "xla"
    before = common.device_epochs() if traced else None
    runs_before = nvlink_handler_runs()
    with settings_of(impl, trace=args.device_trace):
        timing = common.time_jitted(fn, jnp.zeros_like(x), ops_per_call=args.unroll, feedback=True,
                                    reps=args.iters, pipeline=args.pipeline, max_seconds=args.max_seconds,
                                    on_compile=lambda c: ffi_path(c.as_text(), mesh.devices.flat[0].platform))
    timing["path"] = timing.pop("compiled_info")
    for array in jax.tree.leaves(timing.pop("final")):
        array.delete()
    if traced:
        timing.update(common.device_breakdown(before))
    runs_after = nvlink_handler_runs()
    if runs_before is not None and timing["path"].startswith("nvlink"):
        # Host work per op: 1 when the handler runs for every op on every GPU (plain launches, or command
        # buffers re-recorded every call); near 0 when recorded command buffers are replayed.
        calls = len(timing["warmup_s"]) + timing["reps"] * timing["pipeline"]
        ops_run = calls * args.unroll * len(mesh.local_devices)
        timing["handler_runs_per_op"] = (runs_after[0] - runs_before[0]) / ops_run
        timing["captured_runs_per_op"] = (runs_after[1] - runs_before[1]) / ops_run
    return timing


def run(args, mesh, log, table, rows: list):
    """Measures every (op, size), appending the rows as they come (so an abort keeps them)."""
    n = mesh.devices.size
    dtype = DTYPES[args.dtype]
    itemsize = np.dtype(dtype).itemsize
    for op in args.ops:
        for requested in args.sizes:
            elements = max(1, -(-requested // itemsize))
            if op in SPLIT_OPS:
                elements = -(-elements // n) * n
            nbytes = elements * itemsize
            x = make_input(mesh, elements, dtype, args.seed)
            want = common.local_values(per_rank(mesh, functools.partial(one_op, op, "xla"))(x))
            results = {}
            for impl in ("xla", *(i for i in args.impls if i != "xla" and applies(i, op))):
                row = {"op": op, "impl": impl, "bytes": nbytes, "dtype": args.dtype, "num_devices": n,
                       "unroll": args.unroll, "verified": impl == "xla"}
                try:
                    if impl != "xla":
                        verify(mesh, op, impl, x, want)
                        row["verified"] = True
                    row.update(time_chain(mesh, op, impl, x, args), status="ok")
                    row["busbw_gbps"] = bus_bytes(op, n, nbytes) / (row["median_us"] * 1e-6) / 1e9
                except VerificationError:
                    raise
                except Exception as e:  # noqa: BLE001 - recorded, and the run fails at the end for nx
                    log(f"ERROR: {impl} {op} at {nbytes} B: {type(e).__name__}: {str(e)[:300]}")
                    row.update(status="error", message=f"{type(e).__name__}: {str(e)[:300]}")
                results[impl] = row
            for impl, row in results.items():
                if impl != "xla" and row["status"] == "ok" and results["xla"]["status"] == "ok":
                    row["speedup"] = results["xla"]["median_us"] / row["median_us"]
            for row in results.values():
                rows.append(row)
                table.row(row)
            x.delete()


# ---- result files ------------------------------------------------------------------------------------------

def plotter(meta: dict, config: dict):
    def plot(plt, rows):
        ops = [op for op in OPS if any(r["op"] == op for r in rows)]
        figure, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 4.5), squeeze=False)
        for ax, op in zip(axes[0], ops):
            impls = sorted({r["impl"] for r in rows if r["op"] == op}, key=list(IMPLS).index)
            for impl in impls:
                style, label = ("--s", "jax.lax") if impl == "xla" else ("-o", f"jax_ncclx ({impl})")
                points = sorted((r["bytes"], r["median_us"]) for r in rows
                                if r["op"] == op and r["impl"] == impl and r["status"] == "ok")
                if points:
                    ax.plot(*zip(*points), style, label=label, markersize=4)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(op)
            ax.set_xlabel("bytes per rank")
            ax.set_ylabel("µs per op (median)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        processes = f", {config['processes']} processes" if config.get("processes") else ""
        figure.suptitle(f"{meta.get('num_devices')} × {meta.get('device_kind')}{processes}, {config['dtype']}, "
                        f"chains of {config['unroll']} dependent ops, {config['pipeline']} calls per sample")
        figure.tight_layout(rect=(0, 0, 1, 0.94))
        return figure
    return plot


def notes(config: dict) -> str:
    fewer = "" if config.get("processes") else " (fewer for slow sizes, see the JSON's `pipeline`)"
    return "\n".join([
        f"Chains of {config['unroll']} dependent ops per jitted call; a timed sample dispatches "
        f"{config['pipeline']} calls back to back and waits once{fewer}; "
        "µs/op = sample time / (calls · unroll), median and min over `reps` samples.",
        "",
        "- **bytes/rank**: each rank's input. all_reduce reduces it; all_gather gathers N of them (each op then "
        "slices this rank's block back out, one copy kernel in both chains); all_to_all splits it into N blocks; "
        "reduce_scatter sums N blocks and tiles its block back to the input's size (a copy in both chains).",
        "- **bus GB/s**: as nccl-tests: all_reduce moves 2(N-1)/N of the buffer per rank, all_gather (N-1)/N of "
        "the gathered buffer, all_to_all and reduce_scatter (N-1)/N of the input.",
        "- **impl**: xla = jax.lax; nx = jax_ncclx with its default thresholds; nx-oneshot / nx-twoshot = its "
        "NVLink kernels forced at every size; nx-staged / nx-twoshot-staged = the same through the peers' "
        "symmetric slots, not into their outputs (JAX_NCCLX_NVLINK_DIRECT=0); nx-ll / nx-ll128 / nx-simple = "
        "one-shot segments up to 64 KiB in that protocol at every size (JAX_NCCLX_NVLINK_PROTOCOL; nx: LL below "
        "8 KiB, LL128 from there); "
        "nx-nccl = JAX_NCCLX_TRANSPORT=nccl; nx-nccl-cmdbuf = the same, recorded into XLA's command buffers "
        "(JAX_NCCLX_NCCL_COMMAND_BUFFERS=1); nx-traced / nx-nccl-traced = "
        "the same with JAX_NCCLX_TRACE=1 (every call recorded); nx-nccl-nowatch = NCCL without the watchdog's "
        "event per call (JAX_NCCLX_TIMEOUT_S=0); nx-nowarn = the default without the late-peer warning's event per "
        "call (JAX_NCCLX_WARN_AFTER_S=0).",
        "- **speedup** = jax.lax median / this row's median (> 1: faster than XLA). **path**: what the "
        "compiled jax_ncclx program calls (nccl, nvlink-1shot, nvlink-2shot, or cpu); jax.lax rows say xla.",
        "- **handler runs/op** (NVLink rows): how often the host ran jax_ncclx's handler per op and GPU while "
        "timing: 1 when every op is launched from the host (plain runs, or command buffers recorded anew for "
        "every call), near 0 when XLA replays recorded command buffers.",
        "- Every (op, size, impl) is first checked: one op must give exactly jax.lax's result (inputs are small "
        "integers, so every summation order is exact).",
        *([f"- **One process per GPU** ({config['processes']} processes through jax.distributed, every GPU visible "
           "to each): each measurement is exactly `reps` samples in every process; the medians are process 0's, "
           "the JSON's `median_us_by_process` has every process's."] if config.get("processes") else []),
    ])


def write(args, meta, config, rows, log, **extra):
    return common.write_results(
        args.name, rows, meta, plotter(meta, config), out_dir=args.out,
        columns=MD_COLUMNS + ([(k, md, f) for k, md, _, f in TRACE_COLUMNS] if config.get("device_trace") else []),
        title="jax_ncclx collectives vs jax.lax", notes=notes(config), extra={"config": config, **extra}, log=log,
        replot_hint=f"python benchmarks/collectives.py --from-json {Path(args.out) / (args.name + '.json')}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[7:]))
    parser.add_argument("--smoke", action="store_true", help="8 virtual CPU devices, small sizes")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma separated subset of {','.join(OPS)}")
    parser.add_argument("--sizes", help="bytes per rank, comma separated, K/M suffixes (default "
                        f"{DEFAULTS['sizes'][0]}; smoke {DEFAULTS['sizes'][1]})")
    parser.add_argument("--impls", default="xla,nx,nx-nccl",
                        help=f"comma separated subset of {','.join(IMPLS)} (xla always runs: it is the baseline)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device-trace", action="store_true",
                        help="compile the jax_ncclx chains with JAX_NCCLX_TRACE=device and add where the NVLink "
                        "kernels' GPU time went (kernel, idle gap between kernels, send, wait for data, finish)")
    parser.add_argument("--unroll", type=int, help="dependent ops per jitted call (default 20; smoke 4)")
    parser.add_argument("--pipeline", type=int, help="calls per timed sample (default 10; smoke 2)")
    parser.add_argument("--iters", type=int, help="the most timed samples (default 20; smoke 3)")
    parser.add_argument("--max-seconds", type=float, help="time budget per measurement (default 1.0; smoke 0.2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results; smoke: a temporary "
                        "folder; --from-json: the JSON's folder)")
    parser.add_argument("--name", help=common.name_help(NAME))
    parser.add_argument("--from-json", type=Path, help="rewrite the .md and .png of an earlier run's JSON")
    args = common.parse_arguments(parser, argv, DEFAULTS)
    args.sizes = common.byte_sizes(parser, args.sizes, "--sizes")
    args.ops = common.choices(parser, args.ops, OPS, "--ops")
    args.impls = common.choices(parser, args.impls, IMPLS, "--impls")
    if args.unroll < 1 or args.pipeline < 1 or not args.sizes:
        parser.error("--unroll and --pipeline must be >= 1 and --sizes non-empty")
    common.settle_output(args, NAME)
    return parser, args


def main(argv=None):
    parser, args = parse_args(argv)
    if (status := common.run_or_join(args, argv)) is not None:
        return status
    log = common.Progress()
    if args.from_json:
        document = json.loads(args.from_json.read_text())
        write(args, document["meta"], document["config"], document["rows"], log)
        return 0
    devices, mesh, meta, config = common.start(parser, args, AXIS, skip=("process_id", "coordinator_port"))
    writer = jax.process_index() == 0
    log(f"{len(devices)} × {devices[0].device_kind} ({devices[0].platform}), jax {jax.__version__}, ops {args.ops}, "
        f"sizes {args.sizes}, {args.dtype}, unroll {args.unroll}, pipeline {args.pipeline}")
    table = common.TablePrinter(TABLE + ([(k, head, 9, f) for k, _, head, f in TRACE_COLUMNS]
                                         if args.device_trace else []))
    rows = []

    def measure():
        run(args, mesh, log, table, rows)
        meta["elapsed_s"] = round(log.elapsed(), 1)

    common.run_then_write(measure, lambda **aborted: write(args, meta, config, rows, log, **aborted), log,
                          writer=writer)
    log(f"done in {meta['elapsed_s']} s")
    failed = [f"{r['impl']} {r['op']} {r['bytes']} B" for r in rows if r["impl"] != "xla" and r["status"] != "ok"]
    if failed:
        raise VerificationError(f"jax_ncclx raised errors in {len(failed)} measurement(s): {', '.join(failed)}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except VerificationError as e:
        sys.exit(f"FAILED: {e}")
