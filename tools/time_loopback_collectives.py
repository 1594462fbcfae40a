"""In-kernel time of the small-message NVLink collectives and of the MoE kernels on one GPU: a diagnostic, not
a benchmark.

On a machine with one GPU the collectives benchmark cannot run, but the test-only module ``_ncclx_loopback``
runs the same kernels with 2 to 8 logical ranks on the one GPU, each rank on its own stream (no link is
crossed: peers are other SMs of the same GPU). This script replays ``--calls`` calls of each case as a CUDA
graph with the device trace on, and reports per call, from the ranks' trace records (%globaltimer, which
advanced in steps of 0.256 µs on an H100):

* ``after_last``: the last rank's end minus the last rank's start, what a call costs once every rank is in,
  without the streams' launch skew. It moves with changes to the kernels' own code;
* ``span``: the last end minus the first start, skew included.

For ``moe.dispatch`` and ``moe.combine`` (``--moe``: decode sizes, hidden 7168 bf16, top-8 of 8 experts per
rank, random routing, capacity the largest load any rank gives any member; ``--moe-layout masked``: the
masked layout's kernels, capacity the most pairs any rank sends one expert) it also splits the last rank's
call (the one that finds every peer already in) into

* ``own``: its time in the kernel outside the wait for peers (start to rows sent, then flags seen to end);
* ``handshake``: rows sent to every peer's flag seen (the cross-rank handshake once all are in). Kernels
  that send LL128 lines raise no flags: there it ends when the first lines (combine: thread 0's) or the
  counts (masked dispatch) arrived.

With ``--moe-phases`` the kernels' blocks also read their SM clock after each phase in the last call (packed
dispatch: the plan's steps, the send, the wait, the placement, the expansion, moe_dispatch.h's
MoeDispatchPhase; masked dispatch and combine: moe_masked.h's phases, each closed by a barrier in profiled
calls only). It prints each phase's median over every rank's blocks, in µs at the GPU's peak clock (the
clock may run slower: compare phases, not totals with the trace).

Medians over the calls after the first 50. The JSON also holds the run's metadata (device, versions, commit:
set ``BENCH_GIT_COMMIT`` on a lent machine, as for the benchmarks). There is no XLA baseline: compare two
builds of the kernels in the same session (``tools/ab_trees.sh`` builds both; run this with each side's
``PYTHONPATH``), never with XLA.

    python tools/time_loopback_collectives.py OUT.json [--ranks 2,4] [--calls 400] [--moe 16,128]
        [--moe-blocks 0,16,32] [--moe-phases] [--moe-layout packed,masked] [--moe-only]
        (--ranks 1: the MoE kernels on an axis of one, their fixed cost)
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
MOE_SHAPE = dict(hidden=7168, top_k=8, experts_per_rank=8)  # bf16 rows, as benchmarks/all_to_allv.py
MOE_SKIPPED_CALLS = 10  # the outputs of every call stay on the GPU: fewer calls at these sizes


def trace_of(done, calls, what, keys):
    """The ``<key>_ns`` times of every traced call, each [ranks, calls], of a loopback run whose ranks are all
    healthy (else RuntimeError naming `what`)."""
    for rank, state in enumerate(done["ranks"]):
        if state["fault"] != "healthy" or len(state["trace"]) != calls:
            raise RuntimeError(f"{what}: rank {rank} is {state['fault']} with {len(state['trace'])} of {calls} "
                               "calls traced")
    return [np.array([[call[f"{key}_ns"] for call in state["trace"]] for state in done["ranks"]], np.float64)
            for key in keys]


def after_last_and_span(start, end):
    """after_last and span (µs, medians over calls) of [ranks, calls] start and end times."""
    return float(np.median(end.max(0) - start.max(0))) / 1e3, float(np.median(end.max(0) - start.min(0))) / 1e3


def time_case(op, nbytes, protocol, algorithm, ranks, calls):
    """(after_last, span) in µs, medians over calls of ``op`` on float32 ones."""
    elements = nbytes // 4 * (ranks if op == "all_to_all" else 1)
    x = np.ones((calls, ranks, elements), np.float32)
    done = loopback.collective(op, x.tobytes(), size=ranks, calls=calls, bytes=elements * 4, element_bytes=4,
                               algorithm=ALGORITHMS[algorithm], protocol=PROTOCOLS[protocol], trace=True,
                               graph=True)
    start, end = trace_of(done, calls, f"{op} {nbytes} B on {ranks} ranks", ("start", "end"))
    return after_last_and_span(start[:, SKIPPED_CALLS:], end[:, SKIPPED_CALLS:])


def moe_times(start, sent, data, end, skipped):
    """after_last, span, own and handshake (µs, medians over calls after `skipped`) of [ranks, calls] records."""
    start, sent, data, end = (a[:, skipped:] for a in (start, sent, data, end))
    last = np.argmax(start, axis=0)  # per call, the rank that started last
    pick = lambda a: a[last, np.arange(a.shape[1])]  # noqa: E731
    own = (pick(sent) - pick(start)) + (pick(end) - pick(data))
    after_last, span = after_last_and_span(start, end)
    return dict(after_last_us=after_last, span_us=span, own_us=float(np.median(own)) / 1e3,
                handshake_us=float(np.median(pick(data) - pick(sent))) / 1e3)


def kernel_phases(done, ranks):
    """{phase: median µs over every rank's blocks} of a MoE kernel's run with phases=True (its last call)."""
    names = done["phase_names"]
    clocks = np.frombuffer(done["phase_clocks"], np.int64).reshape(ranks, done["blocks"], len(names))
    spent = np.diff(clocks, axis=-1).reshape(-1, len(names) - 1) * 1e3 / done["clock_khz"]
    return {name: float(np.median(spent[:, i])) for i, name in enumerate(names[1:])}


def time_moe(ranks, tokens, calls, blocks, phases=False):
    """dispatch's and combine's moe_times at T = `tokens` on `ranks` logical ranks (graph replay, traced), with
    `blocks` thread blocks per kernel (0: chosen by size); with `phases`, dispatch's kernel_phases too."""
    import ml_dtypes

    hidden, top_k, local = MOE_SHAPE["hidden"], MOE_SHAPE["top_k"], MOE_SHAPE["experts_per_rank"]
    num_experts = local * ranks
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((calls, ranks, tokens, num_experts)), axis=-1)[..., :top_k].astype(np.int32)
    capacity = int(max(np.bincount(ids[c, r].ravel() // local, minlength=ranks).max()
                       for c in range(calls) for r in range(ranks)))
    x = rng.standard_normal((calls, ranks, tokens, hidden)).astype(ml_dtypes.bfloat16)
    weights = rng.random((calls, ranks, tokens, top_k)).astype(np.float32)
    done = loopback.moe_dispatch(x.tobytes(), ids.tobytes(), weights.tobytes(), size=ranks, calls=calls,
                                 num_tokens=tokens, row_bytes=hidden * 2, top_k=top_k, num_experts=num_experts,
                                 capacity=capacity, with_weights=True, trace=True, graph=True, blocks=blocks,
                                 phases=phases)
    points = ("start", "sent", "data", "end")
    dispatch = moe_times(*trace_of(done, calls, f"moe.dispatch T={tokens} on {ranks} ranks", points),
                         MOE_SKIPPED_CALLS)
    if phases:
        dispatch["phases_us"] = kernel_phases(done, ranks)
    rows = ranks * min(capacity, tokens)
    # combine sums each token's pairs on the expert side with dispatch's weights, as moe.combine does
    done = loopback.moe_combine(done["expert_rows"], done["row_pairs"], done["recv_weights"], done["recv_tokens"],
                                done["return_row"], size=ranks, calls=calls, type=1, expert_rows=ranks * capacity,
                                rows_per_member=rows // ranks, top_k=top_k, tokens=tokens, hidden=hidden,
                                trace=True, graph=True, blocks=blocks)
    combine = moe_times(*trace_of(done, calls, f"moe.combine T={tokens} on {ranks} ranks", points),
                        MOE_SKIPPED_CALLS)
    return capacity, {"moe.dispatch": dispatch, "moe.combine": combine}


def time_moe_masked(ranks, tokens, calls, blocks, phases=False):
    """moe_times of the masked layout's dispatch and combine (layout="masked") at T = `tokens` on `ranks` logical
    ranks, the same routing as time_moe; C is the most pairs any rank sends one expert, so nothing drops. With
    `phases`, both kernels' kernel_phases too."""
    import ml_dtypes

    hidden, top_k, local = MOE_SHAPE["hidden"], MOE_SHAPE["top_k"], MOE_SHAPE["experts_per_rank"]
    num_experts = local * ranks
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((calls, ranks, tokens, num_experts)), axis=-1)[..., :top_k].astype(np.int32)
    capacity = int(max(np.bincount(ids[c, r].ravel(), minlength=num_experts).max()
                       for c in range(calls) for r in range(ranks)))
    x = rng.standard_normal((calls, ranks, tokens, hidden)).astype(ml_dtypes.bfloat16)
    weights = rng.random((calls, ranks, tokens, top_k)).astype(np.float32)
    done = loopback.moe_masked_dispatch(x.tobytes(), ids.tobytes(), weights.tobytes(), size=ranks, calls=calls,
                                        num_tokens=tokens, hidden=hidden, type=1, top_k=top_k,
                                        num_experts=num_experts, capacity=capacity, with_weights=True, trace=True,
                                        graph=True, blocks=blocks, phases=phases)
    points = ("start", "sent", "data", "end")
    dispatch = moe_times(*trace_of(done, calls, f"masked moe.dispatch T={tokens} on {ranks} ranks", points),
                         MOE_SKIPPED_CALLS)
    if phases:
        dispatch["phases_us"] = kernel_phases(done, ranks)
    # With dispatch's weights, as moe.combine(rows, handle) does: moe.combine's kernel over the flattened rows,
    # each token's pairs summed on the expert side.
    per_source = min(tokens, local * capacity)
    reduced = loopback.moe_combine(done["expert_rows"], done["choice_rows"], done["choice_weights"],
                                   done["recv_tokens"], done["return_row"], size=ranks, calls=calls, type=1,
                                   expert_rows=local * ranks * capacity, rows_per_member=per_source, top_k=top_k,
                                   tokens=tokens, hidden=hidden, trace=True, graph=True, blocks=blocks)
    combine = moe_times(*trace_of(reduced, calls, f"masked moe.combine T={tokens} on {ranks} ranks", points),
                        MOE_SKIPPED_CALLS)
    # With the weights given to combine: the masked combine kernel, one row per pair back.
    by_pair = loopback.moe_masked_combine(done["expert_rows"], done["row_pair"], done["pair_slot"], weights.tobytes(),
                                          size=ranks, calls=calls, type=1, local_experts=local, capacity=capacity,
                                          tokens=tokens, top_k=top_k, hidden=hidden, trace=True, graph=True,
                                          blocks=blocks, phases=phases)
    combine_pairs = moe_times(*trace_of(by_pair, calls, f"masked moe.combine (weights at combine) T={tokens} on "
                                        f"{ranks} ranks", points), MOE_SKIPPED_CALLS)
    if phases:
        combine_pairs["phases_us"] = kernel_phases(by_pair, ranks)
    return capacity, {"moe.dispatch": dispatch, "moe.combine": combine, "moe.combine (weights at combine)":
                      combine_pairs}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="JSON file for the results")
    parser.add_argument("--ranks", default="2,4", help="logical rank counts, comma-separated (2 to 8; 1 for "
                        "the MoE kernels only)")
    parser.add_argument("--calls", type=int, default=400, help=f"calls per case (more than {SKIPPED_CALLS}, "
                        "at most 1024, the trace ring)")
    parser.add_argument("--moe", default="", help="token counts per rank for moe.dispatch and moe.combine, "
                        "comma separated (e.g. 16,128; default: none)")
    parser.add_argument("--moe-blocks", default="0", help="thread blocks per MoE kernel, comma separated (0: "
                        "chosen by size, as the library does)")
    parser.add_argument("--moe-phases", action="store_true", help="also split the kernels into their phases "
                        "(SM clock per block, the last call): packed dispatch, masked dispatch and combine")
    parser.add_argument("--moe-layout", default="packed", help="the MoE layouts to time, comma separated: "
                        "packed (moe.dispatch's default), masked (layout=\"masked\")")
    parser.add_argument("--moe-only", action="store_true", help="time the MoE kernels (--moe) alone, not the "
                        "small collectives: with scarce GPU time, a run that asks only what the kernels cost")
    parser.add_argument("--moe-calls", type=int, default=60, help=f"calls per MoE case (more than "
                        f"{MOE_SKIPPED_CALLS}; each call's rows stay on the GPU)")
    args = parser.parse_args()
    if not SKIPPED_CALLS < args.calls <= 1024:
        parser.error(f"--calls {args.calls}: expected {SKIPPED_CALLS + 1} to 1024")
    if not MOE_SKIPPED_CALLS < args.moe_calls <= 1024:
        parser.error(f"--moe-calls {args.moe_calls}: expected {MOE_SKIPPED_CALLS + 1} to 1024")
    layouts = args.moe_layout.split(",")
    if not set(layouts) <= {"packed", "masked"}:
        parser.error(f"--moe-layout {args.moe_layout}: expected packed, masked or both")
    if args.moe_only and not args.moe:
        parser.error("--moe-only needs --moe (the token counts to time)")
    rank_counts = [int(r) for r in args.ranks.split(",")]
    if not all(1 <= r <= 8 for r in rank_counts):
        parser.error(f"--ranks {args.ranks}: every count must be 1 to 8 (1: the MoE kernels only)")
    results = []
    print(f"{'case':52s} {'after_last':>10s} {'span':>8s}  (µs, medians)")
    for ranks in (r for r in rank_counts if r > 1 and not args.moe_only):
        for op, nbytes, protocol, algorithm in CASES:
            after_last, span = time_case(op, nbytes, protocol, algorithm, ranks, args.calls)
            results.append(dict(op=op, bytes=nbytes, protocol=protocol, algorithm=algorithm, ranks=ranks,
                                after_last_us=after_last, span_us=span))
            print(f"{f'{op} {nbytes} B {protocol} {algorithm}, {ranks} ranks':44s} {after_last:10.2f} {span:8.2f}",
                  flush=True)
    if args.moe:
        print(f"{'case':52s} {'after_last':>10s} {'span':>8s} {'own':>8s} {'handshake':>10s}  (µs, medians)")
    for ranks in rank_counts if args.moe else ():
        for tokens in (int(t) for t in args.moe.split(",")):
            for layout, blocks in ((la, int(b)) for la in layouts for b in args.moe_blocks.split(",")):
                if layout == "masked":
                    capacity, times = time_moe_masked(ranks, tokens, args.moe_calls, blocks, args.moe_phases)
                else:
                    capacity, times = time_moe(ranks, tokens, args.moe_calls, blocks, args.moe_phases)
                for op, t in times.items():
                    results.append(dict(op=op, layout=layout, tokens=tokens, capacity=capacity, ranks=ranks,
                                        blocks=blocks, **MOE_SHAPE, **t))
                    case = (f"{op}{' masked' if layout == 'masked' else ''} T={tokens} (C={capacity}), {ranks} ranks"
                            + (f", {blocks} blocks" if blocks else ""))
                    print(f"{case:52s} {t['after_last_us']:10.2f} {t['span_us']:8.2f} {t['own_us']:8.2f} "
                          f"{t['handshake_us']:10.2f}", flush=True)
                    if "phases_us" in t:
                        print("    phases (µs at the peak clock): " +
                              ", ".join(f"{name} {us:.2f}" for name, us in t["phases_us"].items()), flush=True)
    # After the timing: the metadata starts JAX's GPU client, which must not share the GPU with the calls.
    document = {"meta": common.metadata(), "calls": args.calls, "skipped_calls": SKIPPED_CALLS,
                "moe_calls": args.moe_calls, "moe_skipped_calls": MOE_SKIPPED_CALLS, "results": results}
    with open(args.out, "w") as f:
        json.dump(document, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
