"""all_to_all: member i splits its array into N blocks and sends block j to member j.

The primitive exchanges blocks of a leading dimension ([N, ...] -> [N, ...], y[j] = x_j[my index]); it is its
own transpose. The public function reshapes ``split_axis`` / ``concat_axis`` around it as
``jax.lax.all_to_all`` defines them. Sharding model: varying in, varying out; outside ``shard_map`` the
leading dimension of the global array is sharded over the axis.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad
from jax.interpreters import batching
from jax.sharding import PartitionSpec as P

from jax_ncclx._src import axis_groups
from jax_ncclx._src import checksum
from jax_ncclx._src import config
from jax_ncclx._src import global_view
from jax_ncclx._src import lowering
from jax_ncclx._src import nvlink
from jax_ncclx._src import primitive
from jax_ncclx._src import validation


def all_to_all(x, axis_name, split_axis: int, concat_axis: int, *, axis_index_groups=None, tiled: bool = False):
    """Sends block j of ``x`` (split along ``split_axis``) to member j; received blocks go along
    ``concat_axis``, in source order.

    Args:
      x: array (or pytree) of any number or boolean dtype (float8 and complex included).
      axis_name: the mesh axis, or a tuple of axes taken as one (static; the first axis major, as
        ``jax.lax.axis_index`` of the tuple).
      split_axis: the dimension split into N blocks; untiled its size must be N, tiled a multiple of N (static).
      concat_axis: where the received blocks go (static).
      axis_index_groups: as in ``jax.lax.all_to_all`` (static): groups of one size G that cover the axis once;
        each exchanges among its own members (N = G here). Run over the whole axis with zero blocks for the
        other groups, so it moves N / G times the bytes (docs/api.md, "Groups").
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
      ValueError: an axis out of range, or ``split_axis`` not of size N (untiled) or a multiple of N (tiled);
        ``axis_index_groups`` that do not cover the axis once or differ in size.
      TypeError: ``split_axis`` / ``concat_axis`` not a static int; a dtype the op cannot take (not a number or
        boolean, or under a byte).
      NotImplementedError: a shard_map that leaves a mesh axis of size > 1 to the compiler.

    Differentiable (its own transpose) and vmap-able: over non-mesh axes (one collective), over the op's own
    axis (local work), and over an axis in a tuple with others, vmapped or mesh axes (as ``jax.lax``: the
    vmapped part is a local transpose, the rest one all_to_all).
    """
    axis_name = validation.check_axis_name(axis_name, "all_to_all")
    if not validation.is_bound(axis_name):
        return global_view.global_view(
            partial(all_to_all, axis_name=axis_name, split_axis=split_axis, concat_axis=concat_axis,
                    axis_index_groups=axis_index_groups, tiled=tiled),
            (x,), axis_name, "all_to_all", P(axis_name), P(axis_name))
    groups = axis_groups.canonical(axis_index_groups, jax.lax.axis_size(axis_name), "all_to_all")
    size = jax.lax.axis_size(axis_name) if groups is None else len(groups[0])
    for name, value in (("split_axis", split_axis), ("concat_axis", concat_axis)):
        validation.check_static_int(value, name, "all_to_all")

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
        validation.check_dtype(leaf, "all_to_all")
        front = jnp.moveaxis(leaf, split, 0)
        blocks = front.reshape(size, extent // size, *front.shape[1:])
        if groups is None:
            y = all_to_all_p.bind(primitive.ensure_varying(blocks, axis_name), axis_name=axis_name)
            if config.current().checksum:
                checksum.verify_all_to_all(axis_name, blocks, y)
        else:  # block p to the group's p-th member, zeros elsewhere; keep what the group sent, in group order
            spread = axis_groups.spread_blocks(blocks, groups, axis_name)
            received = all_to_all_p.bind(primitive.ensure_varying(spread, axis_name), axis_name=axis_name)
            y = jnp.take(received, axis_groups.members(groups, axis_name), axis=0)
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
    axes = validation.axes_of(axis_name)
    if axis_data.name in axes and len(axes) > 1:
        return _exchange_over_tuple_with_vmapped_axis(axis_data, x, d, axes), 0
    if primitive.batches_own_axis(axis_data, axis_name, "all_to_all"):
        return jnp.swapaxes(primitive.members_first(axis_data, x, d), 0, 1), 0  # block m of source j: [m, j]
    if d == 0:  # dimension 0 holds the blocks; keep the batch behind it
        x, d = jnp.moveaxis(x, 0, 1), 1
    return all_to_all_p.bind(x, axis_name=axis_name), d


def _exchange_over_tuple_with_vmapped_axis(axis_data, x, d, axes):
    """all_to_all over a tuple of axes, one of them vmapped: member (s_1..s_k) sends block (b_1..b_k) of its
    [N, ...] blocks to member (b_1..b_k). Along the vmapped axis m all members are here, so the exchange along
    m is a local swap of the member and block indices; the rest is an all_to_all over the other axes, which
    carries the source's index along m with each block. Returns [members along m, N, ...]."""
    m = axes.index(axis_data.name)
    sizes = [axis_data.size if name == axis_data.name else jax.lax.axis_size(name) for name in axes]
    others = tuple(name for name in axes if name != axis_data.name)
    blocks = primitive.members_first(axis_data, x, d)            # [s_m, N, ...]
    rest = blocks.shape[2:]
    blocks = blocks.reshape(sizes[m], *sizes, *rest)             # [s_m, b_1 .. b_k, ...]
    blocks = jnp.swapaxes(blocks, 0, 1 + m)                      # [b_m, b_1 .. s_m .. b_k, ...]
    other_dims = [1 + i for i in range(len(axes)) if i != m]
    blocks = jnp.moveaxis(blocks, other_dims, list(range(len(others))))  # [b_others, b_m, s_m, ...]
    other_size = int(np.prod([sizes[i] for i in range(len(axes)) if i != m]))
    blocks = blocks.reshape(other_size, sizes[m], sizes[m], *rest)
    y = all_to_all_p.bind(blocks, axis_name=others if len(others) > 1 else others[0])  # [s_others, b_m, s_m, ...]
    y = y.reshape(*[sizes[i] for i in range(len(axes)) if i != m], sizes[m], sizes[m], *rest)
    y = jnp.moveaxis(y, len(others), 0)                          # [b_m, s_others, s_m, ...]
    y = jnp.moveaxis(y, len(others) + 1, 1 + m)                  # [b_m, s_1 .. s_k, ...]
    return y.reshape(sizes[m], int(np.prod(sizes)), *rest)


def _all_to_all_transpose(ct, x, *, axis_name):
    return [all_to_all_p.bind(ad.instantiate_zeros(ct), axis_name=axis_name)]


all_to_all_p.def_effectful_abstract_eval(_all_to_all_abstract_eval)
lowering.register_lowerings(all_to_all_p, "ncclx_all_to_all", cuda_route=nvlink.route_of("all_to_all"))
batching.fancy_primitive_batchers[all_to_all_p] = _all_to_all_batching
ad.deflinear2(all_to_all_p, _all_to_all_transpose)
