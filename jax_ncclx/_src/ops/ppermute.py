"""ppermute: point-to-point sends along a mesh axis (pipeline parallelism).

Member ``src`` sends its array to member ``dst`` for every pair of ``perm``; members that receive nothing
get zeros. Linear; its transpose is the inverse permutation. Sharding model as ``jax.lax.ppermute``.
"""

import operator
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad
from jax.interpreters import batching
from jax.sharding import PartitionSpec as P

from jax_ncclx._src import checksum
from jax_ncclx._src import config
from jax_ncclx._src import global_view
from jax_ncclx._src import lowering
from jax_ncclx._src import primitive
from jax_ncclx._src import validation


def ppermute(x, axis_name, perm):
    """Sends ``x`` from member ``src`` to member ``dst`` for each ``(src, dst)`` in ``perm``.

    Args:
      x: array (or pytree) of any number or boolean dtype.
      axis_name: the mesh axis, or a tuple of axes taken as one (static; the first axis major, as
        ``jax.lax.axis_index`` of the tuple, in any order of the axes).
      perm: list or tuple of ``(src, dst)`` axis-index pairs (static); each index appears at most once as a
        source and at most once as a destination.

    Returns:
      An array like ``x``: the array sent to this member, or zeros if none was.

    Raises:
      NameError: ``axis_name`` is not bound by an enclosing ``jax.shard_map`` (and no mesh shards ``x``).
      ValueError: outside ``jax.shard_map``, an argument sharded otherwise than over ``axis_name`` along its
        leading dimension, or whose leading dimension the axis size does not divide.
      ValueError: an index of ``perm`` outside the axis, or used twice as a source or as a destination.
      TypeError: ``perm`` not a list or tuple of int pairs; a dtype the op cannot take (not a number or boolean, or
        under a byte).
      NotImplementedError: vmap over ``axis_name`` inside a tuple with mesh axes; a shard_map that leaves a mesh
        axis of size > 1 to the compiler.
    """
    axis_name = validation.check_axis_name(axis_name, "ppermute")
    if not validation.is_bound(axis_name):
        return global_view.global_view(partial(ppermute, axis_name=axis_name, perm=perm), (x,), axis_name,
                                     "ppermute", P(axis_name), P(axis_name))
    size = jax.lax.axis_size(axis_name)
    sources, targets = [-1] * size, [-1] * size
    for src, dst in _check_perm(perm, size):
        sources[dst], targets[src] = src, dst

    def one(leaf):
        validation.check_dtype(leaf, "ppermute")
        y = ppermute_p.bind(primitive.ensure_varying(leaf, axis_name), axis_name=axis_name,
                            sources=tuple(sources), targets=tuple(targets))
        if config.current().checksum:
            checksum.verify_ppermute(axis_name, leaf, y, sources)
        return y

    return jax.tree.map(one, x)


def _member_index(value) -> int:
    """A member's index: a Python or NumPy int, not a bool or a float such as 0.7 (which int() would truncate;
    jax.lax.ppermute refuses both)."""
    if isinstance(value, bool):
        raise TypeError(value)
    return operator.index(value)


def _check_perm(perm, size: int) -> tuple[tuple[int, int], ...]:
    if not isinstance(perm, (list, tuple)):  # as jax.lax: an iterator would be used up by the first trace
        raise TypeError(f"jax_ncclx.ppermute: perm must be a list or a tuple of (src, dst) pairs, got "
                        f"{type(perm).__name__}")
    try:
        pairs = tuple((_member_index(src), _member_index(dst)) for src, dst in perm)
    except (TypeError, ValueError):
        raise TypeError(f"jax_ncclx.ppermute: perm must be a sequence of (src, dst) int pairs, got {perm!r}")
    for column, what in ((0, "source"), (1, "destination")):
        indices = [pair[column] for pair in pairs]
        if any(not 0 <= i < size for i in indices):
            raise ValueError(f"jax_ncclx.ppermute: a {what} in {pairs} is outside the axis (size {size})")
        if len(set(indices)) != len(indices):
            raise ValueError(f"jax_ncclx.ppermute: a {what} appears twice in {pairs}")
    return pairs


ppermute_p = primitive.make_collective("ppermute")


# Params: sources[r] is the axis index whose array member r receives, targets[r] where member r sends
# (-1: none). The inverse permutation swaps the two.

def _ppermute_abstract_eval(x, *, axis_name, sources, targets):
    return primitive.output_aval(x, axis_name), primitive.effects(axis_name)


def _ppermute_attrs(*, sources, targets):
    return {"sources": np.asarray(sources, np.int64), "targets": np.asarray(targets, np.int64)}


def _ppermute_batching(axis_data, args, dims, *, axis_name, sources, targets):
    (x,), (d,) = args, dims
    if primitive.batches_own_axis(axis_data, axis_name, "ppermute"):
        members = primitive.members_first(axis_data, x, d)
        received = jnp.take(members, np.asarray(sources, np.int32).clip(0), axis=0)
        sent = (np.asarray(sources) >= 0).reshape(-1, *[1] * (members.ndim - 1))
        return jnp.where(sent, received, jnp.zeros((), received.dtype)), 0
    return ppermute_p.bind(x, axis_name=axis_name, sources=sources, targets=targets), d


def _ppermute_transpose(ct, x, *, axis_name, sources, targets):
    return [ppermute_p.bind(ad.instantiate_zeros(ct), axis_name=axis_name, sources=targets, targets=sources)]


ppermute_p.def_effectful_abstract_eval(_ppermute_abstract_eval)
lowering.register_lowerings(ppermute_p, "ncclx_ppermute", _ppermute_attrs)
batching.fancy_primitive_batchers[ppermute_p] = _ppermute_batching
ad.deflinear2(ppermute_p, _ppermute_transpose)
