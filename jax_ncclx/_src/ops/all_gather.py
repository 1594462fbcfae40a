"""all_gather: every member of a mesh-axis group gets all members' arrays, stacked or concatenated.

The primitive gathers onto a new leading dimension ([N, *x.shape], entry i from axis index i); the public
function moves that dimension to ``axis`` and merges it for ``tiled``, so the FFI call always moves
contiguous blocks. Sharding model: varying in, varying out (as ``jax.lax.all_gather``); outside
``shard_map`` the leading dimension of the global array is sharded over the axis.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax.interpreters import ad
from jax.interpreters import batching
from jax.sharding import PartitionSpec as P

from jax_ncclx._src import checksum
from jax_ncclx._src import config
from jax_ncclx._src import nvlink
from jax_ncclx._src import primitive


def all_gather(x, axis_name, *, axis: int = 0, tiled: bool = False):
    """Gathers ``x`` from every member of the mesh axis ``axis_name``.

    Args:
      x: array (or pytree) of any shape and of any number or boolean dtype (float8 and complex included).
      axis_name: the mesh axis to gather over, or a tuple of axes taken as one (static; the first axis major,
        as ``jax.lax.axis_index`` of the tuple).
      axis: where the gathered dimension goes in the result (static; negative counts from the end).
      tiled: if False the result has a new dimension of size N at ``axis``; if True the members' arrays are
        concatenated along the existing dimension ``axis`` (static).

    Returns:
      ``[..., N, ...]`` (stacked) or ``x.shape`` with ``shape[axis] * N`` (tiled); block i comes from axis
      index i. Same dtype as ``x``.

    Raises:
      NameError: ``axis_name`` is not bound by an enclosing ``jax.shard_map`` (and no mesh shards ``x``).
      ValueError: outside ``jax.shard_map``, an argument sharded otherwise than over ``axis_name`` along its
        leading dimension, or whose leading dimension the axis size does not divide.
      ValueError: ``axis`` out of range; an axis named twice.
      TypeError: a dtype the op cannot take (not a number or boolean, or under a byte); ``axis`` not a static
        int.
      NotImplementedError: vmap over ``axis_name`` inside a tuple with mesh axes; a shard_map that leaves a mesh
        axis of size > 1 to the compiler.
    """
    axis_name = primitive.check_axis_name(axis_name, "all_gather")
    if not primitive.is_bound(axis_name):
        return primitive.global_view(partial(all_gather, axis_name=axis_name, axis=axis, tiled=tiled), (x,),
                                     axis_name, "all_gather", P(axis_name), P(axis_name))

    def one(leaf):
        primitive.check_dtype(leaf, "all_gather")
        ndim = jnp.ndim(leaf)
        out_axis = _normalize_axis(axis, ndim if tiled else ndim + 1, "all_gather")
        y = all_gather_p.bind(primitive.ensure_varying(leaf, axis_name), axis_name=axis_name)
        if config.current().checksum:
            checksum.verify_all_gather(axis_name, leaf, y)
        y = jnp.moveaxis(y, 0, out_axis)
        if tiled:
            shape = y.shape
            y = y.reshape(*shape[:out_axis], shape[out_axis] * shape[out_axis + 1], *shape[out_axis + 2:])
        return y

    return jax.tree.map(one, x)


def _normalize_axis(axis: int, ndim: int, op: str) -> int:
    axis = primitive.check_static_int(axis, "axis", op)
    if not -ndim <= axis < ndim:
        raise ValueError(f"jax_ncclx.{op}: axis {axis} is out of range for a result of rank {ndim}")
    return axis % ndim


all_gather_p = primitive.make_collective("all_gather")


def _all_gather_abstract_eval(x, *, axis_name):
    size = jax.lax.axis_size(axis_name)
    return primitive.output_aval(x, axis_name, shape=(size, *x.shape)), primitive.effects(axis_name)



def _all_gather_batching(axis_data, args, dims, *, axis_name):
    (x,), (d,) = args, dims
    if primitive.batches_own_axis(axis_data, axis_name, "all_gather"):
        return primitive.members_first(axis_data, x, d), None  # every member gathers the same blocks
    return all_gather_p.bind(x, axis_name=axis_name), d + 1


def _all_gather_transpose(ct, x, *, axis_name):
    from jax_ncclx._src.ops.reduce_scatter import reduce_scatter_p

    return [reduce_scatter_p.bind(ad.instantiate_zeros(ct), axis_name=axis_name)]


all_gather_p.def_effectful_abstract_eval(_all_gather_abstract_eval)
primitive.register_lowerings(all_gather_p, "ncclx_all_gather", cuda_route=nvlink.route_of("all_gather"))
batching.fancy_primitive_batchers[all_gather_p] = _all_gather_batching
ad.deflinear2(all_gather_p, _all_gather_transpose)
