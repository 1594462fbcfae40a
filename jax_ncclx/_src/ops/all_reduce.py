"""all_reduce: every member of a mesh-axis group gets the elementwise sum / max / min of all members' arrays.

Sharding model: inside ``shard_map`` the result is invariant over the axis (as ``jax.lax.psum``); outside it,
on arrays whose leading dimension is sharded over the axis, each shard is reduced with the others and the
result keeps that sharding.
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
from jax_ncclx._src import compat
from jax_ncclx._src import config
from jax_ncclx._src import contract
from jax_ncclx._src import global_view
from jax_ncclx._src import lowering
from jax_ncclx._src import nvlink
from jax_ncclx._src import primitive
from jax_ncclx._src import validation
from jax_ncclx._src.ops.all_gather import all_gather


def all_reduce(x, axis_name, op: str = "sum", *, axis_index_groups=None):
    """Reduces ``x`` elementwise over the members of the mesh axis ``axis_name``.

    Args:
      x: array (or pytree of arrays) of any shape; float32/float64/bfloat16/float16, 8–64-bit integers,
        booleans (``max`` / ``min`` are any / all; ``sum`` counts them in int32, as ``jax.lax.psum``) or
        complex numbers (``sum`` and ``mean`` only; summed as pairs of their real dtype).
      axis_name: the mesh axis to reduce over, or a tuple of axes taken as one (static). On a multi-axis mesh
        the reduction runs within each group along that axis (those axes).
      op: ``"sum"``, ``"max"``, ``"min"`` or ``"mean"`` (static). ``"mean"`` is ``jax.lax.pmean``: the sum
        divided by the group's size N, so integers and booleans give float32 (float64 under x64).
      axis_index_groups: as in ``jax.lax.psum`` (static): groups of axis indices that cover the axis once, each
        reduced on its own. Run over the whole axis (an all_gather of every member's array, then a local
        reduction), so it moves N times the bytes of the plain op (docs/api.md, "Groups").

    Returns:
      An array of ``x``'s shape and dtype (int32 for a sum of booleans), the same bits on every member of the
      group. ``sum`` of 16-bit floats accumulates in float32 and rounds once on the CPU backend and in the GPU
      NVLink kernels (inputs up to ``JAX_NCCLX_NVLINK_MAX_BYTES``, docs/configuration.md); larger inputs go
      through NCCL, which accumulates in the input dtype.

    Differentiable (``sum`` and ``mean`` are linear; ``max``/``min`` pass the tangent of the members that hold
    the extreme, averaged over ties) and vmap-able, over non-mesh axes (one collective) or over the op's own
    axis (local work, as in ``jax.lax``; in a tuple with mesh axes, the batch is reduced here and the rest over
    the mesh).

    Raises:
      NameError: ``axis_name`` is not bound by an enclosing ``jax.shard_map`` (and no mesh shards ``x``).
      ValueError: outside ``jax.shard_map``, an argument sharded otherwise than over ``axis_name`` along its
        leading dimension, or whose leading dimension the axis size does not divide.
      ValueError: an unknown ``op``; an axis named twice; ``axis_index_groups`` that do not cover the axis once.
      TypeError: a dtype the op cannot take (not a number or boolean; under a byte; an 8-bit float; the max /
        min of complex numbers).
      NotImplementedError: a shard_map that leaves a mesh axis of size > 1 to the compiler
        (docs/sharp_bits.md).
    """
    axis_name = validation.check_axis_name(axis_name, "all_reduce")
    if op not in (*contract.REDUCE_OPS, "mean"):
        raise ValueError(f"jax_ncclx.all_reduce: op must be one of {sorted((*contract.REDUCE_OPS, 'mean'))}, "
                         f"got {op!r}")
    if not validation.is_bound(axis_name):
        return global_view.global_view(partial(all_reduce, axis_name=axis_name, op=op,
                                             axis_index_groups=axis_index_groups), (x,), axis_name,
                                     "all_reduce", P(axis_name), P(axis_name))
    groups = axis_groups.canonical(axis_index_groups, jax.lax.axis_size(axis_name), "all_reduce",
                                   equal_sizes=False)
    if op == "mean":  # as jax.lax.pmean computes it
        size = jax.lax.axis_size(axis_name) if groups is None else axis_groups.group_size(groups, axis_name)
        return jax.tree.map(lambda total: total / size, all_reduce(x, axis_name, "sum", axis_index_groups=groups))
    if groups is not None:
        return jax.tree.map(lambda leaf: _reduce_within_groups(leaf, axis_name, op, groups), x)

    def one(leaf):
        operand, restore = validation.reduction_operand(leaf, "all_reduce", op)
        y = all_reduce_p.bind(primitive.ensure_varying(operand, axis_name), axis_name=axis_name, op=op)
        if config.current().checksum:
            checksum.verify_all_reduce(axis_name, y)
        return restore(y)

    return jax.tree.map(one, x)


def _reduce_within_groups(leaf, axis_name, op: str, groups):
    """all_reduce within ``groups``: every member's array gathered, this member's group reduced here, in axis
    order as the handlers reduce (axis_groups.py)."""
    operand, restore = validation.reduction_operand(jnp.asarray(leaf), "all_reduce", op)
    everyone = all_gather(operand, axis_name)                                   # [N, ...]
    mine = axis_groups.same_group(groups, axis_name).reshape(-1, *([1] * operand.ndim))
    if op == "sum":
        accumulation = validation.accumulation_dtype(operand.dtype)
        total = jnp.sum(jnp.where(mine, everyone, jnp.zeros((), operand.dtype)), axis=0, dtype=accumulation)
        return restore(total.astype(operand.dtype))
    pick = jnp.max if op == "max" else jnp.min
    dtype = np.dtype(operand.dtype)
    if dtype == np.bool_:
        identity = op == "min"
    elif jnp.issubdtype(dtype, jnp.integer):
        identity = np.iinfo(dtype).min if op == "max" else np.iinfo(dtype).max
    else:
        identity = -np.inf if op == "max" else np.inf
    return restore(pick(jnp.where(mine, everyone, jnp.asarray(identity, dtype)), axis=0))


all_reduce_p = primitive.make_collective("all_reduce")


def _all_reduce_abstract_eval(x, *, axis_name, op):
    return primitive.output_aval(x, axis_name, invariant=True), primitive.effects(axis_name)


def _all_reduce_attrs(*, op):
    return {"reduce_op": np.int32(contract.REDUCE_OPS[op])}  # enum attributes travel as int32



def _all_reduce_batching(axis_data, args, dims, *, axis_name, op):
    (x,), (d,) = args, dims
    axes = validation.axes_of(axis_name)
    if axis_data.name not in axes:
        return all_reduce_p.bind(x, axis_name=axis_name, op=op), d
    # vmap over the op's own axis: its members are x's batch entries, reduced here; the other axes of a tuple
    # then reduce that once more, in the same accumulation dtype (as jax.lax.psum does).
    members = primitive.members_first(axis_data, x, d)
    if op == "sum":
        y = jnp.sum(members, axis=0, dtype=validation.accumulation_dtype(x.dtype))
    else:
        y = (jnp.max if op == "max" else jnp.min)(members, axis=0)
    rest = tuple(name for name in axes if name != axis_data.name)
    if rest:
        y = all_reduce_p.bind(y, axis_name=validation.check_axis_name(rest, "all_reduce"), op=op)
    return y.astype(x.dtype), None


def _all_reduce_jvp(primals, tangents, *, axis_name, op):
    (x,), (t,) = primals, tangents
    y = all_reduce_p.bind(x, axis_name=axis_name, op=op)
    t = ad.instantiate_zeros(t)
    if op == "sum":
        return y, all_reduce_p.bind(t, axis_name=axis_name, op="sum")
    # max/min: the tangent of the members holding the extreme, averaged over ties.
    holds = (x == y).astype(t.dtype)
    total = all_reduce_p.bind(t * holds, axis_name=axis_name, op="sum")
    ties = all_reduce_p.bind(holds, axis_name=axis_name, op="sum")
    return y, total / ties


def _all_reduce_transpose(ct, x, *, axis_name, op):
    if op != "sum":  # JAX transposes only linear primitives; max / min never reach here through the public API
        raise NotImplementedError(f"jax_ncclx.all_reduce: the {op} all_reduce is not linear; no transpose")
    ct = ad.instantiate_zeros(ct)
    if compat.check_vma_enabled():
        # as psum: the cotangent is shared by all members (a vmapped axis has no varying type to cast)
        return [jax.lax.pcast(ct, primitive.manual_axes_of(axis_name), to="varying")]
    return [all_reduce_p.bind(ct, axis_name=axis_name, op="sum")]


all_reduce_p.def_effectful_abstract_eval(_all_reduce_abstract_eval)
lowering.register_lowerings(all_reduce_p, "ncclx_all_reduce", _all_reduce_attrs, nvlink.route_of("all_reduce"))
batching.fancy_primitive_batchers[all_reduce_p] = _all_reduce_batching
ad.primitive_jvps[all_reduce_p] = _all_reduce_jvp
ad.primitive_transposes[all_reduce_p] = _all_reduce_transpose
