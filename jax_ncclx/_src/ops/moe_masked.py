"""moe.dispatch's and moe.combine's masked layout (``layout="masked"``): one padded block of rows per local
expert, the decode layout.

Shapes: N members, E experts, L = E / N local experts, T tokens, k choices, P = T * k pairs (pair
p = t * k + c), C the capacity of one (local expert, source member).

Routing (token side). Pair p with expert id ``expert_ids[t, c]`` in ``[0, E)`` goes to member m = id // L,
local expert e = id % L. Its rank j is the number of earlier pairs (lower p) of this member with the same
id. It is kept if j < C; the rest of that expert's pairs from this member are dropped. An id outside
``[0, E)`` chooses no expert. So the sender decides every slot alone: no other member's counts are needed.
A token's row crosses to a member once, however many of its kept pairs that member holds, with the slots of
those pairs; the receiver copies it into each.

Layout (expert side). ``expert_rows[e]`` holds expert e's rows, source 0's first (in their pairs' order),
then source 1's, packed, ``group_sizes[e]`` of them; the rest of the N * C rows are zero. This is the layout
of a masked grouped matmul (``jnp.einsum("lrh,lhf->lrf")`` with a mask, or DeepGEMM's masked kernels), and
the one DeepEP's low-latency kernels use.

:class:`MaskedHandle` holds the routing for ``combine`` and both backward passes; its docstring lists its
arrays. The per-token-row ones have the packed layout's names for the same roles
(``moe_combine.combine_reduced``).

``combine`` with the weights given to dispatch is the packed layout's reduced combine over the flattened
``[L * N * C, H']`` rows: each member sums a token's weighted pairs in float32, rounds once to expert_out's
dtype and sends one row per (token, member) back; the token side adds the members' rows in float32, in member
order. With the weights given to combine one row per kept pair goes back, and the token side scales and sums
them in float32.

On CUDA with NVLink, ``dispatch`` and ``combine`` are one kernel each (``ncclx_moe_masked_dispatch_nvlink``;
``ncclx_moe_combine_nvlink`` with the weights at dispatch, ``ncclx_moe_masked_combine_nvlink`` with them at
combine; xla_ffi/ops/moe/moe_masked.h, moe_combine.h) at decode sizes. Elsewhere, and for the
backward passes, each is an exchange chain of other jax_ncclx ops around one ``all_to_allv_dynamic``. Both
compute the same values; which one a call site takes is logged at debug level. The timeout is
all_to_allv_dynamic's.

Sharding model: every operand varies over the axis, and so does every result. Batching: the exchange chain,
vmapped. AD: custom VJPs (:func:`dispatch`, :func:`combine`); each backward pass is the other direction's
exchange chain with the handle's routing, so counts are never exchanged again.
"""

import dataclasses
import functools
from collections.abc import Hashable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ncclx._src import contract
from jax_ncclx._src import lib
from jax_ncclx._src import lowering
from jax_ncclx._src import nvlink
from jax_ncclx._src import primitive
from jax_ncclx._src import validation
from jax_ncclx._src.ops import moe_combine
from jax_ncclx._src.ops import moe_dispatch
from jax_ncclx._src.ops.moe_combine import gather_rows
from jax_ncclx._src.ops.take_rows import encode_misfit
from jax_ncclx._src.ops.take_rows import take_rows


