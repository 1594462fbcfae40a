"""moe.dispatch's forward pass as one op: the routing, the exchange and the placement of the received rows in
dispatch's expert-major layout, with every array of the ``DispatchHandle``.

``dispatch_rows`` takes (shapes: N members, E experts, E_local = E / N, C capacity, T tokens, k choices,
R = min(C, T), S = send rows, ``moe_routing.num_send_rows``):

- tokens ``[T, H]`` any float dtype;
- expert_ids int32 ``[T, k]``;
- weights float32 ``[T, k]``, or None;

and returns :class:`Dispatched`: expert_rows ``[N * C, H]`` (tokens' dtype), group_sizes ``[E_local]`` and the
handle's arrays, as ``moe_routing.plan_sends`` and ``moe_routing.place_received`` specify them.

On CUDA it is one NVLink kernel (``ncclx_moe_dispatch_nvlink``, xla_ffi/ops/moe/moe_dispatch.h) where the
kernel can run: the communicator reaches every member through NVLink; rows are a multiple of 16 bytes, and on
an 8-bit wire (which the kernel quantizes as it sends and dequantizes as it places, with the chain's
arithmetic) tokens are float32, bfloat16 or float16 with H a multiple of 512; top-k is at most
``MOE_DISPATCH_MAX_TOP_K`` (32), T * k at most ``MOE_DISPATCH_MAX_PAIRS`` (2048) and N * T at most
``MOE_DISPATCH_MAX_MEMBER_TOKENS`` (2048), the plan the kernel keeps in each block's shared memory; and a
member's R rows on the wire take at most ``KERNEL_MAX_MEMBER_BYTES`` (4 MiB). Elsewhere, on the
CPU and on NCCL, it is the exchange chain: ``plan_sends``, one ``all_to_allv_dynamic``, ``place_received`` and
``take_rows``, with ``encode_rows`` first on an 8-bit wire. Both compute the same values; which one a call site
takes is logged at debug level. Its timeout is all_to_allv_dynamic's.

Sharding model: every operand varies over the axis, and so does every result. Batching: the exchange chain,
vmapped. No AD rules: ``jax_ncclx.moe.dispatch``'s custom VJP differentiates it.
"""

import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ncclx._src import contract
from jax_ncclx._src import lib
from jax_ncclx._src import lowering
from jax_ncclx._src import nvlink
from jax_ncclx._src import primitive
from jax_ncclx._src.ops import moe_routing
from jax_ncclx._src.ops.all_to_allv_dynamic import all_to_allv_dynamic
from jax_ncclx._src.ops.take_rows import encode_misfit
from jax_ncclx._src.ops.take_rows import encode_rows
from jax_ncclx._src.ops.take_rows import take_rows
from jax_ncclx._src.ops.take_rows import wire_misfit

logger = logging.getLogger("jax_ncclx")

SCALE_BLOCK = contract.MOE_WIRE_BLOCK  # values per scale on an 8-bit wire (the whole row when H is not a multiple)
# The most bytes of wire rows one member's share of the kernel's slots may hold (R rows): decode sizes, where the
# kernel's symmetric-memory slots stay small. With few members it binds before the plan's shared-memory limits.
KERNEL_MAX_MEMBER_BYTES = 4 << 20


class Dispatched(NamedTuple):
    """dispatch's forward results (int32 but for expert_rows and recv_weights); the fields after the first two
    are the ``DispatchHandle``'s arrays of the same names."""

    expert_rows: jax.Array      # [N * C, H] tokens' dtype, expert-major, zero past the data
    group_sizes: jax.Array      # [E_local]
    order: jax.Array            # [T * k]
    send_counts: jax.Array      # [N, E_local]
    recv_counts: jax.Array      # [N, E_local]
    to_expert_major: jax.Array  # [N * C]
    to_source_major: jax.Array  # [N * C]
    return_slot: jax.Array      # [T * k]
    dropped: jax.Array          # [N]
    send_token: jax.Array       # [S]
    token_counts: jax.Array     # [N]
    return_row: jax.Array       # [T, N]
    recv_tokens: jax.Array      # [N]
    expand_rows: jax.Array      # [N * C]
    pair_entry: jax.Array       # [N * C]
    row_pairs: jax.Array        # [N * R, k]
    send_back_rows: jax.Array   # [N * R]
    recv_weights: jax.Array     # float32 [N * R, k], [N * R, 0] without weights


