"""Where the GPU time of moe.dispatch and moe.combine goes: kernel times from a jax.profiler trace.

    python tools/profile_moe.py [--tokens 16,128,4096] [--wire float8_e4m3fn] [--layout masked] [--calls 10]
        [--out DIR]

Runs dispatch, combine and the round trip at the all_to_allv benchmark's shapes (hidden 7168 bf16, top-8 of 8
experts per rank on every local GPU; the router weights go with dispatch, so combine sums each token's pairs
on the expert side; one GPU is an axis of one member; ``--wire`` gives dispatch an 8-bit wire), traces
``--calls`` calls of each under ``jax.profiler`` and sums the time of every kernel on GPU 0's streams per
call: XLA's fusions by name and jax_ncclx's NVLink kernel. It prints one table per (T, function) and writes
them to DIR/moe_profile.json. A diagnostic, not a benchmark: the profiler adds its own overhead, so compare
kernels within a run, and time with benchmarks/all_to_allv.py. Needs CUPTI (the jax-cuda plugin's profiler); a
trace without kernel events is reported as such.
"""

import argparse
import collections
import functools
import gzip
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import common  # noqa: E402  (sets the benchmark environment before jax starts)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import all_to_allv as bench  # noqa: E402
from jax_ncclx import moe  # noqa: E402

TOP_KERNELS = 14  # rows per table; the rest are summed into one


def functions(routing, experts_per_rank, wire_dtype, layout):
    """name -> (per-rank function, argument names) for the three profiled steps."""
    num_experts = routing.counts.shape[0] * experts_per_rank
    capacity = bench.capacity_of("nx_moe_masked" if layout == "masked" else "nx_moe", routing)
    dispatch = functools.partial(moe.dispatch, num_experts=num_experts, axis_name=bench.AXIS, capacity=capacity,
                                 wire_dtype=wire_dtype, layout=layout)

    def round_trip(tokens, expert_ids, weights):  # the weights go with dispatch, as the benchmark's nx_moe
        rows, _, handle = dispatch(tokens, expert_ids, weights=weights)
        return moe.combine(rows, handle)

    return {
        "dispatch": (lambda t, i, w: dispatch(t, i, weights=w)[0], ("tokens", "expert_ids", "weights")),
        "combine": (lambda rows, handle: moe.combine(rows, handle), ("rows", "handle")),
        "round trip": (round_trip, ("tokens", "expert_ids", "weights")),
    }


def trace_events(log_dir: Path):
    """(kernel name, duration µs) of every event on GPU 0's streams in the perfetto trace under log_dir."""
    paths = sorted(log_dir.rglob("perfetto_trace.json.gz"))
    if not paths:
        raise SystemExit(f"profile_moe: jax.profiler wrote no perfetto_trace.json.gz under {log_dir}")
    with gzip.open(paths[-1], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    process, thread = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process[e["pid"]] = e["args"].get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[(e["pid"], e["tid"])] = e["args"].get("name", "")
    gpu0 = {pid for pid, name in process.items() if "GPU:0" in name}
    if not gpu0:
        raise SystemExit(f"profile_moe: no GPU 0 in the trace's processes {sorted(process.values())}")
    on_stream = lambda e: thread.get((e["pid"], e["tid"]), "").startswith("Stream")  # noqa: E731
    return [(e["name"], float(e.get("dur", 0.0))) for e in events
            if e.get("ph") == "X" and e.get("pid") in gpu0 and on_stream(e)]


def profile(fn, args, calls):
    out = fn(*args)
    jax.block_until_ready(out)  # compiled and warm
    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
        events = trace_events(Path(log_dir))
    per_kernel = collections.defaultdict(lambda: [0, 0.0])
    for name, dur in events:
        per_kernel[name][0] += 1
        per_kernel[name][1] += dur
    rows = [{"kernel": name, "launches_per_call": n / calls, "us_per_call": total / calls}
            for name, (n, total) in per_kernel.items()]
    return sorted(rows, key=lambda r: -r["us_per_call"])


def print_table(title, rows, log):
    total = sum(r["us_per_call"] for r in rows)
    log(f"{title}: {total:.1f} µs of kernels per call on GPU 0, {sum(r['launches_per_call'] for r in rows):.0f} "
        "launches")
    shown = rows[:TOP_KERNELS]
    rest = rows[TOP_KERNELS:]
    if rest:
        shown = shown + [{"kernel": f"({len(rest)} others)",
                          "launches_per_call": sum(r["launches_per_call"] for r in rest),
                          "us_per_call": sum(r["us_per_call"] for r in rest)}]
    for r in shown:
        print(f"    {r['us_per_call']:9.1f} µs  {r['launches_per_call']:5.1f}x  {r['kernel'][:110]}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="16,128,4096", help="tokens per rank, comma separated")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts-per-rank", type=int, default=8)
    parser.add_argument("--wire", choices=["float8_e4m3fn", "float8_e5m2"],
                        help="dispatch's 8-bit wire dtype (default: the tokens' bfloat16)")
    parser.add_argument("--layout", choices=["packed", "masked"], default="packed",
                        help="moe.dispatch's layout (masked: C is the most pairs any rank sends one expert)")
    parser.add_argument("--calls", type=int, default=10, help="traced calls per function")
    parser.add_argument("--out", type=Path, help="folder for moe_profile.json (default: print only)")
    args = parser.parse_args()
    log = common.Progress()
    devices = jax.devices()
    if devices[0].platform != "gpu":
        raise SystemExit("profile_moe: needs a GPU (one is enough: an ep axis of one member)")
    mesh = jax.sharding.Mesh(devices, (bench.AXIS,))
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        routing = bench.make_routing(len(devices), tokens, args.top_k, args.experts_per_rank, seed=0)
        arrays = bench.make_inputs(mesh, routing, tokens, args.hidden, jnp.bfloat16, seed=0)
        arrays["rows"], arrays["handle"] = bench.moe_handle(mesh, arrays, routing, args, args.layout)
        for name, (fn, arg_names) in functions(routing, args.experts_per_rank, args.wire, args.layout).items():
            step = bench.per_rank(mesh, fn, len(arg_names))
            rows = profile(step, [arrays[a] for a in arg_names], args.calls)
            if not rows:
                raise SystemExit("profile_moe: the trace holds no kernel events on GPU 0's streams (is CUPTI "
                                 "available?)")
            print_table(f"T={tokens} {name}", rows, log)
            wire = None if name == "combine" else args.wire  # combine alone reuses a plain dispatch's handle
            results.append({"tokens": tokens, "function": name, "layout": args.layout, "wire": wire,
                            "capacity": bench.capacity_of("nx_moe_masked" if args.layout == "masked" else "nx_moe",
                                                          routing), "kernels": rows})
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe_profile.json").write_text(json.dumps({"meta": common.metadata(), "results": results},
                                                              indent=1, default=str))
        log(f"wrote {args.out / 'moe_profile.json'}")


if __name__ == "__main__":
    main()
