"""MoE dispatch and combine over one expert-parallel mesh axis, each one ``all_to_allv_dynamic`` call.

Expert placement: with N members on ``axis_name`` and E experts, E_local = E // N and expert e lives on
member e // E_local as its local expert e % E_local. ``dispatch`` gives every (token, choice) pair's row to
the member that owns the chosen expert and returns the received rows grouped by local expert, ready for
``jax.lax.ragged_dot``. On the wire a token crosses once per member, however many of that member's experts
it chose (DeepEP's send-once; for top-8 of 32 experts on 4 members about 3.7 rows per token instead of 8),
tagged with its pairs, and the receiver expands it into one row per pair. ``combine`` sends one row per
pair back and sums them per token with the router weights. The counts stay on the device: ``dispatch``
learns them from the exchange itself, and ``combine`` reuses them from the handle.

Capacity: one member takes at most ``capacity`` pairs from any one member. The pairs for one destination
are sorted by expert and it takes the first ``capacity`` of them, so drops hit the highest-numbered experts
(and, within one, the last tokens) first. A dropped pair contributes zero to ``combine``, and
``handle.dropped`` counts the drops per destination.

Wire precision: ``dispatch(..., wire_dtype=jnp.float8_e4m3fn)`` quantizes each row on the way (blocks of 128
elements, one float32 scale each, as DeepSeek-V3's FP8 activations), so the exchange moves about half the
bytes of bf16; the receiver dequantizes. ``combine`` and every backward pass send full precision.

AD: each function's backward pass is the other's exchange. The cotangent of ``dispatch``'s rows goes back to
the tokens the way ``combine`` sends rows (unit weights, summed over the k choices). The cotangent of
``combine``'s output goes out to the experts the way ``dispatch`` sends rows, scaled by the weights. Neither
backward pass exchanges counts again. They are ``jax.custom_vjp`` rules, so there is no forward mode
(``jax.jvp``, ``jax.jacfwd``).
"""

import dataclasses
import functools
from collections.abc import Hashable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ncclx._src import compat
from jax_ncclx._src import primitive
from jax_ncclx._src.ops.all_to_allv_dynamic import all_to_allv_dynamic


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DispatchHandle:
    """The routing of one ``dispatch`` call, for ``combine`` and both backward passes.

    A pytree whose leaves are int32 device arrays (N members, E_local local experts, C = capacity, T tokens,
    k choices). ``axis_name``, ``capacity`` and ``top_k`` are static aux data.

    Attributes:
      order: ``[T * k]`` the (token, choice) pairs (flattened row-major) sorted by expert, the send order.
      send_counts: ``[N, E_local]`` pairs this member asked to send to each local expert of each member.
      recv_counts: ``[N, E_local]`` rows each source delivered here, per local expert.
      to_expert_major: ``[N * C]`` gather indices from the received rows (the exchange's padded layout:
        source i's rows from row i * C) to dispatch's expert-major rows. Rows past the data get ``N * C``,
        out of bounds, so a gather with ``mode="fill"`` gives zeros there.
      to_source_major: ``[N * C]`` the expert-major row of each row ``combine`` sends back (its exchange's
        ``send_rows``): grouped by destination member, packed from row 0 (``N * C`` past the data, as above).
      return_slot: ``[T * k]`` where each pair's expert output lands among the rows that ``combine``
        receives back (member p's from row p * C). ``N * C`` marks a pair that was dropped or that chose no
        expert.
      dropped: ``[N]`` pairs this member had for each member that did not fit in ``capacity``.
    """

    order: jax.Array
    send_counts: jax.Array
    recv_counts: jax.Array
    to_expert_major: jax.Array
    to_source_major: jax.Array
    return_slot: jax.Array
    dropped: jax.Array
    axis_name: Hashable = dataclasses.field(metadata=dict(static=True))
    capacity: int = dataclasses.field(metadata=dict(static=True))
    top_k: int = dataclasses.field(metadata=dict(static=True))


WIRE_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
SCALE_BLOCK = 128  # elements per scale on an 8-bit wire (the whole row when H is not a multiple of it)


