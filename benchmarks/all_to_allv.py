"""MoE token shuffle: jax_ncclx.all_to_allv_dynamic against XLA's all_to_all and ragged_all_to_all.

One process drives every local GPU on one mesh axis "ep" (with --smoke: 8 virtual CPU devices and tiny
shapes; with --processes N: N processes, one per GPU, through jax.distributed). For each T (tokens per rank)
the routing is that of an MoE layer: each token picks top-k of E = experts_per_rank * N experts at random
(fixed seed), its T*k rows are sorted by expert (so grouped by the rank that owns the expert), and
send_counts is [N, E/N]. The capacity C is the most rows any rank sends any
peer in that routing, so nothing is dropped (--capacity-factor F: at least F times the mean rows per peer, the
headroom of an MoE layer with capacity factor F). Every op is timed per op inside jax.jit(jax.shard_map(...)) as a
chain of dependent ops per call (--unroll; by default 50, or 10 where the padded buffer passes 64 MB, so that
the host's dispatch of a call, ~100 µs on 4 GPUs, hides behind the GPUs' work on the previous call); results
go to benchmarks/results/all_to_allv_<N>gpu[_<P>proc].{json,md,png} (<out>/all_to_allv.* with --out).

    python benchmarks/all_to_allv.py                        # T = 16, 128, 4096 on all GPUs
    python benchmarks/all_to_allv.py --sweep                # plus T = 16 .. 8192, powers of 2
    python benchmarks/all_to_allv.py --transports auto,nccl # both jax_ncclx transports, one after the other
    python benchmarks/all_to_allv.py --processes 2 --tokens 16,128  # one process per GPU
    python benchmarks/all_to_allv.py --smoke --out /tmp/bench_smoke   # CPU, tiny shapes
    python benchmarks/all_to_allv.py --from-json benchmarks/results/all_to_allv_2gpu.json  # redo the .md / .png

See benchmarks/README.md for what the columns mean.
"""

import argparse
import dataclasses
import functools
import gc
import json
import math
import os
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
import xla_moe  # noqa: E402
from jax_ncclx import moe  # noqa: E402
from jax_ncclx._src import config as nx_config  # noqa: E402
from jax_ncclx._src import lowering as nx_lowering  # noqa: E402

AXIS = "ep"
NAME = "all_to_allv"
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32, "fp8": jnp.float8_e4m3fn}
BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
DEFAULTS = {  # (GPU run, --smoke); a flag given on the command line wins
    "tokens": ("16,128,4096", "8,32"),
    "sweep_range": ((16, 8192), (4, 64)),
    "hidden": (7168, 64),
    "top_k": (8, 4),
    "experts_per_rank": (8, 2),
    "iters": (20, 3),
    "pipeline": (10, 2),
    "max_seconds": (1.0, 0.2),
}
VARIANTS = {  # key: (label, times the payload moves per op)
    "nx_padded": ("nx all_to_allv_dynamic padded", 1),
    "nx_padded_recv": ("nx padded, chained by recv_counts", 1),
    "nx_packed": ("nx all_to_allv_dynamic packed", 1),
    "nx_ragged": ("nx ragged_all_to_all (host sizes)", 1),
    "xla_all_to_all": ("lax.all_to_all (pre-padded)", 1),
    "xla_ragged": ("lax.ragged_all_to_all (host sizes)", 1),
    "xla_ragged_counts": ("lax.ragged_all_to_all + count a2a", 1),
    "nx_moe": ("nx moe dispatch+combine", 2),
    "nx_moe_pairs": ("nx moe dispatch+combine, weights at combine", 2),
    "nx_moe_dispatch": ("nx moe dispatch", 1),
    "nx_moe_combine": ("nx moe combine", 1),
    "nx_moe_fp8": ("nx moe dispatch+combine, fp8 dispatch wire", 2),
    "nx_moe_dispatch_fp8": ("nx moe dispatch, fp8 wire", 1),
    "nx_moe_masked": ("nx moe dispatch+combine, masked layout", 2),
    "nx_moe_masked_dispatch": ("nx moe dispatch, masked layout", 1),
    "nx_moe_masked_fp8": ("nx moe dispatch+combine, masked layout, fp8 dispatch wire", 2),
    "nx_moe_masked_dispatch_fp8": ("nx moe dispatch, masked layout, fp8 wire", 1),
    "xla_moe": ("XLA moe layer dispatch+combine", 2),
    "xla_moe_dispatch": ("XLA moe layer dispatch", 1),
}
LONG_OP_BYTES = 64 * 2**20  # padded buffers past this take ~0.2 ms per op or more: 10 ops per call
MOE_VARIANTS = ("nx_moe", "nx_moe_pairs", "nx_moe_dispatch", "nx_moe_combine", "nx_moe_fp8",
                "nx_moe_dispatch_fp8", "nx_moe_masked", "nx_moe_masked_dispatch", "nx_moe_masked_fp8",
                "nx_moe_masked_dispatch_fp8")
FP8_WIRE = jnp.float8_e4m3fn  # the *_fp8 variants: moe.dispatch(wire_dtype=FP8_WIRE)
# Largest round-trip error (relative to max |token|) accepted before timing, by dispatch wire: bf16 tokens
# round once per op; e4m3 keeps each value within 2^-4 of itself, and the weights sum to 1.
ROUND_TRIP_TOLERANCE = {None: 5e-2, FP8_WIRE: 8e-2}
BASELINES = ("xla_all_to_all", "xla_ragged", "xla_ragged_counts")
XLA_MOE_VARIANTS = ("xla_moe", "xla_moe_dispatch")  # benchmarks/xla_moe.py: the same layer in XLA's own ops
TABLE = [  # (key, header, width, format) of the progress table
    ("tokens", "T", 5, "d"), ("variant", "variant", 17, ""), ("transport", "transport", 9, ""),
    ("path", "path", 11, ""),
    ("median_us", "median us", 10, ".1f"), ("min_us", "min us", 10, ".1f"), ("peer_gbps", "peer GB/s", 9, ".1f"),
    ("alg_gbps", "alg GB/s", 9, ".1f"), ("vs_xla_all_to_all", "x a2a", 6, ".2f"),
    ("vs_xla_ragged", "x ragged", 8, ".2f"), ("vs_xla_ragged_counts", "x rag+c", 7, ".2f"),
    ("vs_xla_moe", "x moe", 6, ".2f"), ("reps", "reps", 4, "d"), ("compile_s", "compile s", 9, ".2f"),
    ("status", "status", 11, ""),
]


class VerificationError(RuntimeError):
    """jax_ncclx returned wrong results: the run stops."""


class RunError(RuntimeError):
    """jax_ncclx raised errors in some measurements (recorded in the results): the run fails at its end."""


