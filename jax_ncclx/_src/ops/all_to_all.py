"""all_to_all: member i splits its array into N blocks and sends block j to member j.

The primitive exchanges blocks of a leading dimension ([N, ...] -> [N, ...], y[j] = x_j[my index]); it is its
own transpose. The public function reshapes ``split_axis`` / ``concat_axis`` around it as
``jax.lax.all_to_all`` defines them. Sharding model: varying in, varying out; outside ``shard_map`` the
leading dimension of the global array is sharded over the axis.
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


def all_to_all(x, axis_name, split_axis: int, concat_axis: int, *, tiled: bool = False):
    """Sends block j of ``x`` (split along ``split_axis``) to member j; received blocks go along
    ``concat_axis``, in source order.

    Args:
      x: array (or pytree) of any number or boolean dtype (float8 and complex included).
      axis_name: the mesh axis, or a tuple of axes taken as one (static; the first axis major, as
        ``jax.lax.axis_index`` of the tuple).
      split_axis: the dimension split into N blocks; untiled its size must be N, tiled a multiple of N (static).
      concat_axis: where the received blocks go (static).
      tiled: False: ``split_axis`` is removed and a new dimension of size N is inserted at ``concat_axis``;
        True: the blocks are concatenated along the existing ``concat_axis`` (static).

    Returns:
      ``jax.lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=tiled)``'s result, with x's dtype:
      untiled, ``x`` without ``split_axis`` and with a dimension of size N inserted at ``concat_axis`` (index
      j: the block from member j); tiled, ``x.shape`` with ``split_axis`` divided by N and ``concat_axis``
      multiplied by N, the blocks in source order.

    Raises:
      NameError: ``axis_name`` is not bound by an enclosing ``jax.shard_map`` (and no mesh shards ``x``).
      ValueError: outside ``jax.shard_map``, an argument sharded otherwise than over ``axis_name`` along its
        leading dimension, or whose leading dimension the axis size does not divide.
      ValueError: an axis out of range, or ``split_axis`` not of size N (untiled) or a multiple of N (tiled).
      TypeError: ``split_axis`` / ``concat_axis`` not a static int; a dtype the op cannot take (not a number or
        boolean, or under a byte).
      NotImplementedError: vmap over ``axis_name`` inside a tuple with mesh axes; a shard_map that leaves a mesh
        axis of size > 1 to the compiler.
    """
    axis_name = primitive.check_axis_name(axis_name, "all_to_all")
    if not primitive.is_bound(axis_name):
        return primitive.global_view(
            partial(all_to_all, axis_name=axis_name, split_axis=split_axis, concat_axis=concat_axis, tiled=tiled),
            (x,), axis_name, "all_to_all", P(axis_name), P(axis_name))
    size = jax.lax.axis_size(axis_name)
    for name, value in (("split_axis", split_axis), ("concat_axis", concat_axis)):
        primitive.check_static_int(value, name, "all_to_all")

    def one(leaf):
        ndim = jnp.ndim(leaf)
        for name, value in (("split_axis", split_axis), ("concat_axis", concat_axis)):
            if not -ndim <= value < ndim:
                raise ValueError(f"jax_ncclx.all_to_all: {name}={value} is out of range for rank {ndim}")
        split, concat = split_axis % ndim, concat_axis % ndim
        extent = leaf.shape[split]
        if (tiled and extent % size) or (not tiled and extent != size):
            need = f"a multiple of the axis size {size} (tiled)" if tiled else f"the axis size {size}"
            raise ValueError(f"jax_ncclx.all_to_all: split_axis {split} has size {extent}; it must be {need}")
        primitive.check_dtype(leaf, "all_to_all")
        front = jnp.moveaxis(leaf, split, 0)
        blocks = front.reshape(size, extent // size, *front.shape[1:])
        y = all_to_all_p.bind(primitive.ensure_varying(blocks, axis_name), axis_name=axis_name)
        if config.current().checksum:
            checksum.verify_all_to_all(axis_name, blocks, y)
        y = jnp.moveaxis(y, 1, split + 1)  # [N, *leaf.shape with extent/N at split]
        if not tiled:
            y = y.reshape(y.shape[0], *leaf.shape[:split], *leaf.shape[split + 1:])  # drop the size-1 split
            return jnp.moveaxis(y, 0, concat)
        y = jnp.moveaxis(y, 0, concat)  # [..., N, shape[concat], ...]
        return y.reshape(*y.shape[:concat], y.shape[concat] * y.shape[concat + 1], *y.shape[concat + 2:])

    return jax.tree.map(one, x)


all_to_all_p = primitive.make_collective("all_to_all")


def _all_to_all_abstract_eval(x, *, axis_name):
    return primitive.output_aval(x, axis_name), primitive.effects(axis_name)



def _all_to_all_batching(axis_data, args, dims, *, axis_name):
    (x,), (d,) = args, dims
    if primitive.batches_own_axis(axis_data, axis_name, "all_to_all"):
        return jnp.swapaxes(primitive.members_first(axis_data, x, d), 0, 1), 0  # block m of source j: [m, j]
    if d == 0:  # dimension 0 holds the blocks; keep the batch behind it
        x, d = jnp.moveaxis(x, 0, 1), 1
    return all_to_all_p.bind(x, axis_name=axis_name), d


def _all_to_all_transpose(ct, x, *, axis_name):
    return [all_to_all_p.bind(ad.instantiate_zeros(ct), axis_name=axis_name)]


all_to_all_p.def_effectful_abstract_eval(_all_to_all_abstract_eval)
primitive.register_lowerings(all_to_all_p, "ncclx_all_to_all", cuda_route=nvlink.route_of("all_to_all"))
batching.fancy_primitive_batchers[all_to_all_p] = _all_to_all_batching
ad.deflinear2(all_to_all_p, _all_to_all_transpose)
