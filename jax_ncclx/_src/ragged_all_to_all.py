"""ragged_all_to_all: ``jax.lax.ragged_all_to_all``'s arguments and result, moved by all_to_allv_dynamic.

``jax.lax.ragged_all_to_all`` sends slices of each member's operand to offsets of its peers' output that the
sender chooses. XLA 0.11.2 runs it 7–130× slower than all_to_allv_dynamic moves the same rows on our H200s
(README, "Performance"), and XLA:CPU does not run it at all. This function takes the same arguments, so a
program switches with one line, and runs in three steps:

1. the slices, peer-major, are the send rows of one all_to_allv_dynamic (``send_rows``: its kernel reads each
   row where it lies, so nothing is packed first; N * C of them, C = ``max_recv_per_peer``, what the peers
   can take, so slices that overlap in the operand, as a decode step's combine sends the same rows to every
   peer, are each sent whole);
2. that exchange lands each source's rows at ``[source, :capacity]``, and a small all_to_all brings the
   output offsets that the senders chose for this member;
3. one gather writes every received row at its offset into a copy of ``output``.

Beyond the exchange it costs that gather (a pass over the output), the offsets' all_to_all, the padded
receive buffer ``[N, C, ...]`` (N times output's rows with the default C) and the int32 ``[N * C]`` send
rows.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_ncclx._src import all_to_allv_plan
from jax_ncclx._src import axis_groups
from jax_ncclx._src import primitive
from jax_ncclx._src.ops.all_to_all import all_to_all
from jax_ncclx._src.ops.all_to_allv_dynamic import all_to_allv_dynamic

_OP = "ragged_all_to_all"


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
                      axis_index_groups=None, max_recv_per_peer: int | None = None):
    """``jax.lax.ragged_all_to_all`` on jax_ncclx's all-to-all-v kernels.

    Slice i of this member, ``operand[input_offsets[i] : input_offsets[i] + send_sizes[i]]``, goes to member
    ``i // K`` (``K = len(input_offsets) // N``) and lands in that member's result at ``output_offsets[i]``;
    every row no slice writes keeps ``output``'s value. Slices may overlap in the operand, those to one peer
    too (a decode step's combine sends the same rows to every peer): each sends its own rows, as in
    ``jax.lax``'s description. All sizes and offsets stay on the device.

    Args:
      operand: ``[X, ...]`` the rows to send; any number or boolean dtype.
      output: ``[O, ...]`` with operand's trailing shape and dtype: the result where nothing lands.
      input_offsets, send_sizes, output_offsets, recv_sizes: integer ``[N * K]``, N the size of
        ``axis_name``: K slices per peer, peer-major. ``recv_sizes[i]`` is the rows this member takes from
        slice ``i % K`` of member ``i // K``.
      axis_name: the mesh axis, or a tuple of axes taken as one (static).
      axis_index_groups: as in ``jax.lax`` (static): groups of axis indices, all of one size G, that cover the
        axis once, each exchanging on its own; the four arrays are then ``[G * K]``, slice i going to the
        group's member ``i // K``. Run over the whole axis with nothing sent to other groups
        (``_src/axis_groups.py``), so the receive buffer is ``[N, C, ...]`` all the same.
      max_recv_per_peer: C, the most rows this member takes from one peer, all its slices together (static
        int >= 0; default O, which no valid call exceeds). It sizes the ``[N, C, ...]`` receive buffer.

    Returns:
      ``[O, ...]`` with output's dtype.

    Where the contract of ``jax.lax.ragged_all_to_all`` leaves a call undefined, this one is still memory
    safe and says what it does:

    * a slice writes ``min(recv_sizes[i], the rows its sender sent)`` rows, and no row outside ``[0, O)``;
    * rows read outside ``[0, X)`` are zero rows;
    * a negative send size sends nothing;
    * a peer's rows past C are not sent (dropped): its send sizes are walked slice after slice and cut
      there, as all_to_allv_dynamic cuts its counts;
    * where slices overlap in the result, the later one (in source order, then slice order) wins, as in
      ``jax.lax``'s description; sources in axis order, also within groups.

    Runs inside ``jax.shard_map`` over ``axis_name``, or outside it on arrays whose leading dimension is
    sharded over the axis (each array then holds every member's rows, member-major). Differentiable in
    operand and output; vmap-able.

    Raises:
      TypeError / ValueError: a bad argument (the message names it; offsets and sizes that are not 1-D
        integer arrays: ValueError, as in ``jax.lax``), ``axis_index_groups`` that do not cover the axis once
        or differ in size among them; outside ``jax.shard_map``, an argument sharded otherwise than over
        ``axis_name`` along its leading dimension, or whose leading dimension the axis size does not divide.
      NameError: ``axis_name`` is not bound by an enclosing ``jax.shard_map`` (and no mesh shards the operands).
    """
    axis_name = primitive.check_axis_name(axis_name, _OP)
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    if not primitive.is_bound(axis_name):
        op = partial(ragged_all_to_all, axis_name=axis_name, axis_index_groups=axis_index_groups,
                     max_recv_per_peer=max_recv_per_peer)
        return primitive.global_view(op, args, axis_name, _OP, (P(axis_name),) * len(args), P(axis_name))

    size = jax.lax.axis_size(axis_name)
    groups = axis_groups.canonical(axis_index_groups, size, _OP)
    peers = size if groups is None else len(groups[0])
    slices, capacity = _check(*args, peers=peers, grouped=groups is not None, max_recv_per_peer=max_recv_per_peer)
    num_rows, out_rows = jnp.shape(operand)[0], jnp.shape(output)[0]
    if not slices or not capacity or not out_rows:  # static on every member: nothing can land
        return output

    def per_member(values):
        """int32 ``[N, K]`` from this member's ``[G * K]`` (its group's members, in group order): zeros for
        the members of other groups, so that nothing goes to them or is taken from them."""
        values = primitive.as_int32(values).reshape(peers, slices)
        return values if groups is None else axis_groups.spread_blocks(values, groups, axis_name)

    sizes = _peer_sizes(per_member(send_sizes), capacity)
    send_rows = _send_rows(per_member(input_offsets).reshape(-1), sizes.reshape(-1), num_rows, size * capacity)
    y, recv_counts, _ = all_to_allv_dynamic(operand, sizes, axis_name, max_recv_per_peer=capacity,
                                            send_rows=send_rows)
    landing = all_to_all(per_member(output_offsets), axis_name, 0, 0, tiled=True)
    taken = jnp.minimum(recv_counts, per_member(recv_sizes))
    source_row = _source_rows(recv_counts, taken, landing, capacity, out_rows)
    received = y.reshape(size * capacity, *y.shape[2:])
    landed = jnp.take(received, jnp.maximum(source_row, 0), axis=0)
    return jnp.where((source_row >= 0).reshape(-1, *([1] * (received.ndim - 1))), landed, output)


def _peer_sizes(send_sizes, capacity: int):
    """int32 ``[N, K]``: the rows each slice sends, its size (negative: none) cut where its peer's slices
    together pass C, so every row sent is delivered and N * C send rows hold them all."""
    through = jnp.minimum(jnp.cumsum(jnp.clip(send_sizes, 0, capacity), axis=1), capacity)
    return jnp.diff(through, axis=1, prepend=0)


def _send_rows(input_offsets, sizes, num_rows: int, num_send: int):
    """int32 ``[S]``: the operand row of each send row, the slices (sizes ``[N * K]``, peer-major) laid end to
    end in order (``X``, outside the operand, past their end). Slices may overlap in the operand."""
    slice_of, within, inside = all_to_allv_plan.locate(sizes, jnp.arange(num_send, dtype=jnp.int32))
    return jnp.where(inside, jnp.take(input_offsets, slice_of) + within, num_rows)


def _source_rows(recv_counts, taken, landing, capacity: int, out_rows: int):
    """int32 ``[O]``: for each result row, the row of the flattened ``[N * C, ...]`` receive buffer that lands
    there, or -1 for none. recv_counts, taken (the rows written) and landing (their first result row) are
    ``[N, K]``, per source and slice."""
    size = recv_counts.shape[0]
    # each of a source's C slots: the slice it holds and its row in that slice   [N, C]
    slot = jnp.arange(capacity, dtype=jnp.int32)
    slice_of, within, inside = jax.vmap(all_to_allv_plan.locate, (0, None))(recv_counts, slot)
    pick = lambda table: jnp.take_along_axis(table, slice_of, axis=1)  # noqa: E731 - [N, K] -> [N, C]
    destination = pick(landing) + within
    written = inside & (within < pick(taken)) & (destination >= 0) & (destination < out_rows)
    destination = jnp.where(written, destination, out_rows)  # out of range: dropped by the scatter
    # Several rows landing on one result row: the highest receive row, i.e. the later source and slice, wins.
    flat_rows = jnp.arange(size * capacity, dtype=jnp.int32)
    return jnp.full((out_rows,), -1, jnp.int32).at[destination.reshape(-1)].max(flat_rows, mode="drop")


def _check(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, peers: int, grouped: bool,
           max_recv_per_peer):
    """Validates the arguments; returns (K slices per peer, capacity C). ``peers``: the axis size N, or the
    group size G where ``grouped``."""
    primitive.check_dtype(operand, _OP)
    operand_shape, output_shape = jnp.shape(operand), jnp.shape(output)
    if len(operand_shape) < 1 or operand_shape[1:] != output_shape[1:] or \
            jax.typeof(operand).dtype != jax.typeof(output).dtype:
        raise ValueError(f"jax_ncclx.{_OP}: operand [X, ...] and output [O, ...] need the same trailing shape and "
                         f"dtype, got operand {jax.typeof(operand).dtype}{list(operand_shape)} and output "
                         f"{jax.typeof(output).dtype}{list(output_shape)}")
    named = dict(input_offsets=input_offsets, send_sizes=send_sizes, output_offsets=output_offsets,
                 recv_sizes=recv_sizes)
    lengths = set()
    for name, value in named.items():
        if jnp.ndim(value) != 1 or not jnp.issubdtype(jax.typeof(value).dtype, jnp.integer):
            raise ValueError(f"jax_ncclx.{_OP}: {name} must be a 1-D integer array, got "  # jax.lax's type
                            f"{jax.typeof(value).dtype}{list(jnp.shape(value))}")
        lengths.add(jnp.shape(value)[0])
    if len(lengths) != 1 or next(iter(lengths)) % peers:
        what = f"G = {peers} (the size of a group)" if grouped else f"N = {peers} (the size of the axis)"
        raise ValueError(f"jax_ncclx.{_OP}: input_offsets, send_sizes, output_offsets and recv_sizes must have one "
                         f"length, a multiple of {what}, got "
                         f"{ {name: jnp.shape(value)[0] for name, value in named.items()} }")
    capacity = output_shape[0] if max_recv_per_peer is None else max_recv_per_peer
    return next(iter(lengths)) // peers, primitive.check_static_int(capacity, "max_recv_per_peer", _OP, minimum=0)