def dispatch_rows(tokens, expert_ids, weights, *, num_experts: int, axis_name, capacity: int,
                  wire_dtype=None) -> Dispatched:
    """:class:`Dispatched` for this member (shapes in the module docstring); call it inside ``jax.shard_map``
    over ``axis_name``. ``wire_dtype``: None, or an 8-bit float dtype the rows travel in."""
    operands = (tokens, expert_ids) + (() if weights is None else (weights.astype(jnp.float32),))
    outs = moe_dispatch_p.bind(*operands, axis_name=axis_name, num_experts=int(num_experts),
                               num_members=int(jax.lax.axis_size(axis_name)), capacity=int(capacity),
                               wire_dtype=wire_dtype)
    return Dispatched(*outs)


def exchange(rows, send_counts, axis_name, capacity, send_rows=None, suffix=None):
    """all_to_allv_dynamic into the padded layout, as ``[N * C, H (+ G)]``: the NVLink kernel writes it without
    first sharing every member's counts, which the packed layout needs (6-7 µs less per exchange on 4×H200
    at T = 16 and 128). ``send_rows``: send ``rows[send_rows]``, gathered by the exchange's kernel (no copy of
    its own); ``suffix``: ``[S, G]`` appended to the send rows. Returns (rows, recv_counts, dropped)."""
    received, recv_counts, dropped = all_to_allv_dynamic(rows, send_counts, axis_name, max_recv_per_peer=capacity,
                                                         layout="padded", send_rows=send_rows, suffix=suffix)
    num_members, rows_per_member, columns = received.shape
    return received.reshape(num_members * rows_per_member, columns), recv_counts, dropped


# ---- the exchange chain: the same computation in other jax_ncclx ops ---------------------------------------

def _exchange_chain(tokens, expert_ids, *weights, axis_name, num_experts, num_members, capacity, wire_dtype):
    weights = weights[0] if weights else None
    top_k = expert_ids.shape[1]
    plan = moe_routing.plan_sends(expert_ids, weights, num_experts=num_experts, num_members=num_members,
                                  capacity=capacity)
    # Quantized before the copy into send rows: T rows to encode, not S.
    source = tokens if wire_dtype is None else _encoded(tokens, wire_dtype)
    width = source.shape[1]
    # The exchange reads each token row and appends its tags (and weights) as it sends them: no send-side copy.
    # A member gets each token at most once: R = min(C, T) rows per source, so the padded layout's zero rows
    # after the data (written over NVLink too) stay few.
    received, recv_tokens, _ = exchange(source, plan.token_counts, axis_name, min(capacity, tokens.shape[0]),
                                        send_rows=plan.send_token, suffix=_as_columns(plan.send_suffix, source.dtype))
    placed = moe_routing.place_received(received, recv_tokens, local_experts=num_experts // num_members,
                                        capacity=capacity, top_k=top_k, suffix_offset=width * source.dtype.itemsize,
                                        with_weights=weights is not None)
    # Walked by received row (row_pairs is expand_rows' inverse): each is read once, not once per choice. On an
    # 8-bit wire each received row is dequantized as it is read, or (rows the copy cannot decode) before, N * R
    # rows to decode rather than N * C.
    hidden = tokens.shape[1]
    if wire_dtype is not None and _decodes_as_it_expands(tokens.dtype, hidden, received.shape[1]):
        expert_rows = take_rows(received, placed.expand_rows, width=hidden, sources=placed.row_pairs,
                                wire_dtype=wire_dtype, dtype=tokens.dtype)
    else:
        if wire_dtype is not None:
            received, width = _decode(received[:, :width], hidden, wire_dtype, tokens.dtype), hidden
        expert_rows = take_rows(received, placed.expand_rows, width=width, sources=placed.row_pairs)
    return list(Dispatched(
        expert_rows=expert_rows, group_sizes=placed.group_sizes, order=plan.order, send_counts=plan.send_counts,
        recv_counts=placed.recv_counts, to_expert_major=placed.to_expert_major,
        to_source_major=placed.to_source_major, return_slot=plan.return_slot, dropped=plan.dropped,
        send_token=plan.send_token, token_counts=plan.token_counts, return_row=plan.return_row,
        recv_tokens=recv_tokens, expand_rows=placed.expand_rows, pair_entry=placed.pair_entry,
        row_pairs=placed.row_pairs, send_back_rows=placed.send_back_rows, recv_weights=placed.recv_weights))


