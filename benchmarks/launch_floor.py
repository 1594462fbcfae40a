"""The floor under the small-message collectives: what one op costs at the least inside a jitted chain.

The small collectives' time per op (benchmarks/collectives.py) is the kernel plus whatever XLA spends around
each op. This script times, in the same harness (chains of --unroll dependent ops per jitted call, --pipeline
calls per sample) and the same process, ops that do no communication next to the collectives:

  xla-kernel   one XLA kernel per op (v * -1, kept apart by optimization_barrier): XLA's own per-kernel cost;
  ffi-kernel   one jax_ncclx custom call per op (ncclx_launch_probe: a one-block copy kernel, command-buffer
               compatible like the NVLink handlers): what any custom call costs;
  nx           nx.all_reduce (default route: the one-shot NVLink kernel at small sizes);
  nx-watched   the same compiled with JAX_NCCLX_WATCH_REPLAYS=1 (GPU only): its handler has a prepare stage,
               which XLA runs in every execution, replays of a CUDA graph included;
  psum         jax.lax.psum.

Besides the time per op, `dispatch us` is how long one call (a chain) takes to return to the host when each is
waited for before the next: the host's work before the program launches, every op's prepare stage included.

nx minus ffi-kernel is what the collective itself costs (its kernel, flag barrier included); ffi-kernel minus
xla-kernel is what being a custom call costs. Results go to
benchmarks/results/launch_floor_<N>gpu[_cmdbuf].{json,md,png} (<out>/launch_floor.* with --out).

It also runs on one GPU, for the floors alone: nx is then its kernel on a one-rank communicator (no peers to
wait for) and psum over one device is compiled away, so neither says what a collective costs.

    python benchmarks/launch_floor.py                       # 8 bytes per rank on all GPUs
    python benchmarks/launch_floor.py --bytes 8,4K
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/launch_floor.py --name launch_floor_nocmdbuf
    python benchmarks/launch_floor.py --smoke --out /tmp/floor  # CPU: xla-kernel, nx, psum (no ffi-kernel)
"""

import argparse
import json
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
IMPLS = ("xla-kernel", "ffi-kernel", "nx", "nx-watched", "psum")
GPU_ONLY = {"ffi-kernel": "ncclx_launch_probe is a CUDA handler",
            "nx-watched": "JAX_NCCLX_WATCH_REPLAYS changes only the CUDA lowering"}


def one_op(impl: str, v):
    if impl == "xla-kernel":
        return jax.lax.optimization_barrier(v * -1.0)
    if impl == "ffi-kernel":
        return jax.ffi.ffi_call("ncclx_launch_probe", jax.ShapeDtypeStruct(v.shape, v.dtype))(v)
    if impl in ("nx", "nx-watched"):
        return nx.all_reduce(v, AXIS)
    return jax.lax.psum(v, AXIS)


def chain(v, *, impl, unroll):
    for _ in range(unroll):
        v = one_op(impl, v)
    return v


EXPECTED = {"xla-kernel": lambda n: -1.0, "ffi-kernel": lambda n: 1.0, "nx": float, "nx-watched": float,
            "psum": float}


def verify(mesh, impl, ones):
    """One op of ``impl`` on ones must give its known value everywhere (-1, 1, or N for the reductions)."""
    one = jax.jit(jax.shard_map(lambda v: one_op(impl, v), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS),
                                check_vma=False))
    got = np.asarray(one(ones))
    want = EXPECTED[impl](mesh.devices.size)
    if not np.all(got == want):
        raise AssertionError(f"{impl}: one op on ones gave {got[:4]}..., expected {want} everywhere")


TABLE = [("bytes", "bytes", 8, "d"), ("impl", "impl", 11, ""), ("median_us", "median us", 10, ".2f"),
         ("min_us", "min us", 8, ".2f"), ("over_ffi_us", "- ffi us", 9, ".2f"), ("x_psum", "x psum", 7, ".2f"),
         ("pipeline", "pipe", 5, "d"), ("dispatch_us", "dispatch us", 12, ".1f")]
MD_COLUMNS = [("bytes", "bytes/rank", "d"), ("impl", "impl", ""), ("median_us", "median µs/op", ".2f"),
              ("min_us", "min µs/op", ".2f"), ("over_ffi_us", "minus ffi-kernel µs", ".2f"),
              ("x_psum", "psum / this", ".2f"), ("reps", "samples", "d"), ("pipeline", "calls/sample", "d"),
              ("dispatch_us", "dispatch µs/call", ".1f")]


def plotter(meta):
    def plot(plt, rows):
        sizes = sorted({r["bytes"] for r in rows})
        fig, axes = plt.subplots(1, len(sizes), figsize=(4.5 * len(sizes), 3.6), squeeze=False)
        for ax, size in zip(axes[0], sizes):
            mine = [r for r in rows if r["bytes"] == size and r.get("median_us") is not None]
            ax.bar([r["impl"] for r in mine], [r["median_us"] for r in mine], color="#4c72b0")
            ax.set_title(f"{size} B per rank")
            ax.set_ylabel("µs per op (median)")
        fig.suptitle(f"Floor per op, {meta.get('gpu_count') or meta.get('num_devices')} × "
                     f"{meta.get('device_kind', '')}, chains of dependent ops")
        fig.tight_layout()
        return fig
    return plot