# ---- routing and inputs ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Routing:
    """A random top-k routing of T tokens on each of N ranks (host arrays).

    Attributes:
      experts: int32 [N, T, k], distinct experts per token.
      weights: float32 [N, T, k], positive, summing to 1 per token.
      order: int32 [N, T*k]: sorted row r of a rank is its (token, choice) ``order[r]`` (token ``order[r] // k``).
      counts: int32 [N src, N dst, E/N]: rows each rank sends to each expert.
      capacity: the most rows any rank sends any peer, or more (make_routing's capacity_factor).
    """

    experts: np.ndarray
    weights: np.ndarray
    order: np.ndarray
    counts: np.ndarray
    capacity: int

    @property
    def per_peer(self):  # [N src, N dst] rows
        return self.counts.sum(axis=2)

    @property
    def starts(self):  # [N src, N dst] first sorted row of each peer's block
        return np.cumsum(self.per_peer, axis=1) - self.per_peer


def make_routing(n: int, tokens: int, top_k: int, experts_per_rank: int, seed: int,
                 capacity_factor: float = 0.0) -> Routing:
    """capacity_factor F: the capacity is at least ceil(F * T * k / N), the headroom an MoE layer reserves."""
    rng = np.random.default_rng([seed, tokens])
    num_experts = n * experts_per_rank
    scores = rng.random((n, tokens, num_experts), dtype=np.float32)
    experts = np.argpartition(-scores, top_k - 1, axis=2)[:, :, :top_k].astype(np.int32)
    weights = rng.random((n, tokens, top_k), dtype=np.float32) + 0.1
    weights /= weights.sum(axis=2, keepdims=True)
    flat = experts.reshape(n, -1)
    order = np.argsort(flat, axis=1, kind="stable").astype(np.int32)
    counts = np.stack([np.bincount(f, minlength=num_experts) for f in flat]).reshape(n, n, experts_per_rank)
    capacity = max(int(counts.sum(axis=2).max()), math.ceil(capacity_factor * tokens * top_k / n))
    return Routing(experts, weights, order, counts.astype(np.int32), capacity)


def sizes_of(routing: Routing, tokens: int, hidden: int, top_k: int, itemsize: int) -> dict:
    n = routing.counts.shape[0]
    row_bytes = hidden * itemsize
    per_peer = routing.per_peer
    peer_rows = per_peer.sum(axis=1) - np.diag(per_peer)
    return {
        "tokens": tokens,
        "rows_per_rank": tokens * top_k,
        "capacity": routing.capacity,
        "row_bytes": row_bytes,
        "payload_bytes": tokens * top_k * row_bytes,
        "peer_bytes": float(peer_rows.mean() * row_bytes),
        "peer_bytes_per_rank": (peer_rows * row_bytes).tolist(),
        "padded_bytes": n * routing.capacity * row_bytes,
        "rows_per_peer": per_peer.tolist(),
    }


def per_rank(mesh, fn, n_in, **kwargs):
    """``fn`` per rank under jit(shard_map); every argument and result is split over the axis."""
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(AXIS),) * n_in, out_specs=P(AXIS)), **kwargs)