def dispatch(tokens, expert_ids, *, num_experts: int, axis_name, capacity: int, wire_dtype=None):
    """Sends every (token, choice) pair's row to the member that owns its expert.

    Call it inside ``jax.shard_map`` over ``axis_name``. It runs under ``jax.jit``, ``jax.vmap`` (over a
    non-mesh axis, still one exchange) and ``jax.grad`` (in ``tokens``).

    Args:
      tokens: ``[T, H]`` any float dtype, this member's tokens.
      expert_ids: ``[T, k]`` integers, the experts each token chose (top-k). An id outside ``[0, num_experts)``
        (e.g. -1) chooses no expert. That pair is not sent, is not counted as dropped, and contributes zero.
      num_experts: E, the total number of experts, a multiple of the axis size N (static).
      axis_name: the expert-parallel mesh axis (static).
      capacity: C >= 1, the most (token, choice) pairs this member gives any one member, and takes from any
        one member (static). Pairs past it are dropped (see ``DispatchHandle.dropped``).
      wire_dtype: None (default): rows travel in tokens' dtype. ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``:
        each row travels as 8-bit floats, scaled per block of 128 elements (the whole row when H is not a
        multiple of 128) by a float32 scale that travels with it: H + 4 * H / 128 bytes per row instead of
        2 * H for bf16. The receiver dequantizes, so expert_rows keep tokens' dtype. Lossy: each value is
        rounded to 3 mantissa bits (e4m3; e5m2: 2), i.e. within 2^-4 (2^-3) of itself, and values below about
        2^-15 (e5m2: 2^-31) of their block's largest lose more. The gradient treats the quantization as the
        identity (static).

    Returns:
      ``(expert_rows, group_sizes, handle)``:
        expert_rows: ``[N * C, H]`` tokens' dtype, the received rows in expert-major order. Local expert 0's
          rows come first (source 0's, then source 1's, ...), then local expert 1's, and so on. The rest of
          the rows are zero.
        group_sizes: int32 ``[E_local]``, the number of rows for each local expert. Pass it with
          ``expert_rows`` to ``jax.lax.ragged_dot(expert_rows, w, group_sizes)``, where w is
          ``[E_local, H, H']``.
        handle: a ``DispatchHandle`` for ``combine``. ``handle.dropped`` is int32 ``[N]``.

    Raises:
      NameError: ``axis_name`` is not bound by an enclosing ``jax.shard_map``.
      TypeError / ValueError: a bad argument (the message names it).
    """
    axis_name = _check_bound_axis(axis_name, "dispatch")
    num_members = jax.lax.axis_size(axis_name)
    _check_static_int(num_experts, "num_experts", "dispatch", minimum=1)
    if num_experts % num_members:
        raise ValueError(f"jax_ncclx.moe.dispatch: num_experts ({num_experts}) must be a multiple of the size "
                         f"of axis {axis_name!r} ({num_members})")
    _check_static_int(capacity, "capacity", "dispatch", minimum=1)
    _check_matrix(tokens, "tokens", "dispatch", jnp.floating)
    _check_matrix(expert_ids, "expert_ids", "dispatch", jnp.integer)
    if jnp.shape(expert_ids)[0] != jnp.shape(tokens)[0] or jnp.shape(expert_ids)[1] < 1:
        raise ValueError(f"jax_ncclx.moe.dispatch: expert_ids must be [T, k] with T = {jnp.shape(tokens)[0]} "
                         f"(the rows of tokens) and k >= 1, got shape {jnp.shape(expert_ids)}")
    if wire_dtype is not None:
        if not any(np.dtype(wire_dtype) == np.dtype(d) for d in WIRE_DTYPES):
            raise ValueError(f"jax_ncclx.moe.dispatch: wire_dtype must be None, float8_e4m3fn or float8_e5m2, "
                             f"got {wire_dtype!r}")
        wire_dtype = np.dtype(wire_dtype)
    tokens, expert_ids = _vary_together(axis_name, (tokens, jnp.asarray(expert_ids, jnp.int32)))
    return _dispatch(tokens, expert_ids, int(num_experts), axis_name, int(capacity), wire_dtype)


