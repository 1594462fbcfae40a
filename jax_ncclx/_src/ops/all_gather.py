"""all_gather: every member of a mesh-axis group gets all members' arrays, stacked or concatenated.

The primitive gathers onto a new leading dimension ([N, *x.shape], entry i from axis index i); the public
function moves that dimension to ``axis`` and merges it for ``tiled``, so the FFI call always moves
contiguous blocks. Sharding model: varying in, varying out (as ``jax.lax.all_gather``); outside
``shard_map`` the leading dimension of the global array is sharded over the axis. Its transpose is
reduce_scatter, registered by ``reduce_scatter.py`` (which imports this module, not the other way round).
"""

from functools import partial

import jax
import jax.numpy as jnp
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


def all_gather(x, axis_name, *, axis_index_groups=None, axis: int = 0, tiled: bool = False, to: str = "varying"):
    """Gathers ``x`` from every member of the mesh axis ``axis_name``.

    Args:
      x: array (or pytree) of any shape and of any number or boolean dtype (float8 and complex included).
      axis_name: the mesh axis to gather over, or a tuple of axes taken as one (static; the first axis major,
        as ``jax.lax.axis_index`` of the tuple).
      axis_index_groups: as in ``jax.lax.all_gather`` (static): groups of one size G that cover the axis once;
        each gathers only its members' arrays (N = G below). Run over the whole axis, then kept to the group,
        so it moves N / G times the bytes of a gather within the group (docs/api.md, "Groups").
      axis: where the gathered dimension goes in the result (static; negative counts from the end).
      tiled: if False the result has a new dimension of size N at ``axis``; if True the members' arrays are
        concatenated along the existing dimension ``axis`` (static).
      to: the result's type over the axis, as in ``jax.lax.all_gather`` (static): ``"varying"`` (default), or
        ``"invarying"``, the same on every member (``out_specs`` may then leave the axis out; the gradient
        is this member's block of the cotangent, ``jax.lax.all_gather_invariant``'s).

    Returns:
      ``[..., N, ...]`` (stacked) or ``x.shape`` with ``shape[axis] * N`` (tiled); block i comes from axis
      index i. Same dtype as ``x``.

    Raises:
      NameError: ``axis_name`` is not bound by an enclosing ``jax.shard_map`` (and no mesh shards ``x``).
      ValueError: outside ``jax.shard_map``, an argument sharded otherwise than over ``axis_name`` along its
        leading dimension, or whose leading dimension the axis size does not divide.
      ValueError: ``axis`` out of range; an axis named twice; ``axis_index_groups`` that do not cover the axis
        once or differ in size.
      TypeError: a dtype the op cannot take (not a number or boolean, or under a byte); ``axis`` not a static
        int.
      NotImplementedError: vmap over ``axis_name`` inside a tuple with mesh axes; a shard_map that leaves a mesh
        axis of size > 1 to the compiler; ``to="reduced"``, or ``"invarying"`` with ``axis_index_groups``.
    """
    axis_name = validation.check_axis_name(axis_name, "all_gather")
    if to not in ("varying", "invarying"):
        raise (NotImplementedError if to == "reduced" else ValueError)(
            f"jax_ncclx.all_gather: to must be 'varying' or 'invarying', got {to!r}")
    if to == "invarying" and axis_index_groups is not None:  # the result differs between groups
        raise NotImplementedError("jax_ncclx.all_gather: to='invarying' with axis_index_groups")
    if not validation.is_bound(axis_name):
        return global_view.global_view(partial(all_gather, axis_name=axis_name, axis_index_groups=axis_index_groups,
                                             axis=axis, tiled=tiled, to=to), (x,),
                                     axis_name, "all_gather", P(axis_name), P(axis_name))
    groups = axis_groups.canonical(axis_index_groups, jax.lax.axis_size(axis_name), "all_gather")

    def one(leaf):
        validation.check_dtype(leaf, "all_gather")
        ndim = jnp.ndim(leaf)
        out_axis = _normalize_axis(axis, ndim if tiled else ndim + 1, "all_gather")
        y = all_gather_p.bind(primitive.ensure_varying(leaf, axis_name), axis_name=axis_name,
                              invariant=to == "invarying")
        if config.current().checksum:
            checksum.verify_all_gather(axis_name, leaf, y)
        if groups is not None:  # [N, ...] -> this member's group, [G, ...]
            y = jnp.take(y, axis_groups.members(groups, axis_name), axis=0)
        y = jnp.moveaxis(y, 0, out_axis)
        if tiled:
            shape = y.shape
            y = y.reshape(*shape[:out_axis], shape[out_axis] * shape[out_axis + 1], *shape[out_axis + 2:])
        return y

    return jax.tree.map(one, x)


def _normalize_axis(axis: int, ndim: int, op: str) -> int:
    axis = validation.check_static_int(axis, "axis", op)
    if not -ndim <= axis < ndim:
        raise ValueError(f"jax_ncclx.{op}: axis {axis} is out of range for a result of rank {ndim}")
    return axis % ndim


all_gather_p = primitive.make_collective("all_gather")


# Params: invariant, whether the result is typed the same on every member (to="invarying"); False where a
# caller binds the primitive without it.

def _all_gather_abstract_eval(x, *, axis_name, invariant=False):
    size = jax.lax.axis_size(axis_name)
    return (primitive.output_aval(x, axis_name, shape=(size, *x.shape), invariant=invariant),
            primitive.effects(axis_name))



def _all_gather_batching(axis_data, args, dims, *, axis_name, invariant=False):
    (x,), (d,) = args, dims
    if primitive.batches_own_axis(axis_data, axis_name, "all_gather"):
        return primitive.members_first(axis_data, x, d), None  # every member gathers the same blocks
    return all_gather_p.bind(x, axis_name=axis_name, invariant=invariant), None if d is None else d + 1


all_gather_p.def_effectful_abstract_eval(_all_gather_abstract_eval)
lowering.register_lowerings(all_gather_p, "ncclx_all_gather", cuda_route=nvlink.route_of("all_gather"))
batching.fancy_primitive_batchers[all_gather_p] = _all_gather_batching
