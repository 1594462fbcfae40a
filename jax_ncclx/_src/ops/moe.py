"""MoE dispatch and combine over one expert-parallel mesh axis (or several taken as one). On NVLink, dispatch
at decode sizes and combine (with dispatch's weights) up to 64 MiB of rows per member are one kernel each
(``moe_dispatch.py``, ``moe_combine.py``); elsewhere each is a chain of jax_ncclx ops around one
``all_to_allv_dynamic`` call. Both give the same values.

Expert placement: with N members on ``axis_name`` and E experts, E_local = E // N and expert e lives on member
e // E_local (by ``jax.lax.axis_index(axis_name)``) as its local expert e % E_local. ``dispatch`` gives every
(token, choice) pair's row to the member that owns the chosen expert and returns the received rows grouped by
local expert, ready for ``jax.lax.ragged_dot``. On the wire a token crosses once per member, however many of
that member's experts it chose (DeepEP's send-once; for top-8 of 32 experts on 4 members about 3.7 rows per
token instead of 8), tagged with its pairs, and the receiver expands it into one row per pair. ``combine``
sums each token's expert outputs with its router weights. When ``dispatch`` got the weights, they travel with
the rows and ``combine`` sums the pairs of each token on the expert side first, so it sends one row per token
and member back, like dispatch; otherwise it sends one row per pair back and sums on the token side. The
counts stay on the device: ``dispatch`` learns them from the exchange itself, and ``combine`` reuses them from
the handle.

Capacity: one member takes at most ``capacity`` pairs from any one member. The pairs for one destination
are sorted by expert and it takes the first ``capacity`` of them, so drops hit the highest-numbered experts
(and, within one, the last tokens) first. A dropped pair contributes zero to ``combine``, and
``handle.dropped`` counts the drops per destination.

Wire precision: ``dispatch(..., wire_dtype=jnp.float8_e4m3fn)`` quantizes each row on the way (blocks of 128
elements, one float32 scale each, as DeepSeek-V3's FP8 activations), so the exchange moves about half the
bytes of bf16; the receiver dequantizes. ``combine`` and every backward pass send full precision.

AD: each function's backward pass is the other's exchange. The cotangent of ``dispatch``'s rows goes back to
the tokens summed over each token's pairs on the expert side, one row per token and member. The cotangent
of ``combine``'s output goes out to the experts one row per token and member (weights given to dispatch) or
one row per pair (weights given to combine), scaled by the weights. Neither backward pass exchanges counts
again. They are ``jax.custom_vjp`` rules, so there is no forward mode (``jax.jvp``, ``jax.jacfwd``).
"""

import dataclasses
import functools
import logging
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np

from jax_ncclx._src import compat
from jax_ncclx._src import config
from jax_ncclx._src import contract
from jax_ncclx._src import health
from jax_ncclx._src import primitive
from jax_ncclx._src import validation
from jax_ncclx._src.ops import moe_combine
from jax_ncclx._src.ops import moe_dispatch
from jax_ncclx._src.ops import moe_masked
from jax_ncclx._src.ops.take_rows import take_rows