def _decodes_as_it_expands(dtype, hidden, received_bytes):
    """Whether the expansion can dequantize the received rows itself (take_rows' wire_dtype); else they are
    decoded before it (logged)."""
    misfit = wire_misfit(received_bytes, hidden, dtype)
    if misfit is not None:
        logger.debug("jax_ncclx: moe.dispatch decodes its received rows before the expansion: %s", misfit)
    return misfit is None


def _encoded(tokens, wire_dtype):
    """``_encode``'s rows, by encode_rows (one pass) where it takes the tokens, else by XLA (logged)."""
    misfit = encode_misfit(tokens.dtype, tokens.shape[1])
    if misfit is None:
        return encode_rows(tokens, wire_dtype)
    logger.debug("jax_ncclx: moe.dispatch quantizes its tokens in XLA: %s", misfit)
    return _encode(tokens, wire_dtype)


def _scale_block(hidden):
    return SCALE_BLOCK if hidden % SCALE_BLOCK == 0 else hidden


def _encode(rows, wire_dtype):
    """``[R, H]`` float rows -> ``[R, H + 4 * H / block]`` uint8: H values in wire_dtype, then the float32 scales.

    Each block's scale maps its largest magnitude to wire_dtype's largest finite value; an all-zero block
    gets scale 0 (and decodes to zeros, like the exchange's padding rows).
    """
    num_rows, hidden = rows.shape
    block = _scale_block(hidden)
    values = rows.astype(jnp.float32).reshape(num_rows, hidden // block, block)
    # Times the float32 reciprocal, as the NVLink kernel does: a division by a constant may be rewritten so.
    scale = jnp.max(jnp.abs(values), axis=2) * np.float32(1.0 / float(jnp.finfo(wire_dtype).max))
    quantized = (values / jnp.where(scale > 0, scale, 1.0)[..., None]).astype(wire_dtype)
    return jnp.concatenate([jax.lax.bitcast_convert_type(quantized.reshape(num_rows, hidden), jnp.uint8),
                            jax.lax.bitcast_convert_type(scale, jnp.uint8).reshape(num_rows, -1)], axis=1)


def _decode(wire_rows, hidden, wire_dtype, dtype):
    """The inverse of ``_encode``: ``[R, H + 4 * H / block]`` uint8 -> ``[R, H]`` dtype."""
    num_rows = wire_rows.shape[0]
    block = _scale_block(hidden)
    values = jax.lax.bitcast_convert_type(wire_rows[:, :hidden], wire_dtype).astype(jnp.float32)
    scale = jax.lax.bitcast_convert_type(wire_rows[:, hidden:].reshape(num_rows, -1, 4), jnp.float32)
    return (values.reshape(num_rows, -1, block) * scale[..., None]).reshape(num_rows, hidden).astype(dtype)


def _as_columns(words, dtype):
    """int32 ``[S, w]`` -> ``[S, w * 4 / itemsize]`` dtype with the same bits (w even for 8-byte dtypes: the
    suffixes are multiples of 4 words)."""
    if np.dtype(dtype).itemsize == 8:
        words = words.reshape(words.shape[0], -1, 2)
    return jax.lax.bitcast_convert_type(words, dtype).reshape(words.shape[0], -1)


# ---- the primitive -----------------------------------------------------------------------------------------

moe_dispatch_p = primitive.make_collective("moe_dispatch", multiple_results=True)


def _moe_dispatch_abstract_eval(tokens, expert_ids, *weights, axis_name, num_experts, num_members, capacity,
                                wire_dtype):
    (num_tokens, hidden), top_k = tokens.shape, expert_ids.shape[1]
    n, local, rows = num_members, num_experts // num_members, num_members * capacity
    received = n * min(capacity, num_tokens)
    pairs, send_rows = num_tokens * top_k, moe_routing.num_send_rows(num_tokens, top_k, n, capacity)
    shapes = Dispatched(
        expert_rows=(rows, hidden), group_sizes=(local,), order=(pairs,), send_counts=(n, local),
        recv_counts=(n, local), to_expert_major=(rows,), to_source_major=(rows,), return_slot=(pairs,),
        dropped=(n,), send_token=(send_rows,), token_counts=(n,), return_row=(num_tokens, n), recv_tokens=(n,),
        expand_rows=(rows,), pair_entry=(rows,), row_pairs=(received, top_k), send_back_rows=(received,),
        recv_weights=(received, top_k if weights else 0))
    dtypes = {"expert_rows": tokens.dtype, "recv_weights": jnp.float32}
    avals = primitive.output_avals(shapes, tokens, axis_name, expert_ids, *weights, dtypes=dtypes)
    return avals, primitive.effects(axis_name)


def _route(ctx, comm_id, size, *, num_experts, num_members, capacity, wire_dtype):
    """The NVLink kernel's route, or None (the exchange chain) where it cannot run."""
    tokens, expert_ids = ctx.avals_in[0], ctx.avals_in[1]
    (num_tokens, hidden), top_k = tokens.shape, expert_ids.shape[1]
    element_bytes = np.dtype(tokens.dtype).itemsize
    with_weights = len(ctx.avals_in) > 2
    module = lib.cuda_module()
    wire = _wire(wire_dtype)
    wire_row_bytes = module.moe_dispatch_wire_row_bytes(hidden, element_bytes, wire)
    rows_per_member = min(capacity, num_tokens)
    why = _kernel_misfit(module, tokens, top_k, size, rows_per_member, wire_dtype, wire_row_bytes)
    slots = module.moe_dispatch_slot_bytes(size, rows_per_member, top_k, wire, wire_row_bytes, with_weights)
    return nvlink.kernel_route("moe.dispatch", comm_id, why, slots)


def _kernel_misfit(module, tokens, top_k, size, rows_per_member, wire_dtype, wire_row_bytes) -> str | None:
    """Why the NVLink kernel cannot take this call (a message), or None where it can."""
    num_tokens, hidden = tokens.shape
    row_bytes = hidden * np.dtype(tokens.dtype).itemsize
    if wire_dtype is not None:  # the kernel quantizes what encode_rows takes, into rows of 16-byte multiples
        misfit = encode_misfit(tokens.dtype, hidden)
        if misfit is not None:
            return misfit
        if wire_row_bytes % 16:
            return f"wire rows of {wire_row_bytes} bytes at H = {hidden} (the kernel moves multiples of 16)"
    if row_bytes % 16:
        return f"rows of {row_bytes} bytes (the kernel moves multiples of 16)"
    if top_k > module.MOE_DISPATCH_MAX_TOP_K:
        return f"top-{top_k} (the kernel takes up to top-{module.MOE_DISPATCH_MAX_TOP_K})"
    if (num_tokens * top_k > module.MOE_DISPATCH_MAX_PAIRS
            or size * num_tokens > module.MOE_DISPATCH_MAX_MEMBER_TOKENS):
        return (f"{num_tokens} tokens of top-{top_k} on {size} members (the kernel plans up to "
                f"{module.MOE_DISPATCH_MAX_PAIRS} pairs and {module.MOE_DISPATCH_MAX_MEMBER_TOKENS} member tokens)")
    if rows_per_member * wire_row_bytes > KERNEL_MAX_MEMBER_BYTES:
        return f"{rows_per_member} rows of {wire_row_bytes} bytes per member (more than {KERNEL_MAX_MEMBER_BYTES})"
    return None


def _wire(wire_dtype):
    """The kernel's wire attribute (contract.MOE_WIRES) for a wire dtype (None: tokens' own)."""
    return contract.MOE_WIRES["none" if wire_dtype is None else np.dtype(wire_dtype).name]


moe_dispatch_p.def_effectful_abstract_eval(_moe_dispatch_abstract_eval)
lowering.register_lowerings(
    moe_dispatch_p, "ncclx_moe_dispatch",
    # Decoded as MoeDispatchAttrs (xla_ffi/ops/moe/moe_dispatch_cuda.cc); its enum travels as int32.
    lambda *, num_experts, num_members, capacity, wire_dtype: dict(dispatch=dict(
        num_experts=np.int64(num_experts), capacity=np.int64(capacity), wire=np.int32(_wire(wire_dtype)))),
    cuda_route=_route, fallback=_exchange_chain, timeout_op="all_to_allv_dynamic")
primitive.batch_by_chain(moe_dispatch_p, _exchange_chain)
