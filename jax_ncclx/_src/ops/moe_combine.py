"""moe.combine with the weights given to dispatch, as one op: each member sums the weighted pairs of every
token row it received and sends the sums back; each token side adds its members' rows.

``combine_reduced`` takes the parts of a ``DispatchHandle`` this needs (shapes: N members, C capacity,
R = min(C, T) token rows per member, T tokens, k choices):

- expert_out ``[N * C, H']`` float, dispatch's expert-major rows after the experts;
- row_pairs int32 ``[N * R, k]``, the expert-major row of each received row's choice (``N * C``: none here);
- weights float32 ``[N * R, k]``, their router weights;
- recv_tokens int32 ``[N]``, token rows each source delivered (source i's at rows i * R);
- send_back_rows int32 ``[N * R]``, the received rows packed source-major (the exchange chain's send order);
- return_row int32 ``[T, N]``, where token t's row from member m lands (``N * R``: t was not sent to m);

and returns ``[T, H']`` in expert_out's dtype. Each member's sum is taken in float32 and rounded to
expert_out's dtype once; the token side adds the members' rows in float32, in member order.

On CUDA it is one NVLink kernel (``ncclx_moe_combine_nvlink``, xla_ffi/ops/moe/moe_combine.h) where the kernel can
run: the communicator reaches every member through NVLink; expert_out is float32, bfloat16 or float16 with rows
of a multiple of 16 bytes; top-k is at most the kernel's ``MOE_COMBINE_MAX_TOP_K`` (256); and a member's R
rows take at most ``KERNEL_MAX_MEMBER_BYTES`` (64 MiB: up to 4096 tokens of 7168 bf16). Elsewhere, on the CPU
and on NCCL, it is the exchange chain of other jax_ncclx ops (:func:`reduce_back`): a gather and sum,
one ``all_to_allv_dynamic``, a gather and sum. Both compute the same thing; which one a call site takes is
logged at debug level. Its timeout is all_to_allv_dynamic's (``JAX_NCCLX_TIMEOUT_S_ALL_TO_ALLV_DYNAMIC``), as
for the rest of ``jax_ncclx.moe``.

Sharding model: every operand varies over the axis, and so does the result. Batching: the exchange chain,
vmapped. No AD rules: ``jax_ncclx.moe.combine``'s custom VJP differentiates it.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jax_ncclx._src import contract
from jax_ncclx._src import lib
from jax_ncclx._src import lowering
from jax_ncclx._src import nvlink
from jax_ncclx._src import primitive
from jax_ncclx._src.ops.all_to_allv_dynamic import all_to_allv_dynamic


# The most bytes of rows one member's share of the kernel's slots may hold (R rows of H'). The slots stay in
# symmetric memory for the communicator's life, two calls' worth (2 * N * R * H' bytes), where the exchange
# chain's buffers are XLA temporaries; above this the chain, a little slower, keeps memory bounded.
KERNEL_MAX_MEMBER_BYTES = 64 << 20


def combine_reduced(expert_out, row_pairs, weights, recv_tokens, send_back_rows, return_row, axis_name):
    """``[T, H']`` (expert_out's dtype): token t's rows from every member, each the float32 sum of
    ``weights * expert_out`` over t's pairs there, rounded to expert_out's dtype, added in float32. Shapes as in
    the module docstring; call it inside ``jax.shard_map`` over ``axis_name``."""
    return moe_combine_p.bind(expert_out, row_pairs, weights, recv_tokens, send_back_rows, return_row,
                              axis_name=axis_name)


# ---- the exchange chain: the same computation in other jax_ncclx ops ---------------------------------------

def gather_rows(rows, index):
    """``rows[index]``, zero where the index is out of bounds (the routing's rows past the data). An XLA gather,
    not ``take_rows``: its users reduce the rows right away, and XLA fuses the gather into that reduction."""
    dimensions = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
    return jax.lax.gather(rows, index[:, None], dimensions, slice_sizes=(1, rows.shape[1]),
                          mode=jax.lax.GatherScatterMode.FILL_OR_DROP, fill_value=0)


def pairs_of_rows(expert_rows, row_pairs):
    """``[N * C, H']`` expert-major rows -> float32 ``[N * R, k, H']``: the rows of each received row's pairs,
    zero where a choice is not this member's."""
    picked = gather_rows(expert_rows, row_pairs.reshape(-1))
    return picked.reshape(*row_pairs.shape, -1).astype(jnp.float32)


def return_per_token(rows, recv_tokens, send_back_rows, return_row, axis_name):
    """``[N * R, W]``, one row per received token row (source i's from row i * R) -> float32 ``[T, W]`` on
    the token side: each member sends its rows back to their sources, which add up each token's rows."""
    num_tokens, num_members = return_row.shape
    returned, _, _ = all_to_allv_dynamic(rows, recv_tokens, axis_name,
                                         max_recv_per_peer=rows.shape[0] // num_members, layout="padded",
                                         send_rows=send_back_rows)
    returned = returned.reshape(-1, returned.shape[2])
    per_member = gather_rows(returned, return_row.reshape(-1)).reshape(num_tokens, num_members, -1)
    return per_member.astype(jnp.float32).sum(axis=1)


def pair_weights(row_pairs, weights, expert_rows: int):
    """float32 ``[N * R, k]``: each received row's weight for each choice, zero where the choice is not this
    member's (or was dropped): where ``row_pairs`` is at or past ``expert_rows`` (N * C)."""
    return jnp.where(row_pairs < expert_rows, weights, 0.0)


def reduce_back(expert_rows, row_pairs, weights, recv_tokens, send_back_rows, return_row, axis_name):
    """float32 ``[T, H']``: the sum of ``combine_reduced`` before its final rounding, by the exchange chain.
    ``weights`` None: unit weights (dispatch's backward pass)."""
    picked = pairs_of_rows(expert_rows, row_pairs)
    if weights is None:
        summed = picked.sum(axis=1)
    else:
        here = pair_weights(row_pairs, weights, expert_rows.shape[0])
        summed = jnp.sum(picked * here[:, :, None], axis=1)
    return return_per_token(summed.astype(expert_rows.dtype), recv_tokens, send_back_rows, return_row, axis_name)


def _exchange_chain(expert_out, row_pairs, weights, recv_tokens, send_back_rows, return_row, *, axis_name):
    summed = reduce_back(expert_out, row_pairs, weights, recv_tokens, send_back_rows, return_row, axis_name)
    return summed.astype(expert_out.dtype)


# ---- the primitive -----------------------------------------------------------------------------------------

moe_combine_p = primitive.make_collective("moe_combine")


def _moe_combine_abstract_eval(expert_out, row_pairs, weights, recv_tokens, send_back_rows, return_row, *,
                               axis_name):
    shape = (return_row.shape[0], expert_out.shape[1])
    aval = primitive.output_aval(expert_out, axis_name, row_pairs, weights, recv_tokens, send_back_rows,
                                 return_row, shape=shape)
    return aval, primitive.effects(axis_name)


def _route(ctx, comm_id, size):
    """The NVLink kernel's route, or None (the exchange chain) where it cannot run."""
    expert_out, row_pairs = ctx.avals_in[0], ctx.avals_in[1]
    dtype, hidden = np.dtype(expert_out.dtype), expert_out.shape[1]
    module = lib.cuda_module()
    rows_per_member = row_pairs.shape[0] // size
    why = None
    if dtype.name not in contract.FLOAT_TYPES or hidden * dtype.itemsize % 16:
        why = f"{dtype} rows of {hidden} (the kernel moves float32, bfloat16 and float16 rows of 16-byte multiples)"
    elif row_pairs.shape[1] > module.MOE_COMBINE_MAX_TOP_K:
        why = f"top-{row_pairs.shape[1]} (the kernel takes up to top-{module.MOE_COMBINE_MAX_TOP_K})"
    elif rows_per_member * hidden * dtype.itemsize > KERNEL_MAX_MEMBER_BYTES:
        why = (f"{rows_per_member} rows of {hidden * dtype.itemsize} bytes per member (more than the kernel's "
               f"{KERNEL_MAX_MEMBER_BYTES})")
    slots = module.moe_combine_slot_bytes(size, rows_per_member, hidden, dtype.itemsize) if why is None else 0
    return nvlink.kernel_route("moe.combine", comm_id, why, slots,
                               operands=(0, 1, 2, 3, 5))  # send_back_rows is the chain's only


moe_combine_p.def_effectful_abstract_eval(_moe_combine_abstract_eval)
lowering.register_lowerings(moe_combine_p, "ncclx_moe_combine", cuda_route=_route, fallback=_exchange_chain,
                             timeout_op="all_to_allv_dynamic")
primitive.batch_by_chain(moe_combine_p, _exchange_chain)