logger = logging.getLogger("jax_ncclx")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DispatchHandle:
    """The routing of one ``dispatch`` call, for ``combine`` and both backward passes.

    A pytree whose leaves are device arrays, int32 but for ``recv_weights`` (N members, E_local local
    experts, C = capacity, T tokens, k choices). ``axis_name``, ``capacity`` and ``top_k`` are static aux
    data. On the token side this member is the sender (S = send rows, R = min(C, T)); on the expert side
    it is the receiver.

    Token side:
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
      send_token: ``[S]`` the token of each send row, members in order (T past the data); S =
        min(T * min(k, N), N * C), a token going at most once to each member.
      token_counts: ``[N]`` send rows (tokens) for each member.
      return_row: ``[T, N]`` where token t's row comes back from member m when rows return one per token
        (member m's from row m * R); ``N * R`` where t was not sent to m.

    Expert side:
      recv_tokens: ``[N]`` token rows each source delivered (source i's at rows i * R of dispatch's exchange).
      expand_rows: ``[N * C]`` the received row behind each expert-major row (``N * R`` past the data).
      pair_entry: ``[N * C]`` ``received row * k + choice`` of each expert-major row (``N * R * k`` past it).
      row_pairs: ``[N * R, k]`` the expert-major row of each received row's choice; ``N * C`` where the
        choice went to another member or was dropped.
      send_back_rows: ``[N * R]`` the received rows, packed source-major, as rows return one per token.
      recv_weights: float32 ``[N * R, k]``, each received row's router weights (all k of its token), or
        None when ``dispatch`` got no weights.
    """

    order: jax.Array
    send_counts: jax.Array
    recv_counts: jax.Array
    to_expert_major: jax.Array
    to_source_major: jax.Array
    return_slot: jax.Array
    dropped: jax.Array
    send_token: jax.Array
    token_counts: jax.Array
    return_row: jax.Array
    recv_tokens: jax.Array
    expand_rows: jax.Array
    pair_entry: jax.Array
    row_pairs: jax.Array
    send_back_rows: jax.Array
    recv_weights: jax.Array | None
    axis_name: Hashable = dataclasses.field(metadata=dict(static=True))
    capacity: int = dataclasses.field(metadata=dict(static=True))
    top_k: int = dataclasses.field(metadata=dict(static=True))


_ARRAY_FIELDS = [f.name for f in dataclasses.fields(DispatchHandle) if not f.metadata.get("static")]

WIRE_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
LAYOUTS = ("packed", "masked")