def combine(expert_out, handle: DispatchHandle, weights):
    """Sends expert outputs back to their tokens and sums each token's outputs with its router weights.

    ``out[t] = sum_j weights[t, j] * row(t, j)``, where row(t, j) is the row of ``expert_out`` that came
    from pair (t, j). A pair that was dropped or that chose no expert contributes zero. Call it inside the
    same ``jax.shard_map`` as the ``dispatch`` that made ``handle``. It is differentiable in ``expert_out``
    and ``weights``.

    Args:
      expert_out: ``[N * C, H']`` any float dtype, in dispatch's expert-major layout. H' may differ from H.
        Rows past ``sum(group_sizes)`` are ignored.
      handle: the ``DispatchHandle`` from ``dispatch``.
      weights: ``[T, k]`` any float dtype, the router weight of each (token, choice) pair.

    Returns:
      ``[T, H']`` with expert_out's dtype. The sum is accumulated in the promoted dtype of expert_out and
      weights.

    Raises:
      NameError: the handle's axis is not bound by an enclosing ``jax.shard_map``.
      TypeError / ValueError: a bad argument (the message names it).
    """
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"jax_ncclx.moe.combine: handle must be the DispatchHandle from dispatch, got "
                        f"{type(handle).__name__}")
    rows = jax.lax.axis_size(_check_bound_axis(handle.axis_name, "combine")) * handle.capacity
    _check_matrix(expert_out, "expert_out", "combine", jnp.floating)
    if jnp.shape(expert_out)[0] != rows:
        raise ValueError(f"jax_ncclx.moe.combine: expert_out must be [N * capacity, H'] = [{rows}, H'] like "
                         f"dispatch's expert_rows, got shape {jnp.shape(expert_out)}")
    _check_matrix(weights, "weights", "combine", jnp.floating)
    pairs_shape = (handle.order.shape[0] // handle.top_k, handle.top_k)
    if jnp.shape(weights) != pairs_shape:
        raise ValueError(f"jax_ncclx.moe.combine: weights must be [T, k] = {list(pairs_shape)} like dispatch's "
                         f"expert_ids, got shape {jnp.shape(weights)}")
    expert_out, weights = _vary_together(handle.axis_name, (expert_out, weights), jax.tree.leaves(handle))
    return _combine(expert_out, handle, weights)


# ---- dispatch ----------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _dispatch(tokens, expert_ids, num_experts, axis_name, capacity, wire_dtype):
    num_members = jax.lax.axis_size(axis_name)
    top_k = expert_ids.shape[1]
    # Pairs that choose no expert get the key num_experts: they sort last and no count includes them.
    chosen = (expert_ids >= 0) & (expert_ids < num_experts)
    sort_key = jnp.where(chosen, expert_ids, num_experts).reshape(-1)
    order = jnp.argsort(sort_key, stable=True).astype(jnp.int32)
    # A one-hot sum, not jnp.bincount: its scatter-add piles atomics on a few counters (slow on GPUs).
    send_counts = (sort_key[:, None] == jnp.arange(num_experts)).sum(axis=0)
    send_counts = send_counts.reshape(num_members, -1).astype(jnp.int32)
    plan = _plan_sends(order, sort_key[order], send_counts, capacity, top_k)
    rows = _gather_rows(tokens, plan.send_token)
    if wire_dtype is not None:
        rows = _encode(rows, wire_dtype)
    # A member gets each token at most once: min(C, T) rows per source, so the padded layout's zero rows
    # after the data (written over NVLink too) stay few.
    received, recv_tokens, _ = _exchange(_attach_tags(rows, plan.send_tags), plan.token_counts, axis_name,
                                         min(capacity, tokens.shape[0]))
    recv_counts, to_expert_major = _place_received(_detach_tags(received, rows.shape[1], top_k), recv_tokens,
                                                   send_counts.shape[1], capacity)
    expert_rows = _gather_rows(received, to_expert_major, width=rows.shape[1])
    if wire_dtype is not None:
        expert_rows = _decode(expert_rows, tokens.shape[1], wire_dtype, tokens.dtype)
    handle = _make_handle(order, send_counts, recv_counts, plan, axis_name, capacity, top_k)
    return expert_rows, recv_counts.sum(axis=0), handle


def _dispatch_fwd(tokens, expert_ids, num_experts, axis_name, capacity, wire_dtype):
    outputs = _dispatch(tokens, expert_ids, num_experts, axis_name, capacity, wire_dtype)
    return outputs, outputs[2]


def _dispatch_bwd(num_experts, axis_name, capacity, wire_dtype, handle, cotangents):
    ct_rows = cotangents[0]
    per_pair = _send_back(ct_rows, handle)
    return per_pair.reshape(-1, handle.top_k, ct_rows.shape[1]).sum(axis=1), None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


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
    scale = jnp.max(jnp.abs(values), axis=2) / float(jnp.finfo(wire_dtype).max)
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


class _SendPlan(NamedTuple):
    """What this member sends in ``dispatch`` (S rows, N members, T tokens, k choices), all int32."""

    send_token: jax.Array    # [S] the token of each row: grouped by member, ascending within one; T past the data
    send_tags: jax.Array     # [S, k] the rows' tags (see _plan_sends)
    token_counts: jax.Array  # [N] rows for each member
    return_slot: jax.Array   # [T * k] where each pair's output comes back in combine; N * C if not delivered
    dropped: jax.Array       # [N] pairs for each member past the capacity


def _plan_sends(order, sorted_experts, send_counts, capacity, top_k):
    """Sends each token once to each member that takes at least one of its pairs (DeepEP's send-once).

    A token that chose two experts of one member crosses the wire once, not twice: for top-8 of 32 experts on
    4 members about 3.7 rows per token instead of 8. Each member takes the first C of the pairs for it,
    sorted by expert. The rows' tags (k int32 each) hold, read in row order, the list of the pairs that the
    member took, in that order: ``row * E_local + local expert``, row counted from the member's first row,
    then -1. A token has at most k pairs per member, so the list fits, and the receiver places the pairs in the
    expert-major layout with gathers alone (``_place_received``).

    Args: order, sorted_experts: ``[T * k]`` the pairs sorted by expert, and their experts (E for no expert).
    Returns: a ``_SendPlan`` with S = min(T * min(k, N), N * C) rows: a member takes at most C pairs, and
      at most T rows (one per token).
    """
    num_members, local_experts = send_counts.shape
    num_pairs = order.shape[0]
    num_tokens = num_pairs // top_k
    sent = send_counts.sum(axis=1)
    taken = jnp.minimum(sent, capacity)
    first_sent = jnp.cumsum(sent) - sent  # where member p's pairs start in the sorted order
    position = jnp.arange(num_pairs, dtype=jnp.int32)
    member = sorted_experts // local_experts  # num_members for pairs that chose no expert
    chose_expert = member < num_members
    member = jnp.minimum(member, num_members - 1)
    offset = position - first_sent[member]
    delivered = chose_expert & (offset < capacity)
    # Back to pair order with one scatter, whose output XLA keeps in memory (a gather through the inverse
    # permutation would be fused into combine's row gather and recomputed for every element of every row).
    in_pair_order = jnp.zeros((num_pairs, 2), jnp.int32).at[order].set(jnp.stack(
        [jnp.where(delivered, member, num_members), jnp.where(delivered, member * capacity + offset,
                                                              num_members * capacity)], axis=1))
    pair_member = in_pair_order[:, 0].reshape(num_tokens, top_k)
    return_slot = in_pair_order[:, 1]

    members = jnp.arange(num_members, dtype=jnp.int32)
    sends = (pair_member[:, :, None] == members).any(axis=1).T  # [N, T]: token t goes to member p
    flat = sends.reshape(-1)
    row_of = (jnp.cumsum(flat) - flat).reshape(num_members, num_tokens)  # its row, if it goes
    token_counts = sends.sum(axis=1).astype(jnp.int32)
    first_row = jnp.cumsum(token_counts) - token_counts
    num_rows = min(num_tokens * min(top_k, num_members), num_members * capacity)
    send_token = jnp.full(num_rows, num_tokens, jnp.int32).at[jnp.where(sends, row_of, num_rows).reshape(-1)].set(
        jnp.tile(jnp.arange(num_tokens, dtype=jnp.int32), num_members), mode="drop")

    # Tag entry first_row[p] * k + i holds member p's i-th pair, the sorted pair first_sent[p] + i.
    entry = jnp.arange(num_rows * top_k, dtype=jnp.int32)
    entry_member = (entry[:, None] >= first_row[None, 1:] * top_k).sum(axis=1)
    place = entry - first_row[entry_member] * top_k  # in member p's list
    pair = jnp.minimum(first_sent[entry_member] + place, num_pairs - 1)
    row = row_of[entry_member, order[pair] // top_k] - first_row[entry_member]
    tags = jnp.where(place < taken[entry_member], row * local_experts + sorted_experts[pair] % local_experts, -1)
    return _SendPlan(send_token=send_token, send_tags=tags.reshape(num_rows, top_k), token_counts=token_counts,
                     return_slot=return_slot, dropped=jnp.maximum(sent - capacity, 0).astype(jnp.int32))


def _place_received(tags, recv_tokens, local_experts, capacity):
    """Where each received pair goes in the expert-major layout (the tags are described in ``_plan_sends``).

    Args:
      tags: int32 ``[N * R, k]`` the tags of the received rows (padded layout: source i's R rows from row
        i * R).
      recv_tokens: ``[N]`` rows each source delivered.
      capacity: C, the pairs each source may deliver (the expert-major layout has N * C rows).
    Returns:
      ``(recv_counts [N, E_local], to_expert_major [N * C])``: pairs per source and local expert, and the
      received row of each expert-major row (N * R past the data).
    """
    num_members = recv_tokens.shape[0]
    num_received, top_k = tags.shape
    rows_per_source = num_received // num_members
    per_source = rows_per_source * top_k
    entries = tags.reshape(num_members, per_source)
    valid = (jnp.arange(per_source) // top_k < recv_tokens[:, None]) & (entries >= 0)
    expert = entries % local_experts
    recv_counts = (valid[:, :, None] & (expert[:, :, None] == jnp.arange(local_experts))).sum(axis=1)
    recv_counts = recv_counts.astype(jnp.int32)
    # Source i's list holds its pairs sorted by expert: those of expert e start after its earlier experts'.
    list_starts = (jnp.arange(num_members, dtype=jnp.int32)[:, None] * per_source +
                   jnp.cumsum(recv_counts, axis=1) - recv_counts)
    entry = _regroup(recv_counts, list_starts, num_members * capacity, outside=num_received * top_k)
    row = _gather_rows(tags.reshape(-1, 1), entry)[:, 0] // local_experts
    inside = (entry < num_received * top_k) & (row >= 0) & (row < rows_per_source)
    return recv_counts, jnp.where(inside, entry // per_source * rows_per_source + row, num_received)


def _attach_tags(rows, tags):
    """``[S, W]`` rows and int32 ``[S, k]`` tags -> ``[S, W + w]`` rows' dtype: the tags' bits appended,
    padded with -1 to a multiple of 16 bytes so that 16-byte aligned rows stay aligned."""
    tags = jnp.pad(tags, ((0, 0), (0, -tags.shape[1] % 4)), constant_values=-1)
    if rows.dtype.itemsize == 8:
        bits = jax.lax.bitcast_convert_type(tags.reshape(tags.shape[0], -1, 2), rows.dtype)
    else:
        bits = jax.lax.bitcast_convert_type(tags, rows.dtype)
    return jnp.concatenate([rows, bits.reshape(rows.shape[0], -1)], axis=1)


def _detach_tags(wire_rows, width, top_k):
    """The inverse of ``_attach_tags`` for the tags: ``[R, W + w]`` -> int32 ``[R, k]``."""
    bits = wire_rows[:, width:]
    itemsize = bits.dtype.itemsize
    if itemsize < 4:
        bits = bits.reshape(bits.shape[0], -1, 4 // itemsize)
    tags = jax.lax.bitcast_convert_type(bits, jnp.int32)
    return tags.reshape(tags.shape[0], -1)[:, :top_k]


def _make_handle(order, send_counts, recv_counts, plan, axis_name, capacity, top_k):
    num_members = send_counts.shape[0]
    num_rows = num_members * capacity
    # combine and the backward passes exchange one row per pair: source i's rows of expert e arrive at row
    # i * C of the padded layout, after those of its earlier experts; expert-major block (e, i) starts after
    # all earlier blocks, packed.
    padded_starts = (jnp.arange(num_members, dtype=jnp.int32)[:, None] * capacity +
                     jnp.cumsum(recv_counts, axis=1) - recv_counts)
    expert_major_starts = _exclusive_cumsum(recv_counts.T).T
    return DispatchHandle(
        order=order, send_counts=send_counts, recv_counts=recv_counts,
        to_expert_major=_regroup(recv_counts, padded_starts, num_rows),
        to_source_major=_regroup(recv_counts.T, expert_major_starts.T, num_rows),
        return_slot=plan.return_slot, dropped=plan.dropped,
        axis_name=axis_name, capacity=capacity, top_k=top_k)


def _exclusive_cumsum(sizes):
    """Row-major exclusive running sum of a 2-D array: where each block starts when the blocks are packed."""
    flat = sizes.reshape(-1)
    return (jnp.cumsum(flat) - flat).reshape(sizes.shape)


def _regroup(block_sizes, block_starts, num_rows, outside=None):
    """Gather indices that collect blocks (a, b) into blocks (b, a) packed from row 0.

    Block (a, b) is ``block_sizes[a, b]`` rows of the input from row ``block_starts[a, b]`` (both ``[A, B]``).
    Rows past the last block get ``outside`` (default ``num_rows``), out of bounds (``_gather_rows`` gives
    zeros there).
    """
    starts = block_starts.T.reshape(-1)  # in the (b, a) order
    sizes_out = block_sizes.T.reshape(-1)
    ends_out = jnp.cumsum(sizes_out)
    row = jnp.arange(num_rows, dtype=jnp.int32)
    # compare_all: one fused comparison against the A * B block ends (the experts, a few hundred at most).
    # The default binary search is a while loop, whose predicate XLA's GPU runtime reads back to the host
    # every iteration: a host round trip in every dispatch, which this module must not have.
    block = jnp.searchsorted(ends_out, row, side="right", method="compare_all")
    inside = block < sizes_out.shape[0]
    block = jnp.minimum(block, sizes_out.shape[0] - 1)
    outside = num_rows if outside is None else outside
    return jnp.where(inside, starts[block] + row - (ends_out - sizes_out)[block], outside).astype(jnp.int32)


# ---- combine -----------------------------------------------------------------------------------------------

@jax.custom_vjp
def _combine(expert_out, handle, weights):
    return _weighted_sum(_send_back(expert_out, handle), weights, expert_out.dtype)


def _combine_fwd(expert_out, handle, weights):
    returned = _send_back(expert_out, handle)
    return _weighted_sum(returned, weights, expert_out.dtype), (handle, weights, returned)


def _combine_bwd(residuals, ct_out):
    handle, weights, returned = residuals
    accumulate = jnp.promote_types(returned.dtype, weights.dtype)
    per_pair = returned.reshape(*weights.shape, -1).astype(accumulate)
    ct_out = ct_out.astype(accumulate)
    ct_rows = (ct_out[:, None, :] * weights[:, :, None].astype(accumulate)).astype(returned.dtype)
    ct_expert_out = _send_out(ct_rows.reshape(-1, ct_rows.shape[2]), handle)
    ct_weights = (ct_out[:, None, :] * per_pair).sum(axis=2).astype(weights.dtype)
    return ct_expert_out, None, ct_weights


_combine.defvjp(_combine_fwd, _combine_bwd)


def _weighted_sum(returned, weights, dtype):
    """``[T * k, H']`` rows and ``[T, k]`` weights -> ``[T, H']``.

    An elementwise product and a sum, not a dot, so float32 stays exact on GPUs (no TF32).
    """
    accumulate = jnp.promote_types(returned.dtype, weights.dtype)
    per_pair = returned.reshape(*weights.shape, -1).astype(accumulate)
    return (per_pair * weights[:, :, None].astype(accumulate)).sum(axis=1).astype(dtype)


# ---- the two exchanges, shared by the forward and backward passes -------------------------------------------

def _exchange(rows, send_counts, axis_name, capacity, send_rows=None):
    """all_to_allv_dynamic into the padded layout, as ``[N * C, H]``: the NVLink kernel writes it without
    first sharing every member's counts, which the packed layout needs (6-7 µs less per exchange on 4×H200
    at T = 16 and 128, benchmarks/results/all_to_allv_4gpu). ``send_rows``: send ``rows[send_rows]``, gathered
    by the exchange's kernel (no copy of its own)."""
    received, recv_counts, dropped = all_to_allv_dynamic(rows, send_counts, axis_name, max_recv_per_peer=capacity,
                                                         layout="padded", send_rows=send_rows)
    return received.reshape(-1, rows.shape[1]), recv_counts, dropped


def _gather_rows(rows, index, width=None):
    """``rows[index, :width]`` (all columns by default), zero where the index is out of bounds (``_regroup``'s
    rows past the data)."""
    width = rows.shape[1] if width is None else width
    # The barrier keeps the index arithmetic out of the gather's fusion: XLA would otherwise recompute it
    # (searches over the expert blocks) for every element of every row, several times the copy itself.
    index = jax.lax.optimization_barrier(index)
    dimensions = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
    return jax.lax.gather(rows, index[:, None], dimensions, slice_sizes=(1, width),
                          mode=jax.lax.GatherScatterMode.FILL_OR_DROP, fill_value=0)


def _send_out(pair_rows, handle):
    """``[T * k, H]`` one row per (token, choice) pair -> ``[N * C, H]`` expert-major rows on the expert side."""
    received, _, _ = _exchange(pair_rows, handle.send_counts, handle.axis_name, handle.capacity,
                               send_rows=handle.order)
    return _gather_rows(received, handle.to_expert_major)


def _send_back(expert_rows, handle):
    """``[N * C, H']`` expert-major rows -> ``[T * k, H']`` one per pair on the token side, zero if not delivered."""
    returned, _, _ = _exchange(expert_rows, handle.recv_counts, handle.axis_name, handle.capacity,
                               send_rows=handle.to_source_major)
    return _gather_rows(returned, handle.return_slot)


# ---- argument checks ---------------------------------------------------------------------------------------

def _vary_together(axis_name, arrays, others=()):
    """``arrays`` cast to vary over ``axis_name`` and every mesh axis that they or ``others`` vary over.

    Under ``check_vma`` a custom_vjp cotangent must have its input's type. The cotangents mix all the inputs,
    so every input must vary over the union of their axes.
    """
    if not compat.check_vma_enabled():
        return arrays
    axes = frozenset({axis_name}).union(*(compat.varying_axes(jax.typeof(a)) for a in (*arrays, *others)))
    return tuple(_vary_over(a, axes) for a in arrays)


def _vary_over(array, axes):
    # Sorted, so every process traces the same program (a frozenset's order follows the string hash seed).
    missing = tuple(sorted(axes - compat.varying_axes(jax.typeof(array)), key=str))
    return jax.lax.pcast(array, missing, to="varying") if missing else array


def _check_bound_axis(axis_name, op):
    axis_name = primitive.check_axis_name(axis_name, f"moe.{op}")
    if not primitive.is_bound(axis_name):
        raise NameError(f"jax_ncclx.moe.{op}: unbound axis name {axis_name!r}; call it inside jax.shard_map "
                        "over the expert-parallel mesh axis")
    return axis_name


def _check_static_int(value, name, op, *, minimum):
    if isinstance(value, jax.core.Tracer) or isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"jax_ncclx.moe.{op}: {name} must be a static Python int (it sizes arrays), got "
                        f"{value!r}; mark it static in jax.jit (static_argnums/static_argnames)")
    if value < minimum:
        raise ValueError(f"jax_ncclx.moe.{op}: {name} must be >= {minimum}, got {value}")


def _check_matrix(x, name, op, kind):
    shape, dtype = jnp.shape(x), jax.typeof(x).dtype
    if len(shape) != 2:
        raise ValueError(f"jax_ncclx.moe.{op}: {name} must be 2-D, got shape {shape}")
    if not jnp.issubdtype(dtype, kind):
        expected = "a float" if kind is jnp.floating else "an integer"
        raise TypeError(f"jax_ncclx.moe.{op}: {name} must have {expected} dtype, got {dtype}")
