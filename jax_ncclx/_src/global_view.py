"""Public functions called outside ``shard_map`` (their axis not bound): the op runs per shard through an
internal ``shard_map`` over the mesh that the arrays are sharded on, after checking that they are sharded
over the axis along their leading dimension.
"""

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding

from jax_ncclx._src import compat
from jax_ncclx._src import validation


def global_view(op_fn: Callable, args: tuple, axis_name, op: str, in_specs, out_specs):
    """Runs ``op_fn`` per shard when called on global arrays outside ``shard_map``.

    The mesh is the one in context (``jax.set_mesh``) or the one the arrays are sharded on; the leading
    dimension of every array is split over ``axis_name`` (``in_specs`` / ``out_specs``), so each device works
    on its own shard and nothing is gathered onto one device.
    """
    mesh = _mesh_with_axis(args, axis_name)
    if mesh is None:
        raise NameError(
            f"jax_ncclx.{op}: unbound axis name {axis_name!r}. Call it inside jax.shard_map over a mesh with "
            f"that axis, or on arrays sharded over a mesh axis named {axis_name!r} (e.g. under jax.set_mesh)"
        )
    _check_global_arguments(args, mesh, axis_name, op, in_specs)
    return jax.shard_map(op_fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)


def _check_global_arguments(args, mesh, axis_name, op: str, in_specs):
    """Refuses, by argument, what ``shard_map`` would refuse with an error about ``in_specs`` that the caller
    never wrote: an array whose leading dimension does not split into one block per member, and, on a mesh
    whose axes are explicit (``jax.make_mesh``'s default), where ``shard_map`` does not reshard its inputs, an
    array sharded otherwise than ``in_specs`` (an array made outside the mesh counts as replicated)."""
    specs = in_specs if isinstance(in_specs, tuple) else (in_specs,) * len(args)
    axes = set(validation.axes_of(axis_name))
    members = int(np.prod([mesh.shape[name] for name in axes]))
    for position, (arg, spec) in enumerate(zip(args, specs)):
        for leaf in jax.tree.leaves(arg):
            aval = jax.typeof(leaf)
            own_mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
            on_mesh = own_mesh is not None and axes <= set(own_mesh.axis_names)
            if axes <= _explicit_axes(own_mesh if on_mesh else mesh):
                have = _padded_spec(aval.sharding.spec if on_mesh else (), aval.ndim)
                want = _padded_spec(spec, aval.ndim)
                if have != want:
                    raise ValueError(
                        f"jax_ncclx.{op}: outside shard_map it runs per shard of arrays whose leading dimension is "
                        f"sharded over {axis_name!r}, and nothing else; argument {position} is sharded "
                        f"{_spec_text(have)}. Reshard it first (jax.reshard(arg, NamedSharding(mesh, "
                        f"{_spec_text(want)}))) or call {op} inside jax.shard_map" + _per_group_hint(have, axes))
            if aval.ndim == 0 or aval.shape[0] % members:
                raise ValueError(
                    f"jax_ncclx.{op}: outside shard_map every argument's leading dimension holds the {members} "
                    f"members' blocks of {axis_name!r}, so it must be a multiple of {members}; argument {position} "
                    f"has shape {tuple(aval.shape)}")


def _per_group_hint(have: tuple, axes: set) -> str:
    """For a leading dimension split over the axis and other axes too: the shard_map that gives jax.lax's one
    result per group of the others, which a reshard to the axis alone would not."""
    lead = have[0] if have else None
    lead = set(lead) if isinstance(lead, tuple) else {lead}
    others = sorted(lead - axes - {None})
    if not others or not axes <= lead:
        return ""
    return (f" with in_specs={_spec_text(have)}, which keeps one result per group of {', '.join(map(repr, others))}"
            " as jax.lax does (a reshard to the axis alone merges those groups)")


def _explicit_axes(mesh) -> set:
    if mesh is None:
        return set()
    return {name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == jax.sharding.AxisType.Explicit}


def _spec_text(entries: tuple) -> str:
    while entries and entries[-1] is None:
        entries = entries[:-1]
    return f"P({', '.join(map(repr, entries))})"


def _padded_spec(spec, ndim: int) -> tuple:
    entries = [entry[0] if isinstance(entry, tuple) and len(entry) == 1 else entry for entry in spec]
    return tuple(entries) + (None,) * (ndim - len(entries))


def _mesh_with_axis(args, axis_name):
    def has_axes(mesh):
        return mesh is not None and not mesh.empty and set(validation.axes_of(axis_name)) <= set(mesh.axis_names)

    concrete = compat.concrete_context_mesh()
    if has_axes(concrete):
        return concrete
    context = jax.sharding.get_abstract_mesh()
    if has_axes(context):
        return context
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and has_axes(sharding.mesh):
            return sharding.mesh
        mesh = getattr(jax.typeof(leaf).sharding, "mesh", None)
        if has_axes(mesh):
            return mesh
    return None