def write(args, meta, config, rows, log, **extra):
    return common.write_results(
        args.name, rows, meta, plotter(meta), out_dir=args.out, columns=MD_COLUMNS,
        title="What one op costs at the least: XLA kernel, jax_ncclx custom call, all_reduce, psum",
        notes=("Chains of dependent ops per jitted call, several calls per sample (benchmarks/README.md); "
               "`minus ffi-kernel`: this row's median minus the custom-call floor's."),
        extra={"config": config, **extra}, log=log,
        replot_hint=f"python benchmarks/launch_floor.py --from-json {Path(args.out) / (args.name + '.json')}")


def run(args, mesh, log, table, rows):
    n = mesh.devices.size
    for nbytes in args.bytes:
        elements = max(1, nbytes // 4)
        results = {}
        for impl in args.impls:
            if impl in GPU_ONLY and mesh.devices.flat[0].platform != "gpu":
                log(f"{impl} skipped: {GPU_ONLY[impl]} (CPU run)")
                continue
            x = jax.device_put(jnp.ones((n * elements,), jnp.float32), NamedSharding(mesh, P(AXIS)))
            fn = jax.jit(jax.shard_map(lambda v, impl=impl: chain(v, impl=impl, unroll=args.unroll), mesh=mesh,
                                       in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False), donate_argnums=0)
            # Read at lowering; time_jitted compiles fn first.
            with common.lowering_settings({"JAX_NCCLX_WATCH_REPLAYS": "1" if impl == "nx-watched" else "0"}):
                verify(mesh, impl, x)
                timing = common.time_jitted(fn, x, ops_per_call=args.unroll, feedback=True, reps=args.iters,
                                            pipeline=args.pipeline, max_seconds=args.max_seconds,
                                            dispatch_reps=args.dispatch_reps,
                                            on_compile=lambda c: common.ffi_targets(c.as_text()))
            for array in jax.tree.leaves(timing.pop("final")):
                array.delete()
            timing["ffi_targets"] = timing.pop("compiled_info")
            results[impl] = dict(bytes=elements * 4, impl=impl, num_devices=n, unroll=args.unroll, **timing)
        for row in results.values():
            if "ffi-kernel" in results:
                row["over_ffi_us"] = row["median_us"] - results["ffi-kernel"]["median_us"]
            if "psum" in results:
                row["x_psum"] = results["psum"]["median_us"] / row["median_us"]
            rows.append(row)
            table.row(row)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--smoke", action="store_true", help="8 virtual CPU devices")
    parser.add_argument("--bytes", default="8", help="bytes per rank, comma separated, K/M suffixes (default 8)")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma separated subset of {','.join(IMPLS)}")
    parser.add_argument("--unroll", type=int, default=20, help="dependent ops per jitted call (default 20)")
    parser.add_argument("--pipeline", type=int, default=10, help="calls per timed sample (default 10)")
    parser.add_argument("--iters", type=int, default=20, help="the most timed samples (default 20)")
    parser.add_argument("--max-seconds", type=float, default=1.0, help="time budget per measurement (default 1)")
    parser.add_argument("--dispatch-reps", type=int, default=100,
                        help="calls timed until they return, each waited for (default 100; 0: no dispatch column)")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results; smoke: a temporary "
                        "folder; --from-json: the JSON's folder)")
    parser.add_argument("--name", help=common.name_help("launch_floor"))
    parser.add_argument("--from-json", type=Path, help="rewrite the .md and .png of an earlier run's JSON")
    args = parser.parse_args(argv)
    args.bytes = common.byte_sizes(parser, args.bytes, "--bytes")
    args.impls = common.choices(parser, args.impls, IMPLS, "--impls")
    if args.unroll < 1 or args.pipeline < 1 or args.dispatch_reps < 0 or not args.bytes or min(args.bytes) < 4:
        parser.error("--unroll and --pipeline must be >= 1, --dispatch-reps >= 0, --bytes non-empty and each at "
                     "least 4")
    common.settle_output(args, "launch_floor")
    return parser, args


def main(argv=None):
    parser, args = parse_args(argv)
    log = common.Progress()
    if args.from_json:
        document = json.loads(args.from_json.read_text())
        return write(args, document["meta"], document["config"], document["rows"], log)
    devices, mesh, meta, config = common.start(parser, args, AXIS, min_gpus=1)
    if "ffi-kernel" in args.impls and devices[0].platform == "gpu" and not lib.testing_built():
        parser.error(f"ffi-kernel times ncclx_launch_probe, a test-only target this build lacks: "
                     f"{lib.TESTING_BUILD_HINT}; or leave it out with --impls")
    log(f"{len(devices)} × {devices[0].device_kind} ({devices[0].platform}), jax {jax.__version__}, bytes "
        f"{args.bytes}, impls {args.impls}, unroll {args.unroll}, pipeline {args.pipeline}")
    rows = []

    def measure():
        run(args, mesh, log, common.TablePrinter(TABLE), rows)
        meta["elapsed_s"] = round(log.elapsed(), 1)

    common.run_then_write(measure, lambda **aborted: write(args, meta, config, rows, log, **aborted), log)
    log(f"done in {meta['elapsed_s']} s")


if __name__ == "__main__":
    sys.exit(main())