# The most bytes the dispatch kernel's slots may take per call parity (L * N * C wire rows): decode sizes.
# Larger calls take the exchange chain, whose buffers are XLA temporaries rather than symmetric memory.
KERNEL_MAX_SLOT_BYTES = 64 << 20
SUFFIX_WORDS = 4  # a row's pair index and weight on the wire, padded to 16 bytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaskedHandle:
    """The routing of one ``dispatch(..., layout="masked")`` call, for ``combine`` and both backward passes.

    A pytree whose leaves are device arrays, int32 but for the weights (N members, L = E_local local experts,
    C = capacity per (local expert, source member), T tokens, k choices, P = T * k pairs, pair p = t * k + c).
    ``axis_name``, ``capacity`` and ``top_k`` are static aux data. On the token side this member is the
    sender; on the expert side it is the receiver.

    Token side:
      send_pairs: ``[P]`` the kept pairs in (member, local expert, rank) order, then P past them.
      pair_slot: ``[P]`` ``(m * L + e) * C + j`` of each kept pair (member m, local expert e, rank j among
        this member's pairs to that expert); ``N * L * C`` for a dropped pair or one that chose no expert.
      send_counts: ``[N, L]`` kept pairs this member sent to each local expert of each member.
      dropped: ``[N]`` pairs this member had for each member that did not fit in ``capacity``.
      return_row: ``[T, N]`` ``m * R + r`` where token t was the r-th token row sent to member m (R =
        min(T, L * C) rows per source); ``N * R`` where it sent none there.

    Expert side:
      recv_counts: ``[N, L]`` pairs each source delivered to each local expert.
      row_pair: ``[L, N * C]`` ``s * P + p`` of each expert row's source s and pair p; ``N * P`` past
        ``group_sizes``.
      recv_weights: float32 ``[L, N * C]``, each expert row's router weight (0 past the data), or None when
        ``dispatch`` got no weights.
      recv_tokens: ``[N]`` token rows each source delivered (source s's r-th, in token order, is received
        row s * R + r).
      choice_rows: ``[N * R, k]`` the expert row (``e * N * C + i``) of each received token row's choices;
        ``L * N * C`` for a choice not kept here.
      choice_weights: float32 ``[N * R, k]``, their router weights (0 for those), or None without weights at
        ``dispatch``.
      send_back_rows: ``[N * R]`` the received token rows packed source-major, then ``N * R``.

    The per-token-row arrays have the names and roles of ``jax_ncclx.moe.DispatchHandle``'s.
    """

    send_pairs: jax.Array    # [T * k]
    pair_slot: jax.Array     # [T * k]
    send_counts: jax.Array   # [N, E_local]
    dropped: jax.Array       # [N]
    recv_counts: jax.Array   # [N, E_local]
    row_pair: jax.Array      # [E_local, N * C]
    recv_weights: jax.Array | None  # float32 [E_local, N * C]
    recv_tokens: jax.Array   # [N]
    choice_rows: jax.Array   # [N * R, k]
    choice_weights: jax.Array | None  # float32 [N * R, k]
    send_back_rows: jax.Array  # [N * R]
    return_row: jax.Array    # [T, N]
    axis_name: Hashable = dataclasses.field(metadata=dict(static=True))
    capacity: int = dataclasses.field(metadata=dict(static=True))
    top_k: int = dataclasses.field(metadata=dict(static=True))


_ARRAY_FIELDS = [f.name for f in dataclasses.fields(MaskedHandle) if not f.metadata.get("static")]


class Masked(NamedTuple):
    """The masked dispatch op's results; the fields after the first two are the handle's arrays."""

    expert_rows: jax.Array   # [L, N * C, H] tokens' dtype, zero past group_sizes
    group_sizes: jax.Array   # [L]
    send_pairs: jax.Array    # [P]
    pair_slot: jax.Array     # [P]
    send_counts: jax.Array   # [N, L]
    dropped: jax.Array       # [N]
    recv_counts: jax.Array   # [N, L]
    row_pair: jax.Array      # [L, N * C]
    recv_weights: jax.Array  # float32 [L, N * C], [L, 0] without weights
    recv_tokens: jax.Array   # [N]
    choice_rows: jax.Array   # [N * R, k], R = min(T, L * C)
    choice_weights: jax.Array  # float32 [N * R, k], [N * R, 0] without weights
    send_back_rows: jax.Array  # [N * R]
    return_row: jax.Array    # [T, N]


_WEIGHT_FIELDS = ("recv_weights", "choice_weights")  # None in the handle without weights at dispatch


def rows_per_source(num_tokens, local, capacity):
    """R: the most token rows one source sends one member (a token at most once, at most L * C kept pairs)."""
    return min(num_tokens, local * capacity)


# ---- dispatch and combine, with their VJPs -------------------------------------------------------------------

