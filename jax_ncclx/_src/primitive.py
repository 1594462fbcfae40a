"""The primitives and avals every jax_ncclx collective shares.

A collective is a ``jax.extend.core.Primitive`` whose eager ``impl`` refuses to run outside ``shard_map`` and
whose abstract eval keeps the varying-manual-axes type (so ``check_vma=True`` works); a local op (no
communication, e.g. moe's routing) is evaluated eagerly by compiling it. The batching helpers here fold a
vmapped dimension into an op's batch, or run a vmap over the op's own axis as local array work. Lowerings
are :mod:`lowering`'s; the view from outside ``shard_map`` is :mod:`global_view`'s.
"""

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching

from jax_ncclx._src import compat
from jax_ncclx._src import validation


def make_collective(name: str, *, multiple_results: bool = False) -> Primitive:
    """A primitive ``ncclx_<name>`` that fails clearly when evaluated outside a mapped context."""
    prim = Primitive(f"ncclx_{name}")
    prim.multiple_results = multiple_results

    def outside_shard_map(*args, **params):
        raise RuntimeError(
            f"jax_ncclx.{name} must run inside jax.shard_map (or under jax.jit on arrays sharded over the "
            "named mesh axis)"
        )

    prim.def_impl(outside_shard_map)
    return prim


def make_local(name: str, *, multiple_results: bool = False) -> Primitive:
    """A primitive ``ncclx_<name>`` for a local op (no communication): evaluated eagerly by compiling it."""
    prim = Primitive(f"ncclx_{name}")
    prim.multiple_results = multiple_results
    prim.def_impl(lambda *args, **params: compat.apply_primitive(prim, *args, **params))
    return prim


def fold_vmap_into_batch(prim: Primitive, axis_data, args, dims, **params):
    """The batching rule of a primitive whose operands and results all lead with a batch dimension B: the
    vmapped dimension is folded into B, so that ``vmap`` stays one call. With no operand batched (a
    ``vmap`` over a ``shard_map`` that maps none of them), the call is left as it is."""
    if all(d is None for d in dims):
        outs = prim.bind(*args, **params)
        return outs, ([None] * len(outs) if prim.multiple_results else None)
    args = [batching.bdim_at_front(a, d, axis_data.size) for a, d in zip(args, dims)]
    vmapped, batch = args[0].shape[:2]
    outs = prim.bind(*(a.reshape(vmapped * batch, *a.shape[2:]) for a in args), **params)

    def unfold(out):
        return out.reshape(vmapped, batch, *out.shape[1:])

    if not prim.multiple_results:
        return unfold(outs), 0
    return [unfold(out) for out in outs], [0] * len(outs)


def manual_axes_of(axis_name) -> tuple:
    """The axes of ``axis_name`` that are manual axes of the enclosing ``shard_map``: those that varying types
    track (a vmapped axis is not one)."""
    manual = jax.sharding.get_abstract_mesh().manual_axes
    return tuple(name for name in validation.axes_of(axis_name) if name in manual)


def ensure_varying(x, axis_name):
    """Marks ``x`` as varying over the mesh axes of ``axis_name`` it does not vary over yet (as ``jax.lax``
    collectives do). A vmapped axis has no such type and is left out."""
    if not compat.check_vma_enabled():
        return x
    varying = compat.varying_axes(jax.typeof(x))
    missing = tuple(name for name in manual_axes_of(axis_name) if name not in varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def output_aval(aval, axis_name, *inputs, shape=None, dtype=None, invariant: bool = False):
    """The aval of a collective's result: ``aval`` with a new shape/dtype, varying over the union of the
    inputs' varying axes, minus those of ``axis_name`` when the result is the same on every member
    (``invariant``)."""
    varying = frozenset().union(*(compat.varying_axes(a) for a in (aval, *inputs)))
    if invariant:
        varying -= set(validation.axes_of(axis_name))
    out = aval.update(shape=aval.shape if shape is None else tuple(shape),
                      dtype=aval.dtype if dtype is None else dtype)
    return compat.with_varying_axes(out, varying)


def output_avals(shapes, aval, axis_name, *inputs, dtypes: dict):
    """output_aval for each field of the NamedTuple ``shapes`` (its values are the results' shapes): dtype
    ``dtypes[field]``, int32 for a field not named there."""
    return [output_aval(aval, axis_name, *inputs, shape=shape, dtype=dtypes.get(name, jnp.int32))
            for name, shape in zip(shapes._fields, shapes)]


def effects(axis_name):
    return {compat.NamedAxisEffect(name) for name in validation.axes_of(axis_name)}


def batches_own_axis(axis_data, axis_name, op: str) -> bool:
    """Whether a batching rule runs for ``jax.vmap(..., axis_name=...)`` over the collective's own axis. The
    axis's members are then the entries of the batch dimension, all on this device, so the op is local array
    work on :func:`members_first`. A tuple that takes the vmapped axis together with other axes is refused
    here, as ``jax.lax`` refuses it for all but its reductions and all_to_all (``all_reduce`` and
    ``all_to_all`` handle that case themselves)."""
    axes = validation.axes_of(axis_name)
    if axis_data.name not in axes:
        return False
    if len(axes) > 1:
        raise NotImplementedError(
            f"jax_ncclx.{op}: axis_name {axis_name!r} takes the vmapped axis {axis_data.name!r} together with "
            "other axes; only all_reduce and all_to_all support that (as in jax.lax)")
    return True


def members_first(axis_data, x, d):
    """``x`` with the vmapped axis's members along dimension 0: its batch dimension ``d`` moved there, or (``d``
    None: every member holds ``x``) ``x`` broadcast to them."""
    if d is None:
        return jnp.broadcast_to(x, (axis_data.size, *jnp.shape(x)))
    return jnp.moveaxis(x, d, 0)


def batch_by_chain(prim: Primitive, chain):
    """Registers ``prim``'s batching rule for a fused op: ``chain`` (the same computation in other jax_ncclx ops,
    a function of the operands and the params) vmapped, so that each op it calls batches by its own rule."""

    def rule(axis_data, args, dims, **params):
        vmapped = jax.vmap(functools.partial(chain, **params), in_axes=tuple(dims), axis_name=axis_data.name,
                           axis_size=axis_data.size, spmd_axis_name=axis_data.spmd_name)
        outs = vmapped(*args)
        return outs, [0] * len(outs) if prim.multiple_results else 0

    batching.fancy_primitive_batchers[prim] = rule
