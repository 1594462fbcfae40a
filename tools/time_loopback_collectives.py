"""In-kernel time of the small-message NVLink collectives on one GPU: a diagnostic, not a benchmark.

On a machine with one GPU the collectives benchmark cannot run, but the test-only module ``_ncclx_loopback``
runs the same kernels with 2 to 8 logical ranks on the one GPU, each rank on its own stream (no link is
crossed: peers are other SMs of the same GPU). This script replays ``--calls`` calls of each case as a CUDA
graph with the device trace on, and reports per call, from the ranks' trace records (%globaltimer, which
advanced in steps of 0.256 µs on an H100):

* ``after_last``: the last rank's end minus the last rank's start, what a call costs once every rank is in,
  without the streams' launch skew. It moves with changes to the kernels' own code;
* ``span``: the last end minus the first start, skew included.

Medians over the calls after the first 50. The JSON also holds the run's metadata (device, versions, commit:
set ``BENCH_GIT_COMMIT`` on a lent machine, as for the benchmarks). There is no XLA baseline: compare two
builds of the kernels in the same session (``tools/ab_trees.sh`` builds both; run this with each side's
``PYTHONPATH``), never with XLA.

    python tools/time_loopback_collectives.py OUT.json [--ranks 2,4] [--calls 400]
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import common  # noqa: E402  (run metadata; sets the benchmark environment, NVLink multicast off)

import numpy as np  # noqa: E402

try:
    from jax_ncclx import _ncclx_loopback as loopback
except ImportError:
    from jax_ncclx._src import lib

    sys.exit(f"time_loopback_collectives.py: jax_ncclx._ncclx_loopback is test-only and this build lacks it: "
             f"{lib.TESTING_BUILD_HINT}")

PROTOCOLS = {"ll128": 0, "ll": 1, "simple": 2}
ALGORITHMS = {"one-shot": 1, "two-shot": 2}
# op, bytes per rank (all_to_all: per peer), protocol, algorithm: the paths of nvlink.py's small sizes.
CASES = (
    ("all_reduce", 8, "ll", "one-shot"),
    ("all_reduce", 4096, "ll128", "one-shot"),
    ("all_reduce", 65536, "ll128", "one-shot"),
    ("all_reduce", 262144, "simple", "two-shot"),
    ("all_gather", 256, "ll", "one-shot"),
    ("all_gather", 4096, "ll128", "one-shot"),
    ("all_to_all", 256, "ll", "one-shot"),
    ("all_to_all", 4096, "ll128", "one-shot"),
)
SKIPPED_CALLS = 50


def time_case(op, nbytes, protocol, algorithm, ranks, calls):
    """(after_last, span) in µs, medians over calls of ``op`` on float32 ones."""
    elements = nbytes // 4 * (ranks if op == "all_to_all" else 1)
    x = np.ones((calls, ranks, elements), np.float32)
    done = loopback.collective(op, x.tobytes(), size=ranks, calls=calls, bytes=elements * 4, element_bytes=4,
                               algorithm=ALGORITHMS[algorithm], protocol=PROTOCOLS[protocol], trace=True,
                               graph=True)
    for rank, state in enumerate(done["ranks"]):
        if state["fault"] != "healthy" or len(state["trace"]) != calls:
            raise RuntimeError(f"{op} {nbytes} B on {ranks} ranks: rank {rank} is {state['fault']} with "
                               f"{len(state['trace'])} of {calls} calls traced")
    start = np.array([[call["start_ns"] for call in state["trace"]] for state in done["ranks"]], np.float64)
    end = np.array([[call["end_ns"] for call in state["trace"]] for state in done["ranks"]], np.float64)
    start, end = start[:, SKIPPED_CALLS:], end[:, SKIPPED_CALLS:]
    after_last = float(np.median(end.max(0) - start.max(0))) / 1e3
    span = float(np.median(end.max(0) - start.min(0))) / 1e3
    return after_last, span


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="JSON file for the results")
    parser.add_argument("--ranks", default="2,4", help="logical rank counts, comma-separated (2 to 8)")
    parser.add_argument("--calls", type=int, default=400, help=f"calls per case (more than {SKIPPED_CALLS}, "
                        "at most 1024, the trace ring)")
    args = parser.parse_args()
    if not SKIPPED_CALLS < args.calls <= 1024:
        parser.error(f"--calls {args.calls}: expected {SKIPPED_CALLS + 1} to 1024")
    rank_counts = [int(r) for r in args.ranks.split(",")]
    if not all(2 <= r <= 8 for r in rank_counts):
        parser.error(f"--ranks {args.ranks}: every count must be 2 to 8")
    results = []
    print(f"{'case':44s} {'after_last':>10s} {'span':>8s}  (µs, medians)")
    for ranks in rank_counts:
        for op, nbytes, protocol, algorithm in CASES:
            after_last, span = time_case(op, nbytes, protocol, algorithm, ranks, args.calls)
            results.append(dict(op=op, bytes=nbytes, protocol=protocol, algorithm=algorithm, ranks=ranks,
                                after_last_us=after_last, span_us=span))
            print(f"{f'{op} {nbytes} B {protocol} {algorithm}, {ranks} ranks':44s} {after_last:10.2f} {span:8.2f}",
                  flush=True)
    # After the timing: the metadata starts JAX's GPU client, which must not share the GPU with the calls.
    document = {"meta": common.metadata(), "calls": args.calls, "skipped_calls": SKIPPED_CALLS, "results": results}
    with open(args.out, "w") as f:
        json.dump(document, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
