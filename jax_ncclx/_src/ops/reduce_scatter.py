"""reduce_scatter: the members' arrays are summed and member i keeps block i of the sum.

The primitive takes blocks on a leading dimension ([N, *y.shape] -> y, member i gets the sum of block i); the
public function moves ``scatter_dimension`` to the front first. Sharding model: varying in, varying out (as
``jax.lax.psum_scatter``); outside ``shard_map`` the leading dimension of the global array is sharded.
Each of reduce_scatter and all_gather is the other's transpose; both rules are registered here.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad
from jax.interpreters import batching
from jax.sharding import PartitionSpec as P

from jax_ncclx._src import axis_groups
from jax_ncclx._src import contract
from jax_ncclx._src import global_view
from jax_ncclx._src import lowering
from jax_ncclx._src import nvlink
from jax_ncclx._src import primitive
from jax_ncclx._src import validation
from jax_ncclx._src.ops.all_gather import all_gather_p
from jax_ncclx._src.ops.all_to_all import all_to_all


def reduce_scatter(x, axis_name, *, scatter_dimension: int = 0, axis_index_groups=None, tiled: bool = False):
    """Sums ``x`` over the members of ``axis_name`` and scatters the sum along ``scatter_dimension``.

    Args:
      x: array (or pytree); float32/float64/bfloat16/float16, integers, booleans (counted in int32, as
        ``jax.lax.psum`` counts them) or complex numbers (summed as pairs of their real dtype). Untiled,
        ``x.shape[scatter_dimension]`` must equal the axis size N; tiled, it must be a multiple of N.
      axis_name: the mesh axis, or a tuple of axes taken as one (static; the first axis major, as
        ``jax.lax.axis_index`` of the tuple).
      scatter_dimension: the dimension split into N blocks (static).
      axis_index_groups: as in ``jax.lax.psum_scatter`` (static): groups of one size G that cover the axis
        once; each sums and scatters among its own members (N = G above). Run as an all_to_all over the whole
        axis with zeros for the other groups, so it moves N / G times the bytes (docs/api.md, "Groups").
      tiled: if False the scattered dimension is removed; if True it shrinks to ``shape // N`` (static).

    Returns:
      Block ``axis_index`` of the sum, with ``x``'s dtype (int32 for booleans), summed in rank order. Sums of
      16-bit floats accumulate in float32 and round once on the CPU backend and in the GPU NVLink kernel (f32,
      bf16, f16, int32 and complex64 inputs up to ``JAX_NCCLX_NVLINK_MAX_BYTES``, docs/configuration.md); other
      inputs go through NCCL, which accumulates in the input dtype.

    Differentiable (linear; the transpose is an all_gather) and vmap-able, over non-mesh axes (one
    collective) or over the op's own axis (local work, as in ``jax.lax``).

    Raises:
      NameError: ``axis_name`` is not bound by an enclosing ``jax.shard_map`` (and no mesh shards ``x``).
      ValueError: outside ``jax.shard_map``, an argument sharded otherwise than over ``axis_name`` along its
        leading dimension, or whose leading dimension the axis size does not divide.
      ValueError: ``scatter_dimension`` out of range or of the wrong size; an axis named twice;
        ``axis_index_groups`` that do not cover the axis once or differ in size.
      TypeError: ``scatter_dimension`` not a static int; a dtype the op cannot take (not a number or boolean;
        under a byte; an 8-bit float).
      NotImplementedError: vmap over ``axis_name`` inside a tuple with mesh axes; a shard_map that leaves a mesh
        axis of size > 1 to the compiler.
    """
    axis_name = validation.check_axis_name(axis_name, "reduce_scatter")
    scatter_dimension = validation.check_static_int(scatter_dimension, "scatter_dimension", "reduce_scatter")
    if not validation.is_bound(axis_name):
        return global_view.global_view(
            partial(reduce_scatter, axis_name=axis_name, scatter_dimension=scatter_dimension,
                    axis_index_groups=axis_index_groups, tiled=tiled),
            (x,), axis_name, "reduce_scatter", P(axis_name), P(axis_name))
    groups = axis_groups.canonical(axis_index_groups, jax.lax.axis_size(axis_name), "reduce_scatter")
    size = jax.lax.axis_size(axis_name) if groups is None else len(groups[0])

    def one(leaf):
        ndim = jnp.ndim(leaf)
        if not -ndim <= scatter_dimension < ndim:
            raise ValueError(f"jax_ncclx.reduce_scatter: scatter_dimension {scatter_dimension} is out of "
                             f"range for an array of rank {ndim}")
        dim = scatter_dimension % ndim
        extent = leaf.shape[dim]
        if (tiled and extent % size) or (not tiled and extent != size):
            need = f"a multiple of the axis size {size} (tiled)" if tiled else f"the axis size {size}"
            raise ValueError(f"jax_ncclx.reduce_scatter: dimension {dim} has size {extent}; it must be {need}")
        front = jnp.moveaxis(leaf, dim, 0)
        blocks, restore = validation.reduction_operand(front.reshape(size, extent // size, *front.shape[1:]),
                                                      "reduce_scatter", "sum")
        if groups is None:
            y = restore(reduce_scatter_p.bind(primitive.ensure_varying(blocks, axis_name), axis_name=axis_name))
        else:
            y = restore(_sum_within_groups(blocks, axis_name, groups))
        return jnp.moveaxis(y, 0, dim) if tiled else y.reshape(y.shape[1:])

    return jax.tree.map(one, x)


def _sum_within_groups(blocks, axis_name, groups):
    """reduce_scatter of ``blocks`` ``[G, ...]`` within ``groups``: block p goes to the group's p-th member,
    zeros to everyone else, and each member sums what it received in axis order (axis_groups.py)."""
    received = all_to_all(axis_groups.spread_blocks(blocks, groups, axis_name), axis_name, 0, 0)  # [N, ...]
    total = jnp.sum(received, axis=0, dtype=validation.accumulation_dtype(blocks.dtype))
    return total.astype(blocks.dtype)


reduce_scatter_p = primitive.make_collective("reduce_scatter")


def _reduce_scatter_abstract_eval(x, *, axis_name):
    return primitive.output_aval(x, axis_name, shape=x.shape[1:]), primitive.effects(axis_name)


def _reduce_scatter_attrs():
    return {"reduce_op": np.int32(contract.REDUCE_OPS["sum"])}  # enum attributes travel as int32



def _reduce_scatter_batching(axis_data, args, dims, *, axis_name):
    (x,), (d,) = args, dims
    if primitive.batches_own_axis(axis_data, axis_name, "reduce_scatter"):
        members = primitive.members_first(axis_data, x, d)  # [members, blocks, ...]
        total = jnp.sum(members, axis=0, dtype=validation.accumulation_dtype(x.dtype))
        return total.astype(x.dtype), 0  # member m keeps block m
    if d is None:  # a vmap that maps no operand of this call
        return reduce_scatter_p.bind(x, axis_name=axis_name), None
    if d == 0:  # dimension 0 holds the blocks; keep the batch behind it
        x, d = jnp.moveaxis(x, 0, 1), 1
    return reduce_scatter_p.bind(x, axis_name=axis_name), d - 1


def _reduce_scatter_transpose(ct, x, *, axis_name):
    return [all_gather_p.bind(ad.instantiate_zeros(ct), axis_name=axis_name, invariant=False)]


def _all_gather_transpose(ct, x, *, axis_name, invariant=False):
    ct = ad.instantiate_zeros(ct)
    if invariant:  # every member holds the whole cotangent: this member's block of it is its gradient
        mine = jnp.take(ct, jax.lax.axis_index(axis_name), axis=0)
        return [primitive.ensure_varying(mine, axis_name)]
    return [reduce_scatter_p.bind(ct, axis_name=axis_name)]


reduce_scatter_p.def_effectful_abstract_eval(_reduce_scatter_abstract_eval)
lowering.register_lowerings(reduce_scatter_p, "ncclx_reduce_scatter", _reduce_scatter_attrs,
                             nvlink.route_of("reduce_scatter"))
batching.fancy_primitive_batchers[reduce_scatter_p] = _reduce_scatter_batching
ad.deflinear2(reduce_scatter_p, _reduce_scatter_transpose)
ad.deflinear2(all_gather_p, _all_gather_transpose)
