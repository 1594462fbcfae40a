"""``axis_index_groups``: ``jax.lax``'s groups within an axis, run as one collective over the whole axis.

``jax.lax``'s collectives take ``axis_index_groups``, a partition of the axis indices ``0 .. N-1`` into groups;
each group runs the collective on its own. jax_ncclx runs it over the whole axis and keeps, on each member,
what its own group contributes: all_reduce and all_gather gather every member's array, reduce_scatter and
all_to_all send zeros to the members of other groups. The results equal ``jax.lax``'s (sums add the same
values in the same order, plus zeros), and every transform of the whole-axis op applies, but the op moves
N / G times the bytes of a collective within a group of G. Where that cost matters, give each group a mesh
axis of its own.
"""

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np


def canonical(axis_index_groups, size: int, op: str, *, equal_sizes: bool = True):
    """The groups as a tuple of tuples of ints, or None where they are the whole axis in order (or None).

    Raises:
      TypeError: not a sequence of sequences of ints.
      ValueError: the groups do not cover ``0 .. size-1`` exactly once, or (``equal_sizes``) differ in size.
    """
    if axis_index_groups is None:
        return None
    try:
        groups = tuple(tuple(_index(i) for i in group) for group in axis_index_groups)
    except (TypeError, ValueError):
        raise TypeError(f"jax_ncclx.{op}: axis_index_groups must be a sequence of sequences of axis indices, got "
                        f"{axis_index_groups!r}") from None
    flat = sorted(i for group in groups for i in group)
    if flat != list(range(size)):
        raise ValueError(f"jax_ncclx.{op}: axis_index_groups {groups} must cover the axis indices 0 .. {size - 1} "
                         "exactly once")
    if equal_sizes and len({len(group) for group in groups}) != 1:
        raise ValueError(f"jax_ncclx.{op}: the groups of axis_index_groups {groups} must all have one size")
    return None if groups == (tuple(range(size)),) else groups


def _index(value) -> int:
    """An axis index: a Python or NumPy int, not a bool or a float."""
    if isinstance(value, bool):
        raise TypeError(value)
    return operator.index(value)


@functools.cache  # groups are static tuples, and each op asks for the tables twice or more
def _tables(groups):
    """Static tables over the axis indices: each one's group, its position in it, and the members of every
    member's group in group order (padded with -1 where groups differ in size)."""
    size = sum(len(group) for group in groups)
    group_of, position = np.zeros(size, np.int32), np.zeros(size, np.int32)
    widest = max(len(group) for group in groups)
    members = np.full((size, widest), -1, np.int32)
    for g, group in enumerate(groups):
        for p, i in enumerate(group):
            group_of[i], position[i] = g, p
            members[i, : len(group)] = group
    return group_of, position, members


def same_group(groups, axis_name):
    """bool ``[N]``: which axis indices are in this member's group."""
    group_of, _, _ = _tables(groups)
    me = jax.lax.axis_index(axis_name)
    return jnp.asarray(group_of) == jnp.asarray(group_of)[me]


def group_size(groups, axis_name):
    """int32 scalar: the size of this member's group."""
    return jnp.sum(same_group(groups, axis_name).astype(jnp.int32))


def members(groups, axis_name):
    """int32 ``[G]``: the axis indices of this member's group, in group order (equal group sizes)."""
    _, _, table = _tables(groups)
    return jnp.asarray(table)[jax.lax.axis_index(axis_name)]


def spread_blocks(blocks, groups, axis_name):
    """``[N, ...]`` from this member's ``[G, ...]`` blocks (block p for the group's p-th member): each member
    of its group gets its block, every other member zeros. For an all_to_all over the whole axis."""
    _, position, _ = _tables(groups)
    spread = jnp.take(blocks, jnp.asarray(position), axis=0)
    mask = same_group(groups, axis_name).reshape(-1, *([1] * (blocks.ndim - 1)))
    return jnp.where(mask, spread, jnp.zeros((), blocks.dtype))