def make_inputs(mesh, routing: Routing, tokens: int, hidden: int, dtype, seed: int) -> dict:
    """Device arrays, each [N * per-rank rows, ...] and split over the axis."""
    n, top_k = routing.experts.shape[0], routing.experts.shape[2]
    capacity = routing.capacity
    sharding = NamedSharding(mesh, P(AXIS))

    def put(a):  # every process holds the whole array and places its own devices' parts
        return jax.make_array_from_callback(a.shape, sharding, lambda index: np.ascontiguousarray(a[index]))

    @functools.partial(jax.jit, out_shardings=sharding)
    def random_tokens(key):
        return jax.random.normal(key, (n * tokens, hidden), jnp.float32).astype(dtype)

    # Padded layout: slot s of peer j's block is sorted row starts[j] + s, or -1 past that peer's rows.
    slot = np.arange(capacity)
    pad_index = np.where(slot[None, None, :] < routing.per_peer[:, :, None],
                         routing.starts[:, :, None] + slot[None, None, :], -1).astype(np.int32)

    arrays = {
        "tokens": random_tokens(jax.random.key(seed + tokens)),
        "order": put(routing.order.reshape(-1)),
        "counts": put(routing.counts.reshape(n * n, -1)),
        "expert_ids": put(routing.experts.reshape(n * tokens, top_k)),
        "weights": put(routing.weights.reshape(n * tokens, top_k)),
        "in_offsets": put(routing.starts.reshape(-1).astype(np.int32)),
        "send_sizes": put(routing.per_peer.reshape(-1).astype(np.int32)),
        "out_offsets": put(np.repeat(np.arange(n, dtype=np.int32) * capacity, n)),
        "recv_sizes": put(routing.per_peer.T.reshape(-1).astype(np.int32)),
    }
    pad_index = put(pad_index.reshape(-1))
    arrays["x"] = per_rank(mesh, lambda t, o: t[o // top_k], 2)(arrays["tokens"], arrays["order"])
    arrays["padded"] = per_rank(
        mesh, lambda x, i: jnp.where((i >= 0)[:, None], x[jnp.maximum(i, 0)], jnp.zeros((), x.dtype)), 2,
    )(arrays["x"], pad_index)
    jax.block_until_ready(arrays)
    return arrays


# ---- the timed chains (per rank) ---------------------------------------------------------------------------

def tie(sizes, y):
    """``sizes + 0``, computed from one element of y: the next op's counts depend on this op's result, so XLA
    can neither merge nor overlap the ops of a chain (one tiny integer kernel per op; ``v != v`` is not folded
    for floats). y passes an optimization barrier first: XLA would otherwise compute only the element read
    when y comes from a gather or a reduction (moe's expert-major rows, combine's weighted sum)."""
    first = jax.lax.optimization_barrier(y).reshape(-1)[0]
    return sizes + (first != first).astype(sizes.dtype)


def nx_chain(x, counts, *, capacity, layout, unroll):
    for _ in range(unroll):
        y, _, _ = nx.all_to_allv_dynamic(x, counts, AXIS, max_recv_per_peer=capacity, layout=layout)
        counts = tie(counts, y)
    return counts


def pad_rows(x, *, rows):
    """x with zero rows appended up to ``rows``."""
    return jnp.pad(x, ((0, max(0, rows - x.shape[0])), (0, 0)))


def nx_recv_counts_chain(x, counts, *, capacity, unroll):
    """Each op sends what the last one received: its recv_counts [N, K] are the next op's send counts, a
    dependency with no kernel of its own, as in lax.all_to_all's chain. A peer's rows go one way in one op and
    the other way in the next, so every op moves the routing's bytes between ranks in all. x has N·C rows
    (``x_wide``), so that no op's counts run past its end."""
    for _ in range(unroll):
        _, counts, _ = nx.all_to_allv_dynamic(x, counts, AXIS, max_recv_per_peer=capacity, layout="padded")
    return counts


def a2a_chain(padded, *, unroll):
    for _ in range(unroll):  # the output is the next input: XLA's own chain, no extra kernel
        padded = jax.lax.all_to_all(padded, AXIS, 0, 0, tiled=True)
    return padded


def ragged_op(x, in_offsets, send_sizes, out_offsets, recv_sizes, *, capacity, exchange_counts, ours=False):
    """One ragged_all_to_all into a zeroed [N*C, H] buffer, rows from source i at i*C (the padded layout):
    XLA's, or with ``ours`` jax_ncclx's on the same arguments (taking at most C rows from a peer). With
    exchange_counts the receive sizes come from a lax.all_to_all of the send sizes, as a layer that knows
    only its own counts must do."""
    if exchange_counts:
        recv_sizes = jax.lax.all_to_all(send_sizes, AXIS, 0, 0, tiled=True)
    out = jnp.zeros((jax.lax.axis_size(AXIS) * capacity, x.shape[1]), x.dtype)
    ragged = functools.partial(nx.ragged_all_to_all, max_recv_per_peer=capacity) if ours \
        else jax.lax.ragged_all_to_all
    return ragged(x, out, in_offsets, send_sizes, out_offsets, recv_sizes, axis_name=AXIS)


def ragged_chain(x, in_offsets, send_sizes, out_offsets, recv_sizes, *, capacity, exchange_counts, unroll,
                 ours=False):
    for _ in range(unroll):
        y = ragged_op(x, in_offsets, send_sizes, out_offsets, recv_sizes, capacity=capacity,
                      exchange_counts=exchange_counts, ours=ours)
        send_sizes = tie(send_sizes, y)
    return send_sizes


def layout_of(variant):
    """moe.dispatch's layout for a moe variant."""
    return "masked" if "_masked" in variant else "packed"


def capacity_of(variant, routing):
    """A moe variant's capacity: the routing's per-member capacity, or (masked layout) the most rows any rank
    sends any one expert, so that nothing drops either way."""
    return max(1, int(routing.counts.max())) if layout_of(variant) == "masked" else routing.capacity


def wire_of(variant):
    """The dispatch wire dtype of a moe variant (None: the tokens' own)."""
    return FP8_WIRE if variant.endswith("_fp8") else None


def weights_in_of(variant):
    """Where a moe round trip gives the router weights: to dispatch (combine sums each token's pairs on the
    expert side and sends one row per token and member back), or to combine (one row per pair comes back)."""
    return "combine" if variant == "nx_moe_pairs" else "dispatch"


def experts(rows):
    """The round trips' stand-in for the experts between dispatch and combine: the identity, behind an
    optimization barrier, as real experts would be. Without it XLA folds the XLA layer's combine gathers into
    its dispatch gathers on one device, where its all_to_all moves nothing (a round trip then took half the
    time of its dispatch alone on one H100)."""
    return jax.lax.optimization_barrier(rows)


def moe_round_trip(tokens, expert_ids, weights, *, num_experts, capacity, wire_dtype=None, weights_in="dispatch",
                   layout="packed"):
    kwargs = dict(num_experts=num_experts, axis_name=AXIS, capacity=capacity, wire_dtype=wire_dtype, layout=layout)
    if weights_in == "dispatch":
        rows, _, handle = moe.dispatch(tokens, expert_ids, weights=weights, **kwargs)
        return moe.combine(experts(rows), handle)
    rows, _, handle = moe.dispatch(tokens, expert_ids, **kwargs)
    return moe.combine(experts(rows), handle, weights)


def xla_moe_round_trip(tokens, expert_ids, weights, *, num_experts, capacity):
    rows, _, routing = xla_moe.dispatch(tokens, expert_ids, num_experts=num_experts, axis_name=AXIS,
                                        capacity=capacity)
    return xla_moe.combine(experts(rows), routing, weights)


def checked_by(variant):
    """The round trip that verifies a moe variant: its own, or the one whose dispatch (or combine) it times."""
    if variant.startswith("xla_"):
        return "xla_moe"
    if variant == "nx_moe_pairs":
        return variant
    layout = "_masked" if layout_of(variant) == "masked" else ""
    return f"nx_moe{layout}_fp8" if variant.endswith("_fp8") else f"nx_moe{layout}"


def round_trip_of(variant, num_experts, capacity):
    """(tokens, expert_ids, weights) -> combined tokens, for a round-trip variant."""
    if variant == "xla_moe":
        return functools.partial(xla_moe_round_trip, num_experts=num_experts, capacity=capacity)
    return functools.partial(moe_round_trip, num_experts=num_experts, capacity=capacity, wire_dtype=wire_of(variant),
                             weights_in=weights_in_of(variant), layout=layout_of(variant))


def dispatch_of(variant, num_experts, capacity):
    """(tokens, expert_ids) -> expert-major rows, for a dispatch variant."""
    kwargs = dict(num_experts=num_experts, axis_name=AXIS, capacity=capacity)
    if variant == "xla_moe_dispatch":
        return lambda tokens, expert_ids: xla_moe.dispatch(tokens, expert_ids, **kwargs)[0]
    return lambda tokens, expert_ids: moe.dispatch(tokens, expert_ids, wire_dtype=wire_of(variant),
                                                   layout=layout_of(variant), **kwargs)[0]


def moe_chain(tokens, expert_ids, weights, *, round_trip, unroll):
    for _ in range(unroll):  # the weights sum to 1 per token, so the tokens come back (about) unchanged
        tokens = round_trip(tokens, expert_ids, weights).astype(tokens.dtype)
        # Route again from ids tied to the result, as the next layer would: with the same ids every time,
        # XLA would compute the send plan once for the whole chain.
        expert_ids = tie(expert_ids, tokens)
    return tokens


def moe_dispatch_chain(tokens, expert_ids, *, dispatch, unroll):
    for _ in range(unroll):  # each dispatch routes again from the expert ids that the last one tied to its rows
        # The tokens pass the barrier with those ids, else the work on the tokens alone (the 8-bit wire's
        # quantization) would be loop-invariant and XLA would run it once for the whole chain.
        tokens, expert_ids = jax.lax.optimization_barrier((tokens, tie(expert_ids, dispatch(tokens, expert_ids))))
    return expert_ids


def moe_combine_chain(expert_rows, handle, *, unroll):
    # One handle, made by a dispatch (with the weights) outside the timing. The next combine's indices (of the
    # expert-side sums and of the return exchange) are tied to this one's output, else that work would be
    # loop-invariant and XLA would run it once.
    for _ in range(unroll):
        out = moe.combine(expert_rows, handle)
        handle = dataclasses.replace(handle, row_pairs=tie(handle.row_pairs, out),
                                     send_back_rows=tie(handle.send_back_rows, out))
    return handle.send_back_rows


def moe_handle(mesh, arrays, routing, args, layout="packed"):
    """dispatch's (expert_rows, handle) for the inputs in `layout`, with the weights, every leaf split over the
    axis, for the combine chain."""
    capacity = capacity_of("nx_moe_masked" if layout == "masked" else "nx_moe", routing)

    def fn(tokens, expert_ids, weights):
        return moe.dispatch(tokens, expert_ids, num_experts=routing.counts.shape[0] * args.experts_per_rank,
                            axis_name=AXIS, capacity=capacity, weights=weights, layout=layout)

    rows, _, handle = per_rank(mesh, fn, 3)(arrays["tokens"], arrays["expert_ids"], arrays["weights"])
    return rows, handle


def chain_and_args(variant, mesh, arrays, routing, args):
    """(jitted chain, the names of its arguments, whether it donates its first argument and returns its next
    value)."""
    capacity, unroll = routing.capacity, args.unroll
    if variant in ("nx_padded", "nx_packed"):
        fn = functools.partial(nx_chain, capacity=capacity, layout=variant[3:], unroll=unroll)
        return per_rank(mesh, fn, 2), ("x", "counts"), False
    if variant == "nx_padded_recv":
        if "x_wide" not in arrays:  # made once per T, outside the timing
            wide = functools.partial(pad_rows, rows=routing.counts.shape[0] * capacity)
            arrays["x_wide"] = per_rank(mesh, wide, 1)(arrays["x"])
        fn = functools.partial(nx_recv_counts_chain, capacity=capacity, unroll=unroll)
        return per_rank(mesh, fn, 2), ("x_wide", "counts"), False
    if variant == "xla_all_to_all":
        fn = functools.partial(a2a_chain, unroll=unroll)
        return per_rank(mesh, fn, 1, donate_argnums=0), ("padded",), True
    if variant in ("xla_ragged", "xla_ragged_counts", "nx_ragged"):
        fn = functools.partial(ragged_chain, capacity=capacity, exchange_counts=variant == "xla_ragged_counts",
                               unroll=unroll, ours=variant == "nx_ragged")
        return per_rank(mesh, fn, 5), ("x", "in_offsets", "send_sizes", "out_offsets", "recv_sizes"), False
    num_experts = routing.counts.shape[0] * args.experts_per_rank
    if variant in ("nx_moe", "nx_moe_pairs", "nx_moe_fp8", "nx_moe_masked", "nx_moe_masked_fp8", "xla_moe"):
        fn = functools.partial(moe_chain, round_trip=round_trip_of(variant, num_experts, capacity_of(variant, routing)),
                               unroll=unroll)
        return per_rank(mesh, fn, 3, donate_argnums=0), ("tokens", "expert_ids", "weights"), True
    if variant in ("nx_moe_dispatch", "nx_moe_dispatch_fp8", "nx_moe_masked_dispatch", "nx_moe_masked_dispatch_fp8",
                   "xla_moe_dispatch"):
        dispatch = dispatch_of(variant, num_experts, capacity_of(variant, routing))
        fn = functools.partial(moe_dispatch_chain, dispatch=dispatch, unroll=unroll)
        return per_rank(mesh, fn, 2), ("tokens", "expert_ids"), False
    if variant == "nx_moe_combine":
        fn = functools.partial(moe_combine_chain, unroll=unroll)
        return per_rank(mesh, fn, 2), ("expert_rows", "handle"), False
    raise ValueError(variant)


def time_variant(variant, mesh, arrays, routing, args) -> dict:
    traced = args.device_trace and variant.startswith("nx_")
    before = common.device_epochs() if traced else None
    fn, names, donates = chain_and_args(variant, mesh, arrays, routing, args)
    inputs = [arrays[k] for k in names]
    if donates:
        inputs[0] = jax.device_put(inputs[0], inputs[0].sharding, may_alias=False)  # a copy: calls consume it
    timing = common.time_jitted(fn, *inputs, ops_per_call=args.unroll, feedback=donates, reps=args.iters,
                                pipeline=args.pipeline,
                                max_seconds=args.max_seconds, on_compile=lambda c: common.ffi_targets(c.as_text()))
    timing["ffi_targets"] = timing.pop("compiled_info")
    timing["path"] = path_of(timing["ffi_targets"], mesh.devices.flat[0].platform)
    for array in jax.tree.leaves(timing.pop("final")):
        array.delete()
    if traced:
        timing.update(common.device_breakdown(before))
    return timing


def path_of(targets: list, platform: str) -> str:
    """How the data moved, from the compiled program: "xla" (no jax_ncclx collective), "cpu", "nvlink" (the
    NVLink kernel), "nccl", or "nvlink+nccl" (both). Local ops (moe routing, row copies) move nothing between
    devices and do not count."""
    targets = [t for t in targets if t not in nx_lowering.LOCAL_TARGETS]
    if not targets:
        return "xla"
    if platform == "cpu":
        return "cpu"
    kinds = {"nvlink" if t.endswith("_nvlink") else "nccl" for t in targets}
    return "+".join(sorted(kinds, reverse=True))


# ---- verification (outside the timing) ---------------------------------------------------------------------

def bits(a):
    return jax.lax.bitcast_convert_type(a, BITS[a.dtype.itemsize])


def verify_nx(mesh, arrays, routing):
    """Runs both layouts once and checks them, bit for bit, against lax.all_to_all of the padded buffer (the
    packed layout against its rows packed), plus recv_counts and dropped. Raises VerificationError."""
    capacity = routing.capacity
    n = routing.counts.shape[0]

    def body(x, counts, padded):
        ref = jax.lax.all_to_all(padded, AXIS, 0, 0, tiled=True)  # [N*C, H], block i from source i
        y_pad, recv_pad, dropped_pad = nx.all_to_allv_dynamic(x, counts, AXIS, max_recv_per_peer=capacity,
                                                              layout="padded")
        y_pack, recv_pack, dropped_pack = nx.all_to_allv_dynamic(x, counts, AXIS, max_recv_per_peer=capacity,
                                                                 layout="packed")
        received = recv_pad.sum(axis=1)  # rows from each source            [N]
        ends = jnp.cumsum(received)
        row = jnp.arange(n * capacity)
        source = jnp.minimum(jnp.searchsorted(ends, row, side="right"), n - 1)
        src_row = source * capacity + row - (ends - received)[source]
        packed = jnp.where((row < ends[-1])[:, None], ref[jnp.clip(src_row, 0, n * capacity - 1)],
                           jnp.zeros((), ref.dtype))
        stats = jnp.stack([jnp.sum(bits(y_pad.reshape(ref.shape)) != bits(ref)),
                           jnp.sum(bits(y_pack) != bits(packed)),
                           jnp.sum(dropped_pad), jnp.sum(dropped_pack)]).astype(jnp.int32)
        return stats[None], recv_pad, recv_pack

    stats, recv_pad, recv_pack = per_rank(mesh, body, 3)(arrays["x"], arrays["counts"], arrays["padded"])
    local = [rank for rank, device in enumerate(mesh.devices.flat) if device.process_index == jax.process_index()]
    expected = routing.counts.transpose(1, 0, 2)[local]  # [dst, src, chunk], this process's ranks
    wrong_recv = [not np.array_equal(common.local_values(recv).reshape(expected.shape), expected)
                  for recv in (recv_pad, recv_pack)]
    # Every process checks its own ranks; all see every rank's verdict, so that they stop (or go on) together.
    stats = common.gathered(common.local_values(stats).reshape(-1, 4)).astype(np.int64)  # [N, 4]
    wrong_recv = common.gathered(np.asarray([wrong_recv])).any(axis=0)
    problems = []
    for i, what in enumerate(("padded y differs from lax.all_to_all in {} elements per rank",
                              "packed y differs from the packed lax.all_to_all rows in {} elements per rank",
                              "padded layout dropped {} rows per rank", "packed layout dropped {} rows per rank")):
        if stats[:, i].any():
            problems.append(what.format(stats[:, i].tolist()))
    for name, wrong in zip(("padded", "packed"), wrong_recv):
        if wrong:
            problems.append(f"{name} recv_counts differ from the routing's counts")
    del recv_pad, recv_pack
    if problems:
        raise VerificationError("jax_ncclx.all_to_allv_dynamic gave wrong results: " + "; ".join(problems))


def verify_ragged(mesh, arrays, routing, ours=False):
    """Mismatching elements per rank of one ragged_all_to_all (XLA's, or with ``ours`` jax_ncclx's) against
    lax.all_to_all of the padded buffer."""
    op = functools.partial(ragged_op, capacity=routing.capacity, exchange_counts=False, ours=ours)

    def body(x, padded, *sizes):
        ref = jax.lax.all_to_all(padded, AXIS, 0, 0, tiled=True)
        return jnp.sum(bits(op(x, *sizes)) != bits(ref)).astype(jnp.int32)[None]

    names = ("x", "padded", "in_offsets", "send_sizes", "out_offsets", "recv_sizes")
    mismatches = common.local_values(per_rank(mesh, body, 6)(*(arrays[k] for k in names)))
    return common.gathered(mismatches).astype(np.int64).tolist()


def verify_moe(mesh, arrays, routing, experts_per_rank, variant):
    """Largest |combine(dispatch(t)) - t * sum(weights)| relative to max |t| (the weights sum to 1), for a
    round-trip variant."""
    round_trip = round_trip_of(variant, routing.counts.shape[0] * experts_per_rank, capacity_of(variant, routing))

    def body(tokens, expert_ids, weights):
        out = round_trip(tokens, expert_ids, weights).astype(jnp.float32)
        expected = tokens.astype(jnp.float32) * weights.sum(axis=1, keepdims=True)
        return (jnp.max(jnp.abs(out - expected)) / jnp.maximum(jnp.max(jnp.abs(expected)), 1e-6))[None]

    errors = common.local_values(per_rank(mesh, body, 3)(arrays["tokens"], arrays["expert_ids"], arrays["weights"]))
    return float(np.max(common.gathered(errors)))  # every process's ranks: all decide alike


# ---- the run -----------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[8:]))
    parser.add_argument("--smoke", action="store_true",
                        help="8 virtual CPU devices, tiny shapes, results under a temporary folder by default")
    parser.add_argument("--tokens", help="tokens per rank, comma separated (default 16,128,4096; smoke 8,32)")
    parser.add_argument("--sweep", action="store_true", help="add powers of 2 from 16 to 8192 (smoke 4 to 64)")
    parser.add_argument("--hidden", type=int, help="row width (default 7168; smoke 64)")
    parser.add_argument("--top-k", type=int, help="experts per token (default 8; smoke 4)")
    parser.add_argument("--experts-per-rank", type=int, help="local experts, K of send_counts [N, K] (default 8; "
                        "smoke 2)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--capacity-factor", type=float, default=0.0,
                        help="capacity C at least F * T * k / N, the mean rows per peer, as an MoE layer with "
                        "capacity factor F reserves (default 0: C = the most rows any rank sends any peer)")
    parser.add_argument("--iters", type=int, help="the most timed calls per variant (default 20; smoke 3)")
    parser.add_argument("--unroll", type=int, help="dependent ops per jitted call (default 50, or 10 where the "
                        "padded buffer passes 64 MB; smoke 3)")
    parser.add_argument("--pipeline", type=int, help="calls per timed sample, dispatched back to back before one "
                        "wait, so dispatch overlaps the GPUs' work (default 10; smoke 2; 1 = wait after every "
                        "call, which adds one dispatch and one wait per call to the time of its ops)")
    parser.add_argument("--max-seconds", type=float, help="stop timing a variant after this many seconds of "
                        "timed calls, at least 3 calls (default 1.0; smoke 0.2)")
    parser.add_argument("--transports", help="JAX_NCCLX_TRANSPORT values to run the jax_ncclx variants with, "
                        "comma separated, e.g. auto,nccl ('default' = unset; default: the environment's value)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--device-trace", action="store_true",
                        help="compile with JAX_NCCLX_TRACE=device and add, per jax_ncclx variant on NVLink, the GPU's "
                        "own timeline: kernel time, idle gap between kernels, wait for peers, send, wait for data, "
                        "finish, and moe dispatch's plan (medians)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results; smoke: a folder "
                        "under the system's temporary directory; --from-json: the JSON's folder)")
    parser.add_argument("--name", help=common.name_help(NAME))
    parser.add_argument("--from-json", type=Path, help="rewrite the .md and .png of an earlier run's JSON, "
                        "without running anything")
    args = common.parse_arguments(parser, argv, DEFAULTS)
    tokens = {int(t) for t in str(args.tokens).split(",") if t.strip()}
    if args.sweep:
        low, high = args.sweep_range
        tokens |= {1 << e for e in range(low.bit_length() - 1, high.bit_length())}
    args.tokens = sorted(tokens)
    if not args.tokens or min(args.tokens) < 1:
        parser.error("--tokens needs positive integers")
    if args.top_k > 0 and args.experts_per_rank < 1:
        parser.error("--experts-per-rank must be >= 1")
    args.variants = common.choices(parser, args.variants, VARIANTS, "--variants")
    if args.transports is None:
        args.transports = [os.environ.get("JAX_NCCLX_TRANSPORT") or "default"]
    else:
        args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    common.settle_output(args, NAME)
    return parser, args


def set_transport(transport):
    """Sets JAX_NCCLX_TRANSPORT ("default": unset), which jax_ncclx reads when it lowers a collective, and when
    that changes it drops JAX's caches so the programs compiled next see it. Returns the transport in force
    (the package's own default spelled out)."""
    before = os.environ.get("JAX_NCCLX_TRANSPORT")
    if transport == "default":
        os.environ.pop("JAX_NCCLX_TRANSPORT", None)
    else:
        os.environ["JAX_NCCLX_TRANSPORT"] = transport
    if os.environ.get("JAX_NCCLX_TRANSPORT") != before:
        jax.clear_caches()
    return nx_config.current().transport


def status_of(error: Exception) -> str:
    text = str(error)
    return "unsupported" if "UNIMPLEMENTED" in text or "not supported" in text.lower() else "error"


def make_row(variant, transport, size, args, timing=None, status="ok", message=None, verified=None) -> dict:
    label, shuffles = VARIANTS[variant]
    row = {"tokens": size["tokens"], "variant": variant, "label": label, "transport": transport, "status": status,
           "message": message, "verified": verified, "dtype": args.dtype, "hidden": args.hidden,
           "top_k": args.top_k, "num_experts": args.num_devices * args.experts_per_rank,
           "capacity": size["capacity"], "rows_per_rank": size["rows_per_rank"],
           "payload_bytes": size["payload_bytes"], "peer_bytes": size["peer_bytes"],
           "padded_bytes": size["padded_bytes"], "shuffles_per_op": shuffles, "unroll": args.unroll}
    if timing is not None:
        row.update(timing)
        for suffix, key in (("", "median_us"), ("_best", "min_us")):
            seconds = timing[key] * 1e-6
            row["peer_gbps" + suffix] = shuffles * size["peer_bytes"] / seconds / 1e9
            row["alg_gbps" + suffix] = shuffles * size["payload_bytes"] / seconds / 1e9
    return row


def add_speedups(row, baselines):
    """The row's ``vs_<baseline>`` ratios (XLA's median / this one): the exchange against each XLA collective,
    a moe round trip or dispatch against the XLA moe layer's (``vs_xla_moe``)."""
    variant = row["variant"]
    if row["status"] != "ok" or not variant.startswith("nx_") or variant == "nx_moe_combine":
        return
    if variant in MOE_VARIANTS:
        pairs = [("xla_moe", "xla_moe_dispatch" if "dispatch" in variant else "xla_moe")]
    else:
        pairs = [(key, key) for key in BASELINES]
    for column, key in pairs:
        base = baselines.get(key)
        row[f"vs_{column}"] = base["median_us"] / row["median_us"] if base and base["status"] == "ok" else None


def default_unroll(size, smoke):
    """Ops per jitted call: enough that one call's GPU time hides the host's dispatch of the next (~100 µs
    on 4 GPUs, ~225 on 8: with 10 ops per call that floor alone is 10-20 µs per op), and few where each op
    takes long, to bound the run time."""
    if smoke:
        return 3
    return 10 if size["padded_bytes"] > LONG_OP_BYTES else 50


def run_size(tokens, mesh, args, log, table, rows, sizes):
    n = args.num_devices
    routing = make_routing(n, tokens, args.top_k, args.experts_per_rank, args.seed, args.capacity_factor)
    size = sizes_of(routing, tokens, args.hidden, args.top_k, np.dtype(DTYPES[args.dtype]).itemsize)
    sizes.append(size)
    args = argparse.Namespace(**{**vars(args), "unroll": args.unroll or default_unroll(size, args.smoke)})
    size["unroll"] = args.unroll
    log(f"T={tokens}: {size['rows_per_rank']} rows/rank, C={routing.capacity}, payload "
        f"{size['payload_bytes'] / 1e6:.2f} MB/rank ({size['peer_bytes'] / 1e6:.2f} MB to peers), padded "
        f"buffer {size['padded_bytes'] / 1e6:.2f} MB/rank, {args.unroll} ops per call")
    arrays = make_inputs(mesh, routing, tokens, args.hidden, DTYPES[args.dtype], args.seed)
    baselines = {}

    def record(row):
        add_speedups(row, baselines)
        rows.append(row)
        table.row(row)

    wanted = set(args.variants)
    if "xla_all_to_all" in wanted:
        try:
            row = make_row("xla_all_to_all", "xla", size, args,
                           time_variant("xla_all_to_all", mesh, arrays, routing, args))
        except Exception as e:  # noqa: BLE001 - a baseline that fails is recorded, not fatal
            why = common.error_line(e)
            log(f"WARNING: lax.all_to_all at T={tokens}: {why}")
            row = make_row("xla_all_to_all", "xla", size, args, status=status_of(e), message=why)
        baselines["xla_all_to_all"] = row
        record(row)
    ragged = [v for v in ("xla_ragged", "xla_ragged_counts") if v in wanted]
    if ragged:
        try:
            mismatches = verify_ragged(mesh, arrays, routing)
            verified = not any(mismatches)
            if not verified:
                log(f"WARNING: ragged_all_to_all differs from lax.all_to_all in {mismatches} elements per rank")
            for variant in ragged:
                baselines[variant] = make_row(variant, "xla", size, args,
                                              time_variant(variant, mesh, arrays, routing, args),
                                              verified=verified)
        except Exception as e:  # noqa: BLE001 - XLA:CPU has no ragged_all_to_all; record and go on
            for variant in ragged:
                baselines[variant] = make_row(variant, "xla", size, args, status=status_of(e),
                                              message=common.error_line(e))
        for variant in ragged:
            record(baselines[variant])
    for row in moe_rows([v for v in XLA_MOE_VARIANTS if v in wanted], mesh, arrays, routing, args, "xla", size, log):
        baselines[row["variant"]] = row
        record(row)

    for transport in args.transports:
        transport = set_transport(transport)
        nx_variants = [v for v in ("nx_padded", "nx_padded_recv", "nx_packed", "nx_ragged") if v in wanted]
        verified = None
        for variant in nx_variants:
            try:
                if variant == "nx_ragged":
                    mismatches = verify_ragged(mesh, arrays, routing, ours=True)
                    if any(mismatches):
                        raise VerificationError(f"jax_ncclx.ragged_all_to_all differs from lax.all_to_all in "
                                                f"{mismatches} elements per rank")
                elif verified is None:
                    verify_nx(mesh, arrays, routing)
                    verified = True
                row = make_row(variant, transport, size, args, time_variant(variant, mesh, arrays, routing, args),
                               verified=True)
            except VerificationError:
                raise  # wrong results: stop here
            except Exception as e:  # noqa: BLE001 - an error (out of memory, ...): record it, go on, fail at the end
                why = common.error_line(e)
                log(f"ERROR: {variant} [{transport}] at T={tokens}: {why}")
                row = make_row(variant, transport, size, args, status="error", message=why, verified=verified)
            record(row)
        for row in moe_rows([v for v in MOE_VARIANTS if v in wanted], mesh, arrays, routing, args, transport, size,
                            log):
            record(row)
    for array in arrays.values():
        array.delete()
    del arrays
    gc.collect()


def moe_rows(variants, mesh, arrays, routing, args, transport, size, log):
    """Rows for the requested moe variants, timed once the round trip is verified."""
    if not variants:
        return []
    failed = {}  # variant -> its row when its round trip failed or was wrong
    for round_trip in sorted({checked_by(v) for v in variants}):
        mine = [v for v in variants if checked_by(v) == round_trip]
        label = VARIANTS[round_trip][0]
        try:
            error = verify_moe(mesh, arrays, routing, args.experts_per_rank, round_trip)
        except Exception as e:  # noqa: BLE001 - record the failure and go on
            why = common.error_line(e)
            log(f"WARNING: {label} failed: {why}")
            failed.update({v: make_row(v, transport, size, args, status="error", message=why) for v in mine})
            continue
        if not error <= ROUND_TRIP_TOLERANCE[wire_of(round_trip)]:
            log(f"WARNING: {label} is wrong: max relative error {error:.3g}; not timed")
            failed.update({v: make_row(v, transport, size, args, status="mismatch", verified=False,
                                       message=f"max relative error {error:.3g}") for v in mine})
    inputs = dict(arrays)
    if "nx_moe_combine" in variants and "nx_moe_combine" not in failed:
        inputs["expert_rows"], inputs["handle"] = moe_handle(mesh, arrays, routing, args)
    rows = [failed[v] if v in failed else
            make_row(v, transport, size, args, time_variant(v, mesh, inputs, routing, args), verified=True)
            for v in variants]
    for array in jax.tree.leaves([inputs.get("expert_rows"), inputs.get("handle")]):
        array.delete()
    return rows


# ---- result files ------------------------------------------------------------------------------------------

MD_COLUMNS = [
    ("tokens", "T", "d"), ("label", "variant", ""), ("transport", "transport", ""), ("path", "path", ""),
    ("median_us", "median µs/op", ".1f"), ("min_us", "min µs/op", ".1f"), ("peer_gbps", "peer GB/s", ".1f"),
    ("alg_gbps", "alg GB/s", ".1f"), ("vs_xla_all_to_all", "speedup vs lax.all_to_all", ".2f"),
    ("vs_xla_ragged", "vs ragged", ".2f"), ("vs_xla_ragged_counts", "vs ragged + count a2a", ".2f"),
    ("vs_xla_moe", "vs XLA moe layer", ".2f"), ("reps", "reps", "d"), ("status", "status", ""),
]
TRACE_COLUMNS = [  # with --device-trace: (key, markdown header, progress-table header, format)
    ("dev_kernel_us", "GPU kernel µs", "kernel us", ".1f"), ("dev_gap_us", "GPU idle gap µs", "gap us", ".1f"),
    ("dev_wait_peers_us", "wait for peers µs", "peers us", ".1f"), ("dev_send_us", "send µs", "send us", ".1f"),
    ("dev_wait_data_us", "wait for data µs", "data us", ".1f"), ("dev_finish_us", "finish µs", "finish us", ".1f"),
    ("dev_ready_us", "dispatch plan µs", "plan us", ".1f"),
]


def ops_per_call(config: dict, sizes: list) -> str:
    """How many ops one jitted call ran: --unroll, or the per-T default (older results: config only)."""
    counts = sorted({s.get("unroll", config["unroll"]) for s in sizes} - {None}, reverse=True)
    return config["unroll"] or " or ".join(map(str, counts)) or "?"


def capacity_note(config: dict) -> str:
    factor = config.get("capacity_factor") or 0
    return f", or {factor:g} times the mean rows per peer where that is more" if factor else ""


def notes(config: dict, sizes: list) -> str:
    unroll = ops_per_call(config, sizes)
    lines = [
        f"MoE token shuffle on one mesh axis of {config['num_devices']} devices: T tokens per rank, hidden "
        f"{config['hidden']} {config['dtype']}, top-{config['top_k']} over "
        f"{config['num_devices'] * config['experts_per_rank']} experts ({config['experts_per_rank']} per rank, "
        f"send_counts [N, {config['experts_per_rank']}]), random routing (seed {config['seed']}). C = the most "
        "rows any rank sends any peer, so nothing is dropped" + capacity_note(config) + ".",
        "",
        f"- **µs/op**: one jitted call runs {unroll} dependent ops (see *ops/call* below) and a timed sample "
        "dispatches "
        f"{config.get('pipeline', 1)} calls back to back before waiting once (fewer for slow variants, see the "
        "JSON's `pipeline`); time per sample / (calls · ops/call), "
        f"median and min over `reps` samples (at most {config['iters']}, fewer once a variant has spent "
        f"{config['max_seconds']} s). Chaining: jax_ncclx and ragged_all_to_all take their next send counts from "
        "one element of the op's output (+ 0, one tiny integer kernel per op, included in their time), read "
        "behind an optimization barrier so that XLA computes the whole output; *chained by recv_counts*: the "
        "op's recv_counts are the next op's send counts (no extra kernel; each op moves the routing's bytes "
        "between ranks in all, each rank's share alternating with the transposed routing); "
        "`lax.all_to_all` takes its output as its next input (no extra kernel); the moe round trip takes its "
        "combined tokens as the next tokens and routes again from expert ids tied to them; moe dispatch alone "
        "ties its next expert ids to its rows (+ 0) and passes its tokens through a barrier with them (so an 8-bit "
        "wire quantizes them in every op), and moe combine alone reuses one dispatch's handle and ties "
        "the handle's next gather indices to its output (+ 0), so each includes its own routing and regrouping "
        "work.",
        "- **payload** = T·k·H·bytes per rank (every routed row, its own included). **peer GB/s** = bytes each "
        "rank sends to other ranks (mean over ranks) / median time. **alg GB/s** = payload / median time. The "
        "moe round trip moves the payload twice (dispatch and combine) and counts it twice. moe dispatch sends "
        "each token once to each rank that owns one of its experts (top-8 of 32 experts: about 3.7 rows per "
        "token on 4 ranks, 2 on 2, not 8) with k int32 tags and k float32 router weights, so its GB/s count the "
        "rows the pairs stand for (effective rates). combine, given the weights by dispatch, sums each token's "
        "pairs on the expert side and sends one row per token and rank back (effective rates too); *weights at "
        "combine* gives them to combine instead, which sends one row per pair back.",
        "- **speedup** = XLA median / jax_ncclx median (> 1: jax_ncclx is faster). *vs XLA moe layer*: a moe round "
        "trip against the same round trip written with XLA's own ops (`benchmarks/xla_moe.py`: pairs sorted by "
        "expert, gathered into a padded [N·C, H] buffer, `lax.all_to_all` with each slot's local expert, sorted by "
        "local expert; unsorted, `lax.all_to_all` back, weighted sum in float32: one row per pair each way, "
        "padding included), moe dispatch against that layer's dispatch.",
        "- **fp8 wire** rows: `moe.dispatch(wire_dtype=float8_e4m3fn)`, each row travels as H + 4·H/128 bytes "
        "(0.52× bf16) and is dequantized on arrival; their GB/s columns still count bf16 bytes (effective rates). "
        "The round trip is checked before timing: within 5e-2 of max |token| in bf16, 8e-2 with the fp8 wire.",
        "- jax_ncclx takes the T·k rows sorted by expert and send_counts [N, K] on the device. "
        "`lax.all_to_all` gets a [N·C, H] buffer padded before timing (it moves N·C rows, padding included). "
        "`lax.ragged_all_to_all` writes into a zeroed [N·C, H] buffer per op; *host sizes*: offsets and receive "
        "sizes come from the host, *+ count a2a*: the receive sizes come from a `lax.all_to_all` of the send "
        "sizes in every op (what a layer that knows only its own counts must do). *nx ragged_all_to_all*: "
        "`jax_ncclx.ragged_all_to_all` on the very arguments of `lax.ragged_all_to_all (host sizes)`, with "
        "`max_recv_per_peer=C` (an all_to_all of the slices' sizes and output offsets, then one exchange that "
        "reads the slices in place and writes every row at its offset in the zeroed buffer).",
        *([f"- **One process per GPU** ({config['processes']} processes through jax.distributed, every GPU "
           "visible to each): every measurement is exactly `iters` samples of `pipeline` calls in every process "
           "(no cut for slow variants); the medians are process 0's, the JSON's `median_us_by_process` has every "
           "process's."] if config.get("processes") else []),
        "",
        "| T | rows/rank | C | payload MB/rank | to peers MB/rank | padded buffer MB/rank | ops/call |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in sizes:
        lines.append(f"| {s['tokens']} | {s['rows_per_rank']} | {s['capacity']} | {s['payload_bytes'] / 1e6:.2f} | "
                     f"{s['peer_bytes'] / 1e6:.2f} | {s['padded_bytes'] / 1e6:.2f} | "
                     f"{s.get('unroll', config['unroll'])} |")
    return "\n".join(lines)


def plotter(meta, config, sizes):
    def plot(plt, rows):
        figure, (latency, bandwidth) = plt.subplots(1, 2, figsize=(14, 5.5))
        colors = {variant: f"C{i}" for i, variant in enumerate(VARIANTS)}
        transports = sorted({row["transport"] for row in rows if row["transport"] != "xla"})
        styles = {t: style for t, style in zip(transports, ("-", ":", "-.", (0, (5, 1))))}
        # On one device nothing goes to a peer: the right panel then shows the payload's rate instead.
        rate = "peer_gbps" if any(row.get("peer_gbps") for row in rows) else "alg_gbps"
        series = {}
        for row in rows:
            if row["status"] == "ok":
                series.setdefault((row["variant"], row["label"], row["transport"]), []).append(
                    (row["tokens"], row["median_us"], row[rate]))
        for (variant, label, transport), points in sorted(series.items()):
            points.sort()
            kwargs = dict(color=colors.get(variant), linestyle=styles.get(transport, "--"), marker="o",
                          markersize=4, label=label + ("" if transport == "xla" else f" [{transport}]"))
            tokens = [p[0] for p in points]
            latency.plot(tokens, [p[1] for p in points], **kwargs)
            bandwidth.plot(tokens, [p[2] for p in points], **kwargs)
        latency.set_xscale("log", base=2)
        latency.set_yscale("log")
        latency.set_ylabel("µs per op (median)")
        bandwidth.set_xscale("log", base=2)
        if rate == "peer_gbps":
            bandwidth.set_ylabel("GB/s to peers per rank (median)")
        else:  # lax.all_to_all moves nothing on one device: its rate is off the scale of the others
            bandwidth.set_ylabel("payload GB/s per rank (median; one device)")
            bandwidth.set_yscale("log")
        for axes in (latency, bandwidth):
            axes.set_xlabel("tokens per rank")
            axes.grid(True, which="both", alpha=0.3)
        latency.legend(fontsize=8)
        processes = f" ({config['processes']} processes)" if config.get("processes") else ""
        figure.suptitle(f"MoE token shuffle, {meta.get('num_devices')} × {meta.get('device_kind')}{processes}: hidden "
                        f"{config['hidden']} {config['dtype']}, top-{config['top_k']} of "
                        f"{meta.get('num_devices', 0) * config['experts_per_rank']} experts, "
                        f"{ops_per_call(config, sizes)} dependent ops per call")
        return figure
    return plot


def write(args, meta, config, rows, sizes, log, **extra):
    return common.write_results(
        args.name, rows, meta, plotter(meta, config, sizes), out_dir=args.out,
        columns=MD_COLUMNS + ([(key, header, fmt) for key, header, _, fmt in TRACE_COLUMNS]
                              if config.get("device_trace") else []),
        title="all_to_allv_dynamic vs XLA: MoE token shuffle", notes=notes(config, sizes),
        extra={"config": config, "sizes": sizes, **extra}, log=log,
        replot_hint=f"python benchmarks/all_to_allv.py --from-json {Path(args.out) / (args.name + '.json')}")


def replot(args, log):
    document = json.loads(args.from_json.read_text())
    extra = {k: v for k, v in document.items() if k not in ("name", "meta", "config", "sizes", "rows")}
    write(args, document["meta"], document["config"], document["rows"], document["sizes"], log, **extra)


def main(argv=None):
    parser, args = parse_args(argv)
    if (status := common.run_or_join(args, argv)) is not None:
        return status
    log = common.Progress()
    if args.from_json:
        replot(args, log)
        return 0
    devices, mesh, meta, config = common.start(parser, args, AXIS, min_gpus=1,
                                               skip=("sweep_range", "process_id", "coordinator_port"))
    writer = jax.process_index() == 0
    args.num_devices = n = config["num_devices"] = len(devices)
    if n == 1:
        log.warn("one device: no row crosses a link, so the times are the routing, copies and launches alone")
    if args.top_k > n * args.experts_per_rank:
        parser.error(f"--top-k {args.top_k} is more than the {n * args.experts_per_rank} experts")
    bad = [t for t in args.transports if t != "default" and t not in nx_config.TRANSPORTS]
    if bad:
        parser.error(f"--transports {bad}: jax_ncclx accepts {', '.join(nx_config.TRANSPORTS)} (or default)")
    log(f"{n} × {devices[0].device_kind} ({devices[0].platform}), jax {jax.__version__}, NCCL "
        f"{meta['nccl_version']}, commit {(meta['git'] or {}).get('commit', '?')[:12]}")
    log(f"T = {args.tokens}, hidden {args.hidden} {args.dtype}, top-{args.top_k} of {n * args.experts_per_rank} "
        f"experts, unroll {args.unroll or 'by size'}, transports {args.transports}, variants {args.variants}")
    for var in ("NCCL_NVLS_ENABLE", "NCCL_NVLINK_MULTICAST_ENABLE"):
        if os.environ.get(var) != "0":
            log.warn(f"{var}={os.environ.get(var)!r}: NVLink multicast must stay off on the shared machines")

    if args.device_trace:
        os.environ["JAX_NCCLX_TRACE"] = "device"
    table = common.TablePrinter(TABLE + [(key, short, 9, fmt) for key, _, short, fmt in TRACE_COLUMNS]
                                if args.device_trace else TABLE)
    rows, sizes = [], []
    original_transport = os.environ.get("JAX_NCCLX_TRANSPORT")

    def measure():
        try:
            for tokens in args.tokens:
                run_size(tokens, mesh, args, log, table, rows, sizes)
        finally:
            set_transport(original_transport or "default")
        meta["elapsed_s"] = round(log.elapsed(), 1)
        meta["jax_ncclx_state"] = {"memory": nx.memory_stats()}  # process 0's communicators with --processes

    common.run_then_write(measure, lambda **aborted: write(args, meta, config, rows, sizes, log, **aborted), log,
                          writer=writer)
    log(f"done in {meta['elapsed_s']} s")
    failed = [f"{r['variant']} [{r['transport']}] T={r['tokens']}" for r in rows
              if r["status"] == "error" and r["variant"] in ("nx_padded", "nx_packed", "nx_ragged")]
    if failed:
        raise RunError(f"jax_ncclx raised errors in {len(failed)} measurement(s): {', '.join(failed)}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (VerificationError, RunError) as e:
        sys.exit(f"FAILED: {e}")