def dispatch(tokens, expert_ids, weights, *, num_experts, axis_name, capacity, wire_dtype):
    """``(expert_rows [L, N * C, H], group_sizes [L], MaskedHandle)``; arguments checked by ``moe.dispatch``."""
    return _dispatch(tokens, weights, expert_ids, num_experts, axis_name, capacity, wire_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _dispatch(tokens, weights, expert_ids, num_experts, axis_name, capacity, wire_dtype):
    operands = (tokens, expert_ids) + (() if weights is None else (weights.astype(jnp.float32),))
    out = Masked(*moe_masked_dispatch_p.bind(*operands, axis_name=axis_name, num_experts=int(num_experts),
                                             num_members=int(jax.lax.axis_size(axis_name)),
                                             capacity=int(capacity), wire_dtype=wire_dtype))
    fields = {name: getattr(out, name) if name not in _WEIGHT_FIELDS or weights is not None else None
              for name in _ARRAY_FIELDS}
    handle = MaskedHandle(**fields, axis_name=axis_name, capacity=capacity, top_k=expert_ids.shape[1])
    return out.expert_rows, out.group_sizes, handle


def _dispatch_fwd(tokens, weights, expert_ids, num_experts, axis_name, capacity, wire_dtype):
    outputs = _dispatch(tokens, weights, expert_ids, num_experts, axis_name, capacity, wire_dtype)
    return outputs, (outputs[2], weights)


def _dispatch_bwd(num_experts, axis_name, capacity, wire_dtype, residuals, cotangents):
    """As the packed layout's: the rows' cotangents go back summed per token on the expert side (one row per
    token and member, in float32, rounded to the rows' dtype; the token side adds the members' rows in
    float32), and the weights' cotangents go back as rows of k float32. The 8-bit wire counts as the
    identity."""
    validation.check_bound_in_backward(axis_name, "moe.dispatch")
    handle, weights = residuals
    ct_rows, _, ct_handle = cotangents
    local, rows, width = ct_rows.shape
    routing = (handle.recv_tokens, handle.send_back_rows, handle.return_row, handle.axis_name)
    ct_tokens = moe_combine.reduce_back(ct_rows.reshape(local * rows, width), handle.choice_rows, None, *routing)
    ct_weights = None
    if weights is not None:
        # The weights reach the handle twice, per expert row and per choice: both cotangents, per choice.
        per_row = jnp.take(ct_handle.recv_weights.reshape(-1), handle.choice_rows, mode="fill", fill_value=0)
        ct_weights = moe_combine.return_per_token(ct_handle.choice_weights + per_row, *routing)
        ct_weights = ct_weights.astype(weights.dtype)
    return ct_tokens.astype(ct_rows.dtype), ct_weights, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def combine(expert_out, handle: MaskedHandle, weights):
    """``[T, H']``: each token's kept pairs' rows of ``expert_out`` ``[L, N * C, H']``, weighted and summed in
    float32; weights None: the handle's (given to dispatch). Arguments checked by ``moe.combine``."""
    if weights is None:
        return _combine_expert_weights(expert_out, handle)
    return _combine_token_weights(expert_out, handle, weights)


@jax.custom_vjp
def _combine_expert_weights(expert_out, handle):
    local, rows, width = expert_out.shape
    return moe_combine.combine_reduced(expert_out.reshape(local * rows, width), handle.choice_rows,
                                       handle.choice_weights, handle.recv_tokens, handle.send_back_rows,
                                       handle.return_row, handle.axis_name)


def _combine_expert_weights_fwd(expert_out, handle):
    return _combine_expert_weights(expert_out, handle), (expert_out, handle)


def _combine_expert_weights_bwd(residuals, ct_out):
    """The output's cotangent goes out to every kept pair's row (as dispatch sent the tokens); each row's is
    scaled by its weight, and each weight's is the dot product of the row's cotangent with its output."""
    expert_out, handle = residuals
    validation.check_bound_in_backward(handle.axis_name, "moe.combine")
    ct_rows = scatter_pairs(ct_out, handle, token_rows=True).astype(jnp.float32)
    ct_expert_out = (ct_rows * handle.recv_weights[..., None]).astype(expert_out.dtype)
    ct_weights = jnp.sum(ct_rows * expert_out.astype(jnp.float32), axis=2)
    ct_handle = dataclasses.replace(handle, **{**{f: None for f in _ARRAY_FIELDS}, "recv_weights": ct_weights})
    return ct_expert_out, ct_handle


_combine_expert_weights.defvjp(_combine_expert_weights_fwd, _combine_expert_weights_bwd)


@jax.custom_vjp
def _combine_token_weights(expert_out, handle, weights):
    return moe_masked_combine_p.bind(expert_out, handle.row_pair, handle.pair_slot, handle.recv_counts,
                                     handle.send_counts, weights.astype(jnp.float32), axis_name=handle.axis_name,
                                     capacity=handle.capacity, num_tokens=handle.pair_slot.shape[0] // handle.top_k)


def _combine_token_weights_fwd(expert_out, handle, weights):
    return _combine_token_weights(expert_out, handle, weights), (expert_out, handle, weights)


def _combine_token_weights_bwd(residuals, ct_out):
    """Each pair's row gets the output's cotangent times its weight; each weight gets the dot product of the
    output's cotangent with its pair's row."""
    expert_out, handle, weights = residuals
    validation.check_bound_in_backward(handle.axis_name, "moe.combine")
    num_tokens, top_k = weights.shape
    ct_out = ct_out.astype(jnp.float32)
    ct_pairs = (ct_out[:, None, :] * weights[:, :, None].astype(jnp.float32)).reshape(num_tokens * top_k, -1)
    ct_expert_out = scatter_pairs(ct_pairs.astype(expert_out.dtype), handle, token_rows=False)
    returned = gather_pairs(expert_out, handle).astype(jnp.float32).reshape(num_tokens, top_k, -1)
    ct_weights = jnp.sum(returned * ct_out[:, None, :], axis=2).astype(weights.dtype)
    return ct_expert_out, None, ct_weights


_combine_token_weights.defvjp(_combine_token_weights_fwd, _combine_token_weights_bwd)


# ---- the exchange chain ----------------------------------------------------------------------------------------

def route(expert_ids, *, num_experts, num_members, capacity):
    """The token side's routing of int32 ``[T, k]`` expert ids: (send_pairs, pair_slot, send_counts,
    dropped), as the module docstring defines them."""
    ids = expert_ids.reshape(-1)
    pairs, local = ids.shape[0], num_experts // num_members
    key = jnp.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    order = jnp.argsort(key, stable=True)
    counts = jnp.zeros(num_experts + 1, jnp.int32).at[key].add(1)
    starts = jnp.cumsum(counts) - counts
    sorted_key = key[order]
    rank = jnp.arange(pairs, dtype=jnp.int32) - starts[sorted_key]  # of each pair in `order`
    kept = (sorted_key < num_experts) & (rank < capacity)
    no_slot = num_experts * capacity
    pair_slot = jnp.full(pairs, no_slot, jnp.int32).at[order].set(
        jnp.where(kept, sorted_key * capacity + rank, no_slot))
    # The kept pairs keep their order (it is the slots' order), packed to the front.
    position = jnp.where(kept, jnp.cumsum(kept) - 1, pairs)
    send_pairs = jnp.full(pairs, pairs, jnp.int32).at[position].set(order.astype(jnp.int32), mode="drop")
    per_expert = counts[:num_experts].reshape(num_members, local)
    send_counts = jnp.minimum(per_expert, capacity)
    dropped = jnp.sum(per_expert - send_counts, axis=1)
    return send_pairs, pair_slot, send_counts, dropped


def _expert_layout(recv_counts, capacity):
    """int32 ``[L, N * C]`` each expert-layout row's received row (source s's rows from s * L * C of the padded
    exchange, in (expert, rank) order), ``N * L * C`` past the data, and ``[L, N * C]`` its source (N past
    the data)."""
    num_members, local = recv_counts.shape
    rows = num_members * capacity
    ends = jnp.cumsum(recv_counts, axis=0)  # [N, L]: where each source's rows end in an expert's block
    offsets = ends - recv_counts
    starts = jnp.cumsum(recv_counts, axis=1) - recv_counts  # where (s, e) starts among s's received rows
    row = jnp.arange(rows, dtype=jnp.int32)
    source = jax.vmap(lambda e: jnp.searchsorted(e, row, side="right"))(ends.T).astype(jnp.int32)  # [L, NC]
    valid = source < num_members
    clipped, expert = jnp.minimum(source, num_members - 1), jnp.arange(local)[:, None]
    received = clipped * (local * capacity) + starts[clipped, expert] + row[None, :] - offsets[clipped, expert]
    return jnp.where(valid, received, num_members * local * capacity), jnp.where(valid, source, num_members)


def _return_layout(recv_counts, capacity):
    """int32 ``[N * L * C]``: the send rows of the exchange back to the token side (source-major, each
    source's rows in the order it sent them), as expert-layout rows (``L * N * C`` past the data)."""
    num_members, local = recv_counts.shape
    received, source = _expert_layout(recv_counts, capacity)
    # Packed by destination: source s's rows start after every earlier source's.
    totals = recv_counts.sum(axis=1)
    before = (jnp.cumsum(totals) - totals)[jnp.minimum(source, num_members - 1)]
    within = received - jnp.minimum(source, num_members - 1) * (local * capacity)
    position = jnp.where(source < num_members, before + within, num_members * local * capacity)
    flat = jnp.arange(local * num_members * capacity, dtype=jnp.int32).reshape(local, -1)
    return jnp.full(num_members * local * capacity, local * num_members * capacity, jnp.int32).at[
        position.reshape(-1)].set(flat.reshape(-1), mode="drop")


def _returned_row(pair_slot, send_counts, capacity):
    """int32 ``[P]``: where each kept pair's row lands in the exchange back (member m's from m * L * C, in its
    (expert, rank) order); past the data for the rest."""
    num_members, local = send_counts.shape
    member = pair_slot // (local * capacity)
    expert = pair_slot // capacity - member * local
    rank = pair_slot % capacity
    starts = jnp.cumsum(send_counts, axis=1) - send_counts
    kept = member < num_members
    clipped = jnp.minimum(member, num_members - 1), jnp.minimum(expert, local - 1)
    return jnp.where(kept, member * (local * capacity) + starts[clipped] + rank, num_members * local * capacity)


def scatter_pairs(rows, handle, *, token_rows):
    """Rows to the expert side: ``[L, N * C, W]`` from ``rows`` ``[T, W]`` (token_rows: each kept pair takes its
    token's row, which goes once to each member) or ``[P, W]`` (one row per pair), zeros past the data. The
    handle's routing, no counts."""
    capacity = handle.capacity
    if token_rows:
        num_members, local = handle.send_counts.shape
        received, layout = _send_tokens_once(rows, handle.pair_slot, local=local, capacity=capacity,
                                             num_members=num_members, axis_name=handle.axis_name)
        return take_rows(received, layout.index, width=rows.shape[1], sources=layout.sources).reshape(
            local, -1, rows.shape[1])
    received, _, _ = moe_dispatch.exchange(rows, handle.send_counts, handle.axis_name,
                                           handle.send_counts.shape[1] * capacity, send_rows=handle.send_pairs)
    index, _ = _expert_layout(handle.recv_counts, capacity)
    local, width = handle.recv_counts.shape[1], rows.shape[1]
    return take_rows(received, index.reshape(-1), width=width).reshape(local, -1, width)


class _Received(NamedTuple):
    """Where the rows of one send-once exchange go in the expert layout (R = min(T, L * C) rows per source)."""

    index: jax.Array        # [L * N * C] the received row of each expert-layout row, N * R past the data
    sources: jax.Array      # [N * R, k] the expert-layout rows of each received row, L * N * C for none
    recv_counts: jax.Array  # [N, L] pairs each source delivered to each local expert
    row_pair: jax.Array     # [L * N * C] s * P + p of each row, N * P past the data
    words: jax.Array        # int32 [N * R, k] the words that came with each received row's choices, 0 for none
    recv_tokens: jax.Array  # [N] token rows each source delivered
    return_row: jax.Array   # [T, N] m * R + r of token t's row among those sent to m, N * R for none


def _send_tokens_once(rows, pair_slot, *, local, capacity, num_members, axis_name, words=None):
    """Each row of ``rows`` ``[T, W]`` goes once to each member that keeps one of its token's pairs, with the
    slot there of each choice (and its word of ``words`` int32 ``[T, k]``, if given) in a suffix; the receiver
    lays the rows out by slot. One row per (token, member) on the wire rather than one per pair.

    Returns (received ``[N * R, W + suffix]``, R = min(T, L * C) rows per source, :class:`_Received`)."""
    num_tokens, width = rows.shape
    top_k, pairs = pair_slot.shape[0] // num_tokens, pair_slot.shape[0]
    per_member = local * capacity
    member = pair_slot.reshape(num_tokens, top_k) // per_member  # N for the pairs not kept
    goes = (member[None] == jnp.arange(num_members)[:, None, None]).any(axis=2)  # [N, T]
    # Member-major, tokens in order: the exchange sends member m's token_counts[m] rows from its offset.
    flat = jnp.nonzero(goes.reshape(-1), size=num_members * num_tokens, fill_value=num_members * num_tokens)[0]
    send_token, send_member = (flat % num_tokens).astype(jnp.int32), (flat // num_tokens).astype(jnp.int32)
    local_slot = pair_slot.reshape(num_tokens, top_k)[send_token] - send_member[:, None] * per_member
    local_slot = jnp.where(member[send_token] == send_member[:, None], local_slot, -1)
    extra = jnp.zeros((num_tokens, top_k), jnp.int32) if words is None else words
    suffix = jnp.concatenate([send_token[:, None], local_slot, extra[send_token]], axis=1)
    suffix = jnp.pad(suffix, ((0, 0), (0, -suffix.shape[1] % SUFFIX_WORDS)))
    per_source = rows_per_source(num_tokens, local, capacity)
    received, recv_tokens, _ = moe_dispatch.exchange(rows, goes.sum(axis=1, dtype=jnp.int32), axis_name,
                                                     per_source, send_rows=send_token,
                                                     suffix=moe_dispatch._as_columns(suffix, rows.dtype))
    tags = _as_words(received[:, width:])
    received_row = jnp.arange(num_members * per_source, dtype=jnp.int32)
    source = received_row // per_source
    valid = (received_row - source * per_source < recv_tokens[source])[:, None]  # rows past the data: none
    slot = jnp.where(valid, tags[:, 1:1 + top_k], -1)  # [N * R, k]
    kept = slot >= 0
    expert, rank = jnp.where(kept, slot // capacity, local), slot % capacity
    recv_counts = jnp.zeros((num_members, local + 1), jnp.int32).at[source[:, None], expert].add(1)[:, :local]
    offset = jnp.cumsum(recv_counts, axis=0) - recv_counts  # [N, L]: off(e, s), the earlier sources' rows
    rows_per_expert, total = num_members * capacity, local * num_members * capacity
    at = offset[source[:, None], jnp.minimum(expert, local - 1)]
    row = jnp.where(kept, expert * rows_per_expert + at + rank, total)
    index = jnp.full(total, num_members * per_source, jnp.int32).at[row].set(
        jnp.broadcast_to(received_row[:, None], row.shape), mode="drop")
    pair = source[:, None] * pairs + tags[:, :1] * top_k + jnp.arange(top_k, dtype=jnp.int32)
    row_pair = jnp.full(total, num_members * pairs, jnp.int32).at[row].set(pair, mode="drop")
    rank = jnp.cumsum(goes, axis=1, dtype=jnp.int32) - 1  # [N, T]: of each token among those sent to a member
    members = jnp.arange(num_members, dtype=jnp.int32)[:, None]
    return_row = jnp.where(goes, members * per_source + rank, num_members * per_source).T
    return received, _Received(index=index, sources=row, recv_counts=recv_counts, row_pair=row_pair,
                               words=jnp.where(kept, tags[:, 1 + top_k:1 + 2 * top_k], 0), recv_tokens=recv_tokens,
                               return_row=return_row)


def _send_back_rows(recv_tokens, per_source):
    """int32 ``[N * R]``: the received rows packed source-major (source s's first recv_tokens[s], from row
    s * R), then N * R: the send order of the exchange that returns one row per token."""
    num_members = recv_tokens.shape[0]
    delivered = jnp.clip(recv_tokens, 0, per_source)
    ends = jnp.cumsum(delivered)
    position = jnp.arange(num_members * per_source, dtype=jnp.int32)
    source = jnp.searchsorted(ends, position, side="right").astype(jnp.int32)
    clipped = jnp.minimum(source, num_members - 1)
    back = clipped * per_source + position - (ends - delivered)[clipped]
    return jnp.where(source < num_members, back, num_members * per_source)


def gather_pairs(expert_rows, handle):
    """Rows back to the token side: ``[P, W]``, each kept pair's row of ``expert_rows`` ``[L, N * C, W]``,
    zeros for the rest."""
    local, capacity = handle.recv_counts.shape[1], handle.capacity
    flat = expert_rows.reshape(-1, expert_rows.shape[2])
    returned, _, _ = moe_dispatch.exchange(flat, handle.recv_counts, handle.axis_name, local * capacity,
                                           send_rows=_return_layout(handle.recv_counts, capacity))
    # Computed once: fused into the gather (and the sum its callers fuse with it), XLA recomputes the index
    # arithmetic for every element of every row, which made prefill-sized combines 10x slower.
    index = jax.lax.optimization_barrier(_returned_row(handle.pair_slot, handle.send_counts, capacity))
    return gather_rows(returned, index)


def _dispatch_chain(tokens, expert_ids, *weights, axis_name, num_experts, num_members, capacity, wire_dtype):
    weights = weights[0] if weights else None
    num_tokens, hidden = tokens.shape
    local = num_experts // num_members
    send_pairs, pair_slot, send_counts, dropped = route(expert_ids, num_experts=num_experts,
                                                        num_members=num_members, capacity=capacity)
    source = tokens if wire_dtype is None else moe_dispatch._encoded(tokens, wire_dtype)
    weight_bits = None if weights is None else jax.lax.bitcast_convert_type(weights, jnp.int32)
    received, layout = _send_tokens_once(source, pair_slot, local=local, capacity=capacity, num_members=num_members,
                                         axis_name=axis_name, words=weight_bits)
    # Walked by received row (sources): each is read once, not once per choice, and on an 8-bit wire
    # dequantized as it is read where the copy can (else decoded first, logged).
    width = source.shape[1]
    if wire_dtype is not None and moe_dispatch._decodes_as_it_expands(tokens.dtype, hidden, received.shape[1]):
        expert_rows = take_rows(received, layout.index, width=hidden, sources=layout.sources, wire_dtype=wire_dtype,
                                dtype=tokens.dtype)
    else:
        if wire_dtype is not None:
            received, width = moe_dispatch._decode(received[:, :width], hidden, wire_dtype, tokens.dtype), hidden
        expert_rows = take_rows(received, layout.index, width=width, sources=layout.sources)
    recv_weights = jnp.zeros((local, 0), jnp.float32)
    choice_weights = jnp.zeros((layout.sources.shape[0], 0), jnp.float32)
    if weights is not None:
        bits = jnp.zeros(local * num_members * capacity, jnp.int32).at[layout.sources].set(layout.words, mode="drop")
        recv_weights = jax.lax.bitcast_convert_type(bits, jnp.float32).reshape(local, -1)
        choice_weights = jax.lax.bitcast_convert_type(layout.words, jnp.float32)
    per_source = rows_per_source(num_tokens, local, capacity)
    return list(Masked(expert_rows=expert_rows.reshape(local, -1, hidden),
                       group_sizes=layout.recv_counts.sum(axis=0), send_pairs=send_pairs, pair_slot=pair_slot,
                       send_counts=send_counts, dropped=dropped, recv_counts=layout.recv_counts,
                       row_pair=layout.row_pair.reshape(local, -1), recv_weights=recv_weights,
                       recv_tokens=layout.recv_tokens, choice_rows=layout.sources, choice_weights=choice_weights,
                       send_back_rows=_send_back_rows(layout.recv_tokens, per_source),
                       return_row=layout.return_row))


def _as_words(columns):
    """``[M, G]`` columns of any dtype -> int32 ``[M, G * itemsize / 4]`` with the same bits."""
    itemsize = np.dtype(columns.dtype).itemsize
    if itemsize < 4:
        columns = columns.reshape(columns.shape[0], -1, 4 // itemsize)
    return jax.lax.bitcast_convert_type(columns, jnp.int32).reshape(columns.shape[0], -1)


def _combine_chain(expert_out, row_pair, pair_slot, recv_counts, send_counts, weights, *, axis_name, capacity,
                   num_tokens):
    del row_pair  # the kernel's: the chain takes the same routing from the counts
    top_k = pair_slot.shape[0] // num_tokens
    handle = MaskedHandle(**{f: None for f in _ARRAY_FIELDS} | dict(
        pair_slot=pair_slot, send_counts=send_counts, recv_counts=recv_counts), axis_name=axis_name,
        capacity=capacity, top_k=top_k)
    per_pair = gather_pairs(expert_out, handle).astype(jnp.float32).reshape(num_tokens, top_k, -1)
    return (per_pair * weights[:, :, None]).sum(axis=1).astype(expert_out.dtype)


# ---- the primitives ----------------------------------------------------------------------------------------

moe_masked_dispatch_p = primitive.make_collective("moe_masked_dispatch", multiple_results=True)


def _dispatch_abstract_eval(tokens, expert_ids, *weights, axis_name, num_experts, num_members, capacity,
                            wire_dtype):
    (num_tokens, hidden), top_k = tokens.shape, expert_ids.shape[1]
    local, rows, pairs = num_experts // num_members, num_members * capacity, num_tokens * top_k
    received = num_members * rows_per_source(num_tokens, local, capacity)
    shapes = Masked(expert_rows=(local, rows, hidden), group_sizes=(local,), send_pairs=(pairs,),
                    pair_slot=(pairs,), send_counts=(num_members, local), dropped=(num_members,),
                    recv_counts=(num_members, local), row_pair=(local, rows),
                    recv_weights=(local, rows if weights else 0), recv_tokens=(num_members,),
                    choice_rows=(received, top_k), choice_weights=(received, top_k if weights else 0),
                    send_back_rows=(received,), return_row=(num_tokens, num_members))
    dtypes = {"expert_rows": tokens.dtype, "recv_weights": jnp.float32, "choice_weights": jnp.float32}
    avals = primitive.output_avals(shapes, tokens, axis_name, expert_ids, *weights, dtypes=dtypes)
    return avals, primitive.effects(axis_name)


def _dispatch_route(ctx, comm_id, size, *, num_experts, num_members, capacity, wire_dtype):
    """The NVLink kernel's route, or None (the exchange chain) where it cannot run."""
    tokens, expert_ids = ctx.avals_in[0], ctx.avals_in[1]
    (num_tokens, hidden), top_k = tokens.shape, expert_ids.shape[1]
    dtype = np.dtype(tokens.dtype)
    module = lib.cuda_module()
    wire = moe_dispatch._wire(wire_dtype)
    wire_row_bytes = module.moe_dispatch_wire_row_bytes(hidden, dtype.itemsize, wire)
    local = num_experts // num_members
    why = None
    if wire_dtype is not None and encode_misfit(tokens.dtype, hidden) is not None:
        why = encode_misfit(tokens.dtype, hidden)
    elif dtype.name not in contract.FLOAT_TYPES or (hidden * dtype.itemsize) % 16 or wire_row_bytes % 16:
        why = f"{dtype} rows of {hidden} (the kernel moves float32, bfloat16 and float16 rows of 16-byte multiples)"
    elif top_k > module.MOE_MASKED_MAX_TOP_K or num_tokens * top_k > module.MOE_MASKED_MAX_PAIRS:
        why = (f"{num_tokens} tokens of top-{top_k} (the kernel takes up to top-{module.MOE_MASKED_MAX_TOP_K} and "
               f"{module.MOE_MASKED_MAX_PAIRS} pairs)")
    slots = (module.moe_masked_dispatch_slot_bytes(size, num_tokens, local, capacity, wire, wire_row_bytes)
             if why is None else 0)
    return nvlink.kernel_route("moe.dispatch", comm_id, why, slots, label="moe.dispatch (masked)",
                               most_slot_bytes=KERNEL_MAX_SLOT_BYTES)


moe_masked_dispatch_p.def_effectful_abstract_eval(_dispatch_abstract_eval)
lowering.register_lowerings(
    moe_masked_dispatch_p, "ncclx_moe_masked_dispatch",
    # Decoded as MoeMaskedDispatchAttrs (xla_ffi/ops/moe/moe_masked_cuda.cc); its enum travels as int32.
    lambda *, num_experts, num_members, capacity, wire_dtype: dict(dispatch=dict(
        num_experts=np.int64(num_experts), capacity=np.int64(capacity),
        wire=np.int32(moe_dispatch._wire(wire_dtype)))),
    cuda_route=_dispatch_route, fallback=_dispatch_chain, timeout_op="all_to_allv_dynamic")
primitive.batch_by_chain(moe_masked_dispatch_p, _dispatch_chain)


moe_masked_combine_p = primitive.make_collective("moe_masked_combine")


def _combine_abstract_eval(expert_out, row_pair, pair_slot, recv_counts, send_counts, weights, *, axis_name,
                           capacity, num_tokens):
    aval = primitive.output_aval(expert_out, axis_name, row_pair, pair_slot, recv_counts, send_counts, weights,
                                 shape=(num_tokens, expert_out.shape[2]))
    return aval, primitive.effects(axis_name)


def _combine_route(ctx, comm_id, size, *, capacity, num_tokens):
    """The NVLink kernel's route, or None (the exchange chain) where it cannot run."""
    expert_out, pair_slot = ctx.avals_in[0], ctx.avals_in[2]
    dtype, hidden = np.dtype(expert_out.dtype), expert_out.shape[2]
    pairs = pair_slot.shape[0]
    module = lib.cuda_module()
    why = None
    if dtype.name not in contract.FLOAT_TYPES or hidden * dtype.itemsize % 16:
        why = f"{dtype} rows of {hidden} (the kernel moves float32, bfloat16 and float16 rows of 16-byte multiples)"
    elif pairs // max(num_tokens, 1) > module.MOE_MASKED_MAX_TOP_K or pairs > module.MOE_MASKED_MAX_PAIRS:
        why = (f"{pairs} pairs (the kernel takes up to top-{module.MOE_MASKED_MAX_TOP_K} and "
               f"{module.MOE_MASKED_MAX_PAIRS} pairs)")
    slots = module.moe_masked_combine_slot_bytes(pairs, hidden, dtype.itemsize) if why is None else 0
    return nvlink.kernel_route("moe.combine", comm_id, why, slots, label="moe.combine (masked)",
                               most_slot_bytes=KERNEL_MAX_SLOT_BYTES,
                               operands=(0, 1, 2, 5))  # the counts are the chain's only


moe_masked_combine_p.def_effectful_abstract_eval(_combine_abstract_eval)
lowering.register_lowerings(moe_masked_combine_p, "ncclx_moe_masked_combine", cuda_route=_combine_route,
                            fallback=_combine_chain, timeout_op="all_to_allv_dynamic")
primitive.batch_by_chain(moe_masked_combine_p, _combine_chain)
