"""The routing arithmetic of ``jax_ncclx.moe.dispatch``, as two local ops (no communication).

``plan_sends`` runs on the sender before the exchange, ``place_received`` on the receiver after it. Each is one
custom call: a CUDA kernel on one thread block cluster (``xla_ffi/ops/moe/moe_routing_kernels.cu``), a loop on CPU
(``moe_routing_cpu.cc``), where the same arithmetic in ``jax.numpy`` took ~20 XLA kernels of ~1.4 µs each.
The docstrings below are the specification both handlers follow; ``tests/reference.py`` implements it in
NumPy.

Both primitives are batched: every operand and result has a leading batch dimension B, which is how ``vmap``
stays one call. Their results are indices, counts and bits that ride through the exchange, so they have no
derivative (moe's custom VJP rules carry the router weights' gradient). Sharding model: per device, like any
elementwise op inside ``shard_map``.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad
from jax.interpreters import batching

from jax_ncclx._src import contract
from jax_ncclx._src import lib
from jax_ncclx._src import lowering
from jax_ncclx._src import primitive



class SendPlan(NamedTuple):
    """What one member sends in ``dispatch``, all int32 (N members, E experts, T tokens, k choices, S rows)."""

    order: jax.Array         # [T * k] the (token, choice) pairs sorted stably by expert, no-expert pairs last
    send_counts: jax.Array   # [N, E / N] pairs for each expert
    send_token: jax.Array    # [S] the token of each send row; T past the data
    send_suffix: jax.Array   # [S, suffix_words(k, weights)] what each row carries after its token (plan_sends)
    token_counts: jax.Array  # [N] send rows for each member
    return_slot: jax.Array   # [T * k] where each pair's output comes back in combine; N * C if nowhere
    return_row: jax.Array    # [T, N] where each token's row comes back from each member, one row per token
    dropped: jax.Array       # [N] pairs for each member past the capacity


class Placement(NamedTuple):
    """Where one member puts what it received in ``dispatch``, all int32 (E_local local experts)."""

    recv_counts: jax.Array      # [N, E_local] pairs each source delivered for each local expert
    group_sizes: jax.Array      # [E_local] pairs for each local expert (recv_counts summed over sources)
    expand_rows: jax.Array      # [N * C] the received row of each expert-major row; N * R past the data
    to_expert_major: jax.Array  # [N * C] the same for the one-row-per-pair exchanges; N * C past the data
    to_source_major: jax.Array  # [N * C] the expert-major row of each row sent back; N * C past the data
    pair_entry: jax.Array       # [N * C] received row * k + choice of each expert-major row; N * R * k past it
    row_pairs: jax.Array        # [N * R, k] the inverse: expert-major row of each (received row, choice)
    send_back_rows: jax.Array   # [N * R] every source's received rows, packed from row 0; N * R after them
    recv_weights: jax.Array     # float32 [N * R, k] the router weights in the suffixes ([N * R, 0] without)


def suffix_words(top_k: int, with_weights: bool) -> int:
    """Words (int32) of a send row's suffix: k tags padded to a multiple of 4 (16 bytes, so that rows of
    16-byte multiples stay so), then as many for the weights (SuffixWords in xla_ffi/ops/moe/moe_routing.h)."""
    return -(-top_k // 4) * 4 * (2 if with_weights else 1)


def num_send_rows(num_tokens: int, top_k: int, num_members: int, capacity: int) -> int:
    """S: a member takes at most C pairs and one row per token, and a token goes to at most min(k, N)
    members."""
    return min(num_tokens * min(top_k, num_members), num_members * capacity)


def plan_sends(expert_ids, weights=None, *, num_experts: int, num_members: int, capacity: int) -> SendPlan:
    """Plans dispatch's sends: each token goes once to each member that takes at least one of its pairs.

    Pair p = t * k + j is token t's j-th choice. Its key is its expert id, or E when the id is outside
    ``[0, E)`` (no expert). ``order`` sorts the pairs by key, stably. Member m owns experts
    ``[m * E / N, (m + 1) * E / N)`` and takes the first C of its pairs in that order (``dropped[m]`` counts
    the rest); those pairs are delivered. A delivered pair's ``return_slot`` is ``m * C`` plus its place among
    m's pairs.

    Token t goes to member m when m takes at least one of its pairs. The send rows list the tokens going to
    member 0 in ascending order, then those going to member 1, and so on (``send_token``, ``token_counts``).
    The tags of member m's rows, read as one list of ``token_counts[m] * k`` entries, hold its delivered pairs
    in order, each as ``(row * k + j) * E_local + local expert`` for the pair t * k + j (``row`` counted from
    m's first row), then -1. A token has at most k pairs per member, so the list fits.

    ``send_suffix`` is what each send row carries after its token: its k tags (columns ``[0, k)``, -1 up to
    ``k4``, k rounded up to a multiple of 4), then, with ``weights``, the k weights of its token as float32
    bits (columns ``[k4, k4 + k)``, zeros up to ``2 * k4``; zeros on rows past the data).

    When rows come back one per token (a reduced combine), member m returns its R = min(C, T) rows in the
    order it got them: ``return_row[t, m] = m * R + row`` for token t's row among m's, and N * R where t was
    not sent to m.

    Args:
      expert_ids: int32 ``[T, k]``.
      weights: None, or ``[T, k]`` floats (carried as float32).
      num_experts, num_members, capacity: E <= 2048 (a multiple of N), N >= 1, C >= 1 (static).

    Returns:
      A :class:`SendPlan` with S = ``num_send_rows(T, k, N, C)``.
    """
    _check_sizes(num_experts=num_experts, num_members=num_members, capacity=capacity)
    operands = [jnp.asarray(expert_ids, jnp.int32)[None]]
    if weights is not None:
        operands.append(jnp.asarray(weights, jnp.float32)[None])
    outs = plan_sends_p.bind(*operands, num_experts=int(num_experts), num_members=int(num_members),
                             capacity=int(capacity))
    return SendPlan(*(out[0] for out in outs))


def place_received(received, recv_tokens, *, local_experts: int, capacity: int, top_k: int, suffix_offset: int,
                   with_weights: bool = False) -> Placement:
    """Places the pairs that arrived in dispatch's exchange into the expert-major layout.

    Source i's rows sit at rows ``[i * R, (i + 1) * R)`` of the exchange's padded layout, of which the first
    ``recv_tokens[i]`` hold data. Each row carries a send suffix (:func:`plan_sends`) from byte
    ``suffix_offset`` on, which need not be aligned. The tags of source i's rows, read as one list, are its
    pairs as :func:`plan_sends` wrote them; a tag counts when it is >= 0. Expert-major block (e, i) holds source i's
    pairs for local expert e, and the blocks are packed in the order (0, 0), (0, 1), ..., (1, 0), ... from
    row 0 of N * C rows; rows past the data (or past N * C) get the "past the data" index. Row x of block
    (e, i) is the r-th pair of the block, the entry ``start + r`` of source i's list, where start counts
    source i's pairs for experts before e:

    * ``expand_rows[x] = i * R + tag // (k * E_local)``, the received row holding the pair's token (N * R
      when the tag is negative or names a row >= R);
    * ``to_expert_major[x] = i * C + start + r``: where the exchanges that carry one row per pair (combine,
      the backward passes) put the pair (N * C when ``start + r >= C``: more than a source can send);
    * ``to_source_major`` is the inverse regrouping: row x of the source-major packing of the same blocks
      ((0, 0), (0, 1) for experts, then source 1, ...) takes expert-major row ``to_source_major[x]`` (at most
      N * C).
    * ``pair_entry[x] = (i * R + row) * k + j`` for the tag ``(row * k + j) * E_local + e`` (N * R * k where
      ``expand_rows`` has N * R), and ``row_pairs`` is its inverse: ``row_pairs[i * R + row, j] = x``, N * C
      where no row names that entry. (Tags that name one entry twice, which plan_sends never writes, leave one
      of the rows there.)

    ``send_back_rows`` packs the received rows for sending one row per token back: source 0's first
    ``recv_tokens[0]`` rows (clamped to [0, R]), then source 1's, ..., then N * R. ``recv_weights`` are the
    weights in the rows' suffixes (``with_weights``).

    Args:
      received: ``[N * R, ...]`` any dtype, the exchange's rows.
      recv_tokens: int32 ``[N]``, rows each source delivered.
      local_experts, capacity: E_local >= 1 (N * E_local <= 2048), C >= 1 (static).
      top_k, suffix_offset, with_weights: k, where the suffix starts in a row (bytes), and whether it holds
        weights (static).

    Returns:
      A :class:`Placement`.
    """
    num_members = jnp.shape(recv_tokens)[0]
    _check_sizes(num_experts=num_members * local_experts, num_members=num_members, capacity=capacity)
    outs = place_received_p.bind(jnp.asarray(received)[None], jnp.asarray(recv_tokens, jnp.int32)[None],
                                 local_experts=int(local_experts), capacity=int(capacity), top_k=int(top_k),
                                 suffix_offset=int(suffix_offset), with_weights=bool(with_weights))
    return Placement(*(out[0] for out in outs))


def _check_sizes(*, num_experts, num_members, capacity):
    if not 1 <= num_experts <= contract.MAX_EXPERTS or num_experts % num_members:
        raise ValueError(f"jax_ncclx.moe: num_experts must be a multiple of the axis size ({num_members}) and at "
                         f"most {contract.MAX_EXPERTS} (the routing kernels count experts in shared memory), got "
                         f"{num_experts}")
    if not 1 <= capacity <= contract.MAX_CAPACITY:
        raise ValueError(f"jax_ncclx.moe: capacity must be 1 to {contract.MAX_CAPACITY}, got {capacity}")


plan_sends_p = primitive.make_local("moe_plan_sends", multiple_results=True)
place_received_p = primitive.make_local("moe_place_received", multiple_results=True)


def _int32(aval, *shape):
    return primitive.output_aval(aval, None, shape=shape, dtype=jnp.int32)


def _plan_sends_abstract_eval(expert_ids, *weights, num_experts, num_members, capacity):
    batch, num_tokens, top_k = expert_ids.shape
    rows = num_send_rows(num_tokens, top_k, num_members, capacity)
    pairs = num_tokens * top_k
    words = suffix_words(top_k, bool(weights))
    return [_int32(expert_ids, batch, pairs), _int32(expert_ids, batch, num_members, num_experts // num_members),
            _int32(expert_ids, batch, rows), _int32(expert_ids, batch, rows, words),
            _int32(expert_ids, batch, num_members), _int32(expert_ids, batch, pairs),
            _int32(expert_ids, batch, num_tokens, num_members), _int32(expert_ids, batch, num_members)]


def _place_received_abstract_eval(rows_in, recv_tokens, *, local_experts, capacity, top_k, suffix_offset,
                                  with_weights):
    batch, num_members = recv_tokens.shape
    rows = num_members * capacity
    received = rows_in.shape[1]
    weights = primitive.output_aval(rows_in, None, shape=(batch, received, top_k if with_weights else 0),
                                    dtype=jnp.float32)
    return [_int32(rows_in, batch, num_members, local_experts), _int32(rows_in, batch, local_experts),
            _int32(rows_in, batch, rows), _int32(rows_in, batch, rows), _int32(rows_in, batch, rows),
            _int32(rows_in, batch, rows), _int32(rows_in, batch, received, top_k), _int32(rows_in, batch, received),
            weights]


def _plan_sends_scratch_bytes(avals_in, *, num_members, **params):
    batch, num_tokens, _ = avals_in[0].shape
    return lib.cuda_module().moe_plan_sends_scratch_bytes(batch, num_tokens, num_members)


def _jvp(prim, primals, tangents, **params):
    outs = prim.bind(*primals, **params)
    return outs, [ad.Zero(jax.typeof(out).to_tangent_aval()) for out in outs]


plan_sends_p.def_abstract_eval(_plan_sends_abstract_eval)
place_received_p.def_abstract_eval(_place_received_abstract_eval)
lowering.register_local_lowerings(
    plan_sends_p, "ncclx_moe_plan_sends",
    # Decoded as PlanSendsAttrs and PlaceReceivedAttrs (xla_ffi/ops/moe/moe_routing_checks.h).
    lambda *, num_experts, num_members, capacity: dict(plan=dict(num_experts=np.int64(num_experts),
                                                                 num_members=np.int64(num_members),
                                                                 capacity=np.int64(capacity))),
    cuda_scratch_bytes=_plan_sends_scratch_bytes)
lowering.register_local_lowerings(
    place_received_p, "ncclx_moe_place_received",
    lambda *, local_experts, capacity, top_k, suffix_offset, with_weights: dict(place=dict(
        local_experts=np.int64(local_experts), capacity=np.int64(capacity), top_k=np.int64(top_k),
        suffix_offset=np.int64(suffix_offset), with_weights=np.bool_(with_weights))))
for _prim in (plan_sends_p, place_received_p):
    batching.fancy_primitive_batchers[_prim] = functools.partial(primitive.fold_vmap_into_batch, _prim)
    ad.primitive_jvps[_prim] = functools.partial(_jvp, _prim)