def dispatch(tokens, expert_ids, *, num_experts: int, axis_name, capacity: int, weights=None, wire_dtype=None,
             layout: str = "packed"):
    """Sends every (token, choice) pair's row to the member that owns its expert.

    Call it inside ``jax.shard_map`` over ``axis_name``. It runs under ``jax.jit``, ``jax.vmap`` (over a
    non-mesh axis, still one exchange; or over ``axis_name`` itself, every member here and the exchange a
    gather) and ``jax.grad`` (in ``tokens`` and ``weights``).

    Args:
      tokens: ``[T, H]`` any float dtype, this member's tokens.
      expert_ids: ``[T, k]`` integers, the experts each token chose (top-k). An id outside ``[0, num_experts)``
        (e.g. -1) chooses no expert. That pair is not sent, is not counted as dropped, and contributes zero.
      num_experts: E, the total number of experts, a multiple of the axis size N and at most 2048 (static).
      axis_name: the expert-parallel mesh axis, or a tuple of axes taken as one (static; members in the
        order of ``jax.lax.axis_index`` of the tuple, the first axis major).
      capacity: C, 1 to 2**31 - 1, the most (token, choice) pairs this member gives any one member, and takes
        from any one member (static; masked layout: the most it gives any one expert of a member). Pairs past
        it are dropped (see ``handle.dropped``; ``JAX_NCCLX_WARN_DROPS=1`` logs every call that drops).
      weights: None, or ``[T, k]`` any float dtype, the router weight of each pair. They travel with the rows
        (as float32, k * 4 bytes per row) into ``handle.recv_weights``, so that ``combine(expert_out,
        handle)`` can sum each token's pairs before sending them back: one row per token and member on the
        wire instead of one per pair. Differentiable.
      wire_dtype: None (default): rows travel in tokens' dtype. ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``:
        each row travels as 8-bit floats, scaled per block of 128 elements (the whole row when H is not a
        multiple of 128) by a float32 scale that travels with it: H + 4 * H / 128 bytes per row instead of
        2 * H for bf16. The receiver dequantizes, so expert_rows keep tokens' dtype. Lossy: each value is
        rounded to 3 mantissa bits (e4m3; e5m2: 2), i.e. within 2^-4 (2^-3) of itself, and values below about
        2^-15 (e5m2: 2^-31) of their block's largest lose more. The gradient treats the quantization as the
        identity (static).
      layout: ``"packed"`` (default): the rows described below, for ``jax.lax.ragged_dot``. ``"masked"``: one
        block of ``N * capacity`` rows per local expert, ``[E_local, N * C, H]``, for a masked grouped matmul
        (DeepEP's low-latency layout, the decode layout). Then capacity counts per (local expert, source
        member), a token still crosses to a member once however many of its pairs that member keeps, and the
        handle is a ``MaskedHandle``; see "Masked layout" below (static).

    Returns:
      ``(expert_rows, group_sizes, handle)``:

      - expert_rows: ``[N * C, H]`` tokens' dtype, the received rows in expert-major order. Local expert 0's
        rows come first (source 0's, then source 1's, ...), then local expert 1's, and so on. The rest of
        the rows are zero.
      - group_sizes: int32 ``[E_local]``, the number of rows for each local expert. Pass it with
        ``expert_rows`` to ``jax.lax.ragged_dot(expert_rows, w, group_sizes)``, where w is
        ``[E_local, H, H']``.
      - handle: a ``DispatchHandle`` for ``combine``. ``handle.dropped`` is int32 ``[N]``.

    Masked layout: ``expert_rows`` is ``[E_local, N * C, H]``. Block e holds local expert e's rows: source 0's
    first, in the order of its (token, choice) pairs, then source 1's, packed; ``group_sizes[e]`` of them, and
    zeros after. Source s gives expert e at most C pairs: a pair whose rank among s's pairs to that expert is C
    or more is dropped. ``handle`` is a ``MaskedHandle``; ``handle.dropped`` is int32 ``[N]``, per destination.

    Raises:
      NameError: ``axis_name`` is not bound by an enclosing ``jax.shard_map``.
      TypeError: tokens not a float dtype, expert_ids not an integer one, weights not a float one; num_experts
        or capacity not a static int.
      ValueError: num_experts not a multiple of N or above 2048 (the routing kernels' limit); capacity below 1
        or above 2^31 - 1; tokens or expert_ids not 2-D, or their T differ; T = 0 or k = 0; weights not
        ``[T, k]``; wire_dtype not None, float8_e4m3fn or float8_e5m2; layout not "packed" or "masked"; with the
        masked layout, E * C above 2^31 - 1. Each message names the argument and its value.
    """
    axis_name = _check_bound_axis(axis_name, "dispatch")
    num_members = jax.lax.axis_size(axis_name)
    validation.check_static_int(num_experts, "num_experts", "moe.dispatch", minimum=1)
    if num_experts % num_members:
        raise ValueError(f"jax_ncclx.moe.dispatch: num_experts ({num_experts}) must be a multiple of the size "
                         f"of axis {axis_name!r} ({num_members})")
    if num_experts > contract.MAX_EXPERTS:
        raise ValueError(f"jax_ncclx.moe.dispatch: num_experts ({num_experts}) must be at most "
                         f"{contract.MAX_EXPERTS} (the routing kernels count experts in shared memory)")
    validation.check_static_int(capacity, "capacity", "moe.dispatch", minimum=1, maximum=contract.MAX_CAPACITY)
    _check_matrix(tokens, "tokens", "dispatch", jnp.floating)
    if jnp.shape(tokens)[0] < 1:
        raise ValueError(f"jax_ncclx.moe.dispatch: tokens must have at least one row (T >= 1), got shape "
                         f"{jnp.shape(tokens)}")
    _check_matrix(expert_ids, "expert_ids", "dispatch", jnp.integer)
    if jnp.shape(expert_ids)[0] != jnp.shape(tokens)[0] or jnp.shape(expert_ids)[1] < 1:
        raise ValueError(f"jax_ncclx.moe.dispatch: expert_ids must be [T, k] with T = {jnp.shape(tokens)[0]} "
                         f"(the rows of tokens) and k >= 1, got shape {jnp.shape(expert_ids)}")
    if weights is not None:
        _check_matrix(weights, "weights", "dispatch", jnp.floating)
        if jnp.shape(weights) != jnp.shape(expert_ids):
            raise ValueError(f"jax_ncclx.moe.dispatch: weights must be [T, k] = {list(jnp.shape(expert_ids))} "
                             f"like expert_ids, got shape {jnp.shape(weights)}")
    if wire_dtype is not None:
        try:
            named = np.dtype(wire_dtype)
        except TypeError:  # not a dtype at all, e.g. "fp8"
            named = None
        if named is None or not any(named == np.dtype(d) for d in WIRE_DTYPES):
            got = repr(wire_dtype) if named is None else named.name
            raise ValueError(f"jax_ncclx.moe.dispatch: wire_dtype must be None, float8_e4m3fn or float8_e5m2, "
                             f"got {got}")
        wire_dtype = named
    if layout not in LAYOUTS:
        raise ValueError(f"jax_ncclx.moe.dispatch: layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "masked" and num_experts * capacity > contract.MAX_CAPACITY:
        raise ValueError(f"jax_ncclx.moe.dispatch: with the masked layout num_experts * capacity ({num_experts} * "
                         f"{capacity}) must be at most {contract.MAX_CAPACITY} (rows are indexed with int32)")
    arrays = (tokens, validation.as_int32(expert_ids)) + (() if weights is None else (weights,))
    tokens, expert_ids, *weights = _vary_together(axis_name, arrays)
    if layout == "masked":
        outputs = moe_masked.dispatch(tokens, expert_ids, weights[0] if weights else None,
                                      num_experts=int(num_experts), axis_name=axis_name, capacity=int(capacity),
                                      wire_dtype=wire_dtype)
    else:
        outputs = _dispatch(tokens, weights[0] if weights else None, expert_ids, int(num_experts), axis_name,
                            int(capacity), wire_dtype)
    if config.current().warn_drops:
        health.warn_drops("moe.dispatch", outputs[2].dropped, axis_name, capacity=int(capacity),
                          unit="(token, choice) pairs", detail=f" ({layout} layout)")
    return outputs


def combine(expert_out, handle, weights=None):
    """Sends expert outputs back to their tokens and sums each token's outputs with its router weights.

    ``out[t] = sum_j weights[t, j] * row(t, j)``, where row(t, j) is the row of ``expert_out`` that came
    from pair (t, j). A pair that was dropped or that chose no expert contributes zero. Call it inside the
    same ``jax.shard_map`` as the ``dispatch`` that made ``handle``. It is differentiable in ``expert_out``
    and the weights.

    Two ways, by where the weights are:

    * ``combine(expert_out, handle)``: the weights that ``dispatch`` got (``handle.recv_weights``). Each
      member sums the weighted pairs of each token it holds in float32 and sends one row per token back,
      rounded to expert_out's dtype; the token side adds the members' rows in float32. The same bytes on
      the wire as dispatch (about 3.7 rows per token for top-8 of 32 experts on 4 members instead of 8).
    * ``combine(expert_out, handle, weights)``: one row per pair comes back and the token side scales and
      sums them in float32 (float64 for float64 inputs), rounded once to expert_out's dtype.

    A ``MaskedHandle`` (``layout="masked"``) combines the same two ways: with the weights given to dispatch one
    row per token and member comes back, summed and rounded as above; with the weights here one row per kept
    pair, which the token side scales and sums in float32.

    Args:
      expert_out: ``[N * C, H']`` any float dtype, in dispatch's expert-major layout (masked layout:
        ``[E_local, N * C, H']``). H' may differ from H. Rows past the group sizes are ignored.
      handle: the ``DispatchHandle`` or ``MaskedHandle`` from ``dispatch``.
      weights: None (the weights given to ``dispatch``), or ``[T, k]`` any float dtype, the router weight of
        each (token, choice) pair; then ``dispatch`` must have had none.

    Returns:
      ``[T, H']`` with expert_out's dtype, summed as described above.

    Raises:
      NameError: the handle's axis is not bound by an enclosing ``jax.shard_map``.
      TypeError: handle not a ``DispatchHandle`` or ``MaskedHandle``; expert_out or weights not a float
        dtype.
      ValueError: expert_out not ``[N * capacity, H']`` (masked: ``[E_local, N * capacity, H']``); no weights
        here or at dispatch, or weights at both; weights not ``[T, k]`` like dispatch's expert_ids. Each message
        names the argument and its shape.
    """
    if not isinstance(handle, (DispatchHandle, moe_masked.MaskedHandle)):
        raise TypeError(f"jax_ncclx.moe.combine: handle must be the DispatchHandle or MaskedHandle from dispatch, "
                        f"got {type(handle).__name__}")
    members = jax.lax.axis_size(_check_bound_axis(handle.axis_name, "combine"))
    shape, masked = jnp.shape(expert_out), isinstance(handle, moe_masked.MaskedHandle)
    if masked and (len(shape) != 3 or shape[:2] != (handle.recv_counts.shape[1], members * handle.capacity)):
        raise ValueError(f"jax_ncclx.moe.combine: with a MaskedHandle expert_out must be [E_local, N * capacity, "
                         f"H'] = [{handle.recv_counts.shape[1]}, {members * handle.capacity}, H'] like dispatch's "
                         f"expert_rows, got shape {shape}")
    if not masked and (len(shape) != 2 or shape[0] != members * handle.capacity):
        raise ValueError(f"jax_ncclx.moe.combine: expert_out must be [N * capacity, H'] = "
                         f"[{members * handle.capacity}, H'] like dispatch's expert_rows, got shape {shape}")
    _check_matrix(expert_out, "expert_out", "combine", jnp.floating, rank=len(shape))
    if weights is None:
        if handle.recv_weights is None:
            raise ValueError("jax_ncclx.moe.combine: no weights: pass weights [T, k] here, or pass them to "
                             "dispatch(..., weights=...)")
        (expert_out,) = _vary_together(handle.axis_name, (expert_out,), jax.tree.leaves(handle))
        if isinstance(handle, moe_masked.MaskedHandle):
            return moe_masked.combine(expert_out, handle, None)
        return _combine_reduced(expert_out, handle)
    if handle.recv_weights is not None:
        raise ValueError("jax_ncclx.moe.combine: weights were given to dispatch too; give them to one of the two "
                         "(dispatch, or here), not both")
    _check_matrix(weights, "weights", "combine", jnp.floating)
    pairs_shape = (handle.pair_slot.shape[0] if isinstance(handle, moe_masked.MaskedHandle)
                   else handle.order.shape[0]) // handle.top_k, handle.top_k
    if jnp.shape(weights) != pairs_shape:
        raise ValueError(f"jax_ncclx.moe.combine: weights must be [T, k] = {list(pairs_shape)} like dispatch's "
                         f"expert_ids, got shape {jnp.shape(weights)}")
    expert_out, weights = _vary_together(handle.axis_name, (expert_out, weights), jax.tree.leaves(handle))
    if isinstance(handle, moe_masked.MaskedHandle):
        return moe_masked.combine(expert_out, handle, weights)
    return _combine(expert_out, handle, weights)


# ---- dispatch ----------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _dispatch(tokens, weights, expert_ids, num_experts, axis_name, capacity, wire_dtype):
    out = moe_dispatch.dispatch_rows(tokens, expert_ids, weights, num_experts=num_experts, axis_name=axis_name,
                                     capacity=capacity, wire_dtype=wire_dtype)
    fields = {name: getattr(out, name) for name in _ARRAY_FIELDS if name != "recv_weights"}
    handle = DispatchHandle(**fields, recv_weights=None if weights is None else out.recv_weights,
                            axis_name=axis_name, capacity=capacity, top_k=expert_ids.shape[1])
    return out.expert_rows, out.group_sizes, handle


def _dispatch_fwd(tokens, weights, expert_ids, num_experts, axis_name, capacity, wire_dtype):
    outputs = _dispatch(tokens, weights, expert_ids, num_experts, axis_name, capacity, wire_dtype)
    return outputs, (outputs[2], weights)


def _dispatch_bwd(num_experts, axis_name, capacity, wire_dtype, residuals, cotangents):
    """The rows' cotangents go back summed per token on the expert side; the cotangents of recv_weights (from
    the reduced combine's backward pass) go back as rows of k float32, summed over the members."""
    validation.check_bound_in_backward(axis_name, "moe.dispatch")
    handle, weights = residuals
    ct_rows, _, ct_handle = cotangents
    ct_tokens = _reduce_back(ct_rows, None, handle).astype(ct_rows.dtype)
    ct_weights = None
    if weights is not None:
        ct_weights = _return_per_token(ct_handle.recv_weights, handle).astype(weights.dtype)
    return ct_tokens, ct_weights, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


# ---- combine -----------------------------------------------------------------------------------------------

@jax.custom_vjp
def _combine(expert_out, handle, weights):
    return _weighted_sum(_send_back(expert_out, handle), weights, expert_out.dtype)


def _combine_fwd(expert_out, handle, weights):
    returned = _send_back(expert_out, handle)
    return _weighted_sum(returned, weights, expert_out.dtype), (handle, weights, returned)


def _combine_bwd(residuals, ct_out):
    handle, weights, returned = residuals
    validation.check_bound_in_backward(handle.axis_name, "moe.combine")
    accumulate = _accumulation_dtype(returned, weights)
    per_pair = returned.reshape(*weights.shape, -1).astype(accumulate)
    ct_out = ct_out.astype(accumulate)
    ct_rows = (ct_out[:, None, :] * weights[:, :, None].astype(accumulate)).astype(returned.dtype)
    ct_expert_out = _send_out(ct_rows.reshape(-1, ct_rows.shape[2]), handle)
    ct_weights = (ct_out[:, None, :] * per_pair).sum(axis=2).astype(weights.dtype)
    return ct_expert_out, None, ct_weights


_combine.defvjp(_combine_fwd, _combine_bwd)


@jax.custom_vjp
def _combine_reduced(expert_out, handle):
    return moe_combine.combine_reduced(expert_out, handle.row_pairs, handle.recv_weights, handle.recv_tokens,
                                       handle.send_back_rows, handle.return_row, handle.axis_name)


def _combine_reduced_fwd(expert_out, handle):
    return _combine_reduced(expert_out, handle), (expert_out, handle)


def _combine_reduced_bwd(residuals, ct_out):
    """The output's cotangent goes out to the experts the way dispatch sent the tokens (one row per token
    and member); each pair's row is scaled by its weight, and each weight's cotangent is the dot product of
    its row with the pair's expert output."""
    expert_out, handle = residuals
    validation.check_bound_in_backward(handle.axis_name, "moe.combine")
    received, _, _ = moe_dispatch.exchange(ct_out, handle.token_counts, handle.axis_name, _rows_per_member(handle),
                               send_rows=handle.send_token)
    weights = moe_combine.pair_weights(handle.row_pairs, handle.recv_weights, handle.expand_rows.shape[0])
    per_row = jnp.take(weights.reshape(-1), handle.pair_entry, mode="fill", fill_value=0)
    ct_expert_out = (take_rows(received, handle.expand_rows, sources=handle.row_pairs).astype(jnp.float32)
                     * per_row[:, None])
    pairs = moe_combine.pairs_of_rows(expert_out, handle.row_pairs)
    ct_weights = jnp.sum(pairs * received.astype(jnp.float32)[:, None, :], axis=2)
    # Choices of other members (or dropped) picked zero rows, so their weights get zero cotangents.
    ct_handle = dataclasses.replace(handle, **{**{f: None for f in _ARRAY_FIELDS}, "recv_weights": ct_weights})
    return ct_expert_out.astype(expert_out.dtype), ct_handle


_combine_reduced.defvjp(_combine_reduced_fwd, _combine_reduced_bwd)


def _accumulation_dtype(rows, weights):
    """The weighted sums' dtype: float32 for 16-bit floats, as the kernels'."""
    return validation.accumulation_dtype(jnp.promote_types(rows.dtype, weights.dtype))


def _weighted_sum(returned, weights, dtype):
    """``[T * k, H']`` rows and ``[T, k]`` weights -> ``[T, H']``, summed in _accumulation_dtype and rounded once.

    An elementwise product and a sum, not a dot, so float32 stays exact on GPUs (no TF32).
    """
    accumulate = _accumulation_dtype(returned, weights)
    per_pair = returned.reshape(*weights.shape, -1).astype(accumulate)
    return (per_pair * weights[:, :, None].astype(accumulate)).sum(axis=1).astype(dtype)


# ---- the exchanges, shared by the forward and backward passes -----------------------------------------------

def _send_out(pair_rows, handle):
    """``[T * k, H]`` one row per (token, choice) pair -> ``[N * C, H]`` expert-major rows on the expert side."""
    received, _, _ = moe_dispatch.exchange(pair_rows, handle.send_counts, handle.axis_name, handle.capacity,
                               send_rows=handle.order)
    return take_rows(received, handle.to_expert_major)


def _send_back(expert_rows, handle):
    """``[N * C, H']`` expert-major rows -> ``[T * k, H']`` one per pair on the token side, zero if not delivered."""
    returned, _, _ = moe_dispatch.exchange(expert_rows, handle.recv_counts, handle.axis_name, handle.capacity,
                               send_rows=handle.to_source_major)
    return moe_combine.gather_rows(returned, handle.return_slot)


def _rows_per_member(handle):
    """R = min(C, T): the rows per member of the exchanges that carry one row per token."""
    return handle.row_pairs.shape[0] // jax.lax.axis_size(handle.axis_name)



def _reduce_back(expert_rows, weights, handle):
    """``[N * C, H']`` expert-major rows -> float32 ``[T, H']`` on the token side: each member sums the rows
    of each token's pairs in float32, weighted by ``weights`` (``[N * R, k]``, None: unit weights), and sends
    one row per token back in expert_rows' dtype."""
    return moe_combine.reduce_back(expert_rows, handle.row_pairs, weights, handle.recv_tokens,
                                   handle.send_back_rows, handle.return_row, handle.axis_name)


def _return_per_token(rows, handle):
    """``[N * R, W]``, one row per received token row -> float32 ``[T, W]`` on the token side."""
    return moe_combine.return_per_token(rows, handle.recv_tokens, handle.send_back_rows, handle.return_row,
                                        handle.axis_name)


# ---- argument checks ---------------------------------------------------------------------------------------

def _vary_together(axis_name, arrays, others=()):
    """``arrays`` cast to vary over the mesh axes of ``axis_name`` and every one that they or ``others`` vary
    over.

    Under ``check_vma`` a custom_vjp cotangent must have its input's type. The cotangents mix all the inputs,
    so every input must vary over the union of their axes.
    """
    if not compat.check_vma_enabled():
        return arrays
    axes = frozenset(primitive.manual_axes_of(axis_name)).union(
        *(compat.varying_axes(jax.typeof(a)) for a in (*arrays, *others)))
    return tuple(_vary_over(a, axes) for a in arrays)


def _vary_over(array, axes):
    # Sorted, so every process traces the same program (a frozenset's order follows the string hash seed).
    missing = tuple(sorted(axes - compat.varying_axes(jax.typeof(array)), key=str))
    return jax.lax.pcast(array, missing, to="varying") if missing else array


def _check_bound_axis(axis_name, op):
    axis_name = validation.check_axis_name(axis_name, f"moe.{op}")
    if not validation.is_bound(axis_name):
        raise NameError(f"jax_ncclx.moe.{op}: unbound axis name {axis_name!r}; call it inside jax.shard_map "
                        "over the expert-parallel mesh axis")
    return axis_name


def _check_matrix(x, name, op, kind, rank=2):
    shape, dtype = jnp.shape(x), jax.typeof(x).dtype
    if len(shape) != rank:
        raise ValueError(f"jax_ncclx.moe.{op}: {name} must be {rank}-D, got shape {shape}")
    if not jnp.issubdtype(dtype, kind):
        expected = "a float" if kind is jnp.floating else "an integer"
        raise TypeError(f"jax_ncclx.moe.{op}: {name} must have {expected} dtype, got {dtype}")
