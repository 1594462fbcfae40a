"""ragged_all_to_all: ``jax.lax.ragged_all_to_all``'s arguments and result, on all_to_allv_dynamic's kernels.

``jax.lax.ragged_all_to_all`` sends slices of each member's operand to offsets of its peers' output that the
sender chooses. XLA 0.11.2 runs it 7–130× slower than all_to_allv_dynamic moves the same rows on our H200s
(docs/performance.md), and XLA:CPU does not run it at all. This function takes the same arguments, so a
program switches with one line, and runs in two steps:

1. a small all_to_all brings each member the sizes and output offsets of the slices its peers send it, from
   which it makes its place table: the row of its result each received row lands on (int32 ``[N * C]``,
   C = ``max_recv_per_peer``; -1 for a row that lands nowhere);
2. one exchange (the primitive below) sends the slices, peer-major, as send rows read where they lie in the
   operand (``N * C`` of them, so slices that overlap in the operand, as a decode step's combine sends the
   same rows to every peer, are each sent whole), and writes every received row on its row of ``output``,
   whose buffer the result takes over: the NVLink kernel writes the rows there itself, the NCCL path receives
   them into its workspace and places them with one kernel, the CPU handler copies them there.

Beyond the rows it costs the offsets' all_to_all and the int32 ``[N * C]`` send rows and place table. On
the NCCL path the workspace holds two ``[N, C, ...]`` buffers (the send and receive rows).

Sharding model: varying in, varying out, as the dense ops; outside ``shard_map`` the leading dimension of
every global array is sharded over the axis. With ``JAX_NCCLX_CHECKSUM=1`` the rows travel through
all_to_allv_dynamic's padded layout, whose checksum covers each of them, and are then placed by a scatter.
"""

import logging
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad
from jax.interpreters import batching
from jax.sharding import PartitionSpec as P

from jax_ncclx._src import all_to_allv_plan
from jax_ncclx._src import axis_groups
from jax_ncclx._src import config
from jax_ncclx._src import global_view
from jax_ncclx._src import health
from jax_ncclx._src import lowering
from jax_ncclx._src import primitive
from jax_ncclx._src import validation
from jax_ncclx._src.ops import all_to_allv_dynamic as exchange
from jax_ncclx._src.ops.all_to_all import all_to_all

logger = logging.getLogger("jax_ncclx")

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
        group's member ``i // K``. Run over the whole axis with nothing sent to other groups (docs/api.md,
        "Groups"), so the tables below are ``N * C`` long all the same.
      max_recv_per_peer: C, the most rows this member takes from one peer, all its slices together (static
        int >= 0; default O, enough unless one peer's slices overlap in the result). It sizes the int32
        ``[N * C]`` send rows and place table, the NVLink staging slots (ranks in other processes) and the
        NCCL path's ``[N, C, ...]`` buffers: a smaller C saves memory where the rows from one peer are known
        to be fewer. Rows past it are dropped without an error (below); ``JAX_NCCLX_WARN_DROPS=1`` logs each
        call that drops, per member and destination.

    Returns:
      ``[O, ...]`` with output's dtype.

    Where the contract of ``jax.lax.ragged_all_to_all`` leaves a call undefined, this one is still memory
    safe and says what it does:

    * a slice writes ``min(recv_sizes[i], the rows its sender sent)`` rows, row by row, and none outside
      ``[0, O)``: a slice that straddles an end of the output writes its rows inside it;
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
      TypeError / ValueError: a bad argument (the message names it; a Python list: TypeError; offsets and sizes
        that are not 1-D integer arrays: ValueError, as in ``jax.lax``), ``axis_index_groups`` that do not
        cover the axis once or differ in size among them; outside ``jax.shard_map``, an argument sharded
        otherwise than over ``axis_name`` along its leading dimension, or whose leading dimension the axis size
        does not divide.
      NameError: ``axis_name`` is not bound by an enclosing ``jax.shard_map`` (and no mesh shards the operands).
    """
    axis_name = validation.check_axis_name(axis_name, _OP)
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    validation.check_arrays(_OP, operand=operand, output=output, input_offsets=input_offsets, send_sizes=send_sizes,
                            output_offsets=output_offsets, recv_sizes=recv_sizes)
    if not validation.is_bound(axis_name):
        op = partial(ragged_all_to_all, axis_name=axis_name, axis_index_groups=axis_index_groups,
                     max_recv_per_peer=max_recv_per_peer)
        return global_view.global_view(op, args, axis_name, _OP, (P(axis_name),) * len(args), P(axis_name))

    size = jax.lax.axis_size(axis_name)
    groups = axis_groups.canonical(axis_index_groups, size, _OP)
    peers = size if groups is None else len(groups[0])
    slices, capacity = _check(*args, peers=peers, grouped=groups is not None, max_recv_per_peer=max_recv_per_peer)
    num_rows, out_rows = jnp.shape(operand)[0], jnp.shape(output)[0]

    def per_member(values):
        """int32 ``[N, K]`` from this member's ``[G * K]`` (its group's members, in group order): zeros for
        the members of other groups, so that nothing goes to them or is taken from them."""
        values = validation.as_int32(values).reshape(peers, slices)
        return values if groups is None else axis_groups.spread_blocks(values, groups, axis_name)

    asked = per_member(send_sizes)
    sizes = _peer_sizes(asked, capacity)
    settings = config.current()
    if settings.warn_drops and slices:
        health.warn_drops(_OP, jnp.maximum(asked, 0).sum(axis=1) - sizes.sum(axis=1), axis_name, capacity=capacity,
                          unit="rows", detail=" (max_recv_per_peer)")
    if not slices or not capacity or not out_rows:  # static on every member: nothing can land
        return output
    send_rows = _send_rows(per_member(input_offsets).reshape(-1), sizes.reshape(-1), num_rows, size * capacity)
    # What each source sends this member, slice by slice, and where it lands: one all_to_all of [N, 2K].
    theirs = all_to_all(jnp.concatenate([sizes, per_member(output_offsets)], axis=1), axis_name, 0, 0, tiled=True)
    arriving, landing = theirs[:, :slices], theirs[:, slices:]
    place = _place(arriving, jnp.minimum(arriving, per_member(recv_sizes)), landing, capacity, out_rows)
    if settings.checksum:
        logger.info("jax_ncclx.ragged_all_to_all: checksum mode: the rows travel in all_to_allv_dynamic's padded "
                    "layout, whose checksum covers them, and are placed by a scatter")
        y, recv_counts, _ = exchange.all_to_allv_dynamic(operand, sizes, axis_name, max_recv_per_peer=capacity,
                                                         send_rows=send_rows)
        return _scatter_rows(output, y, recv_counts, place)
    y, _, _ = ragged_all_to_all_p.bind(
        primitive.ensure_varying(operand, axis_name)[None], sizes[None], send_rows[None], place[None],
        primitive.ensure_varying(output, axis_name)[None], axis_name=axis_name, capacity=int(capacity))
    return y[0]


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


def _place(arriving, taken, landing, capacity: int, out_rows: int):
    """int32 ``[N * C]``, the place table: for each of the C rows from each source (source-major), the result
    row it lands on, or -1. arriving (the rows each slice brings), taken (those written: at most the slice's
    recv_sizes) and landing (its first result row) are ``[N, K]``, per source and slice."""
    size = arriving.shape[0]
    # each of a source's C slots: the slice it holds and its row in that slice   [N, C]
    slot = jnp.arange(capacity, dtype=jnp.int32)
    slice_of, within, inside = jax.vmap(all_to_allv_plan.locate, (0, None))(arriving, slot)
    pick = lambda table: jnp.take_along_axis(table, slice_of, axis=1)  # noqa: E731 - [N, K] -> [N, C]
    destination = pick(landing) + within
    written = inside & (within < pick(taken)) & (destination >= 0) & (destination < out_rows)
    destination = jnp.where(written, destination, out_rows).reshape(-1)
    # Several rows landing on one result row: the highest slot, i.e. the later source and slice, wins, so
    # that only it is written.
    flat = jnp.arange(size * capacity, dtype=jnp.int32)
    winner = jnp.full((out_rows,), -1, jnp.int32).at[destination].max(flat, mode="drop")
    wins = jnp.take(winner, destination, mode="fill", fill_value=-1) == flat
    return jnp.where(wins, destination, -1)


def _scatter_rows(output, y, recv_counts, place):
    """``output [O, ...]`` with the received rows of the padded ``y [N, C, ...]`` (recv_counts ``[N, K]``)
    written on the rows ``place [N * C]`` names, as the exchange writes them."""
    rows = _written_rows(recv_counts, place, y.shape[1], output.shape[0])
    return output.at[rows].set(y.reshape(-1, *y.shape[2:]), mode="drop")


def _written_rows(recv_counts, place, capacity: int, out_rows: int):
    """int32 ``[N * C]``: the result row that each received row (source-major) is written on, ``out_rows`` for
    none: its place where the row is one its source delivered (recv_counts ``[N, K]``) and the place names a
    row."""
    delivered = jnp.minimum(recv_counts.sum(axis=1), capacity)                           # [N]
    live = (jnp.arange(capacity)[None, :] < delivered[:, None]).reshape(-1)
    return jnp.where(live & (place >= 0) & (place < out_rows), place, out_rows)


def _check(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, peers: int, grouped: bool,
           max_recv_per_peer):
    """Validates the arguments; returns (K slices per peer, capacity C). ``peers``: the axis size N, or the
    group size G where ``grouped``."""
    validation.check_dtype(operand, _OP)
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
    return next(iter(lengths)) // peers, validation.check_static_int(capacity, "max_recv_per_peer", _OP, minimum=0)


# The placed exchange. Operands: x [B, X, ...], counts int32 [B, N, K], send_rows int32 [B, S] (as
# all_to_allv_dynamic's), place int32 [B, N * C], output [B, O, ...] with x's trailing shape and dtype. Results:
# y [B, O, ...], output with row r from source j (r below the rows it delivered) written on row
# place[b, j * C + r] where that is in [0, O); recv_counts [B, N, K] and dropped [B, N] as all_to_allv_dynamic's.
# Where two received rows name one row, which is written is not defined (ragged_all_to_all's place table names
# each row once). Batched like all_to_allv_dynamic: vmap over a non-mesh axis folds into B.
ragged_all_to_all_p = primitive.make_collective("ragged_all_to_all", multiple_results=True)


def _ragged_all_to_all_abstract_eval(x, counts, send_rows, place, output, *, axis_name, capacity):
    size = jax.lax.axis_size(axis_name)
    inputs = (x, counts, send_rows, place)
    outs = [primitive.output_aval(output, axis_name, *inputs),
            primitive.output_aval(counts, axis_name, x, output, dtype=jnp.int32),
            primitive.output_aval(counts, axis_name, x, output, shape=(x.shape[0], size), dtype=jnp.int32)]
    return outs, primitive.effects(axis_name)


def _ragged_all_to_all_attrs(*, capacity):
    return {"capacity": np.int64(capacity)}


def _ragged_all_to_all_cuda_route(ctx, comm_id, size, *, capacity):
    x, counts = ctx.avals_in[:2]
    return exchange.exchange_route(_OP, comm_id, size, x, counts.shape, tuple(x.shape[2:]), capacity,
                                   received_apart=True)


def _ragged_all_to_all_batching(axis_data, args, dims, *, axis_name, capacity):
    if primitive.batches_own_axis(axis_data, axis_name, _OP):
        x, counts, send_rows, place, output = [primitive.members_first(axis_data, a, d) for a, d in zip(args, dims)]
        # every member's padded rows, then each member's placed into its output   [N, B, ...]
        y, recv_counts, dropped = exchange.exchange_between_members(x, counts, send_rows, capacity=capacity,
                                                                    packed=False)
        placed = jax.vmap(jax.vmap(_scatter_rows))(output, y, recv_counts, place)
        return [placed, recv_counts, dropped], [0, 0, 0]
    return primitive.fold_vmap_into_batch(ragged_all_to_all_p, axis_data, args, dims, axis_name=axis_name,
                                          capacity=capacity)


def _ragged_all_to_all_jvp(primals, tangents, *, axis_name, capacity):
    """Linear in x and output; counts, send_rows and place are integers."""
    x, counts, send_rows, place, output = primals
    outs = ragged_all_to_all_p.bind(*primals, axis_name=axis_name, capacity=capacity)
    tx, t_output = ad.instantiate_zeros(tangents[0]), ad.instantiate_zeros(tangents[4])
    ty, _, _ = ragged_all_to_all_p.bind(tx, counts, send_rows, place, t_output, axis_name=axis_name,
                                        capacity=capacity)
    integer_zeros = [ad.Zero(jax.typeof(v).to_tangent_aval()) for v in outs[1:]]
    return outs, [ty, *integer_zeros]


def _ragged_all_to_all_transpose(cts, x, counts, send_rows, place, output, *, axis_name, capacity):
    """x's cotangent: each placed row's cotangent, back to the send row it came from (all_to_allv_dynamic's
    transpose, on the rows gathered into its padded layout); output's: y's, zero on the rows the exchange
    wrote (which needs the rows each source delivered: one exchange of counts)."""
    ct_y = ad.instantiate_zeros(cts[0])
    batch, out_rows = ct_y.shape[:2]
    size = counts.shape[1]
    features = ct_y.shape[2:]
    named = (place >= 0) & (place < out_rows)                                      # [B, N * C]
    gathered = jnp.take_along_axis(ct_y, jnp.where(named, place, 0).reshape(batch, -1, *([1] * len(features))),
                                   axis=1)
    gathered = jnp.where(named.reshape(*named.shape, *([1] * len(features))), gathered, 0)
    padded = gathered.reshape(batch, size, capacity, *features)
    ct_x = None
    if ad.is_undefined_primal(x):
        ct_x = exchange.all_to_allv_dynamic_transpose([padded, None, None], x, counts, send_rows,
                                                      axis_name=axis_name, capacity=capacity, packed=False)[0]
    ct_output = None
    if ad.is_undefined_primal(output):
        # what each source delivered here, exchanged with one-byte rows (see all_to_allv_dynamic's transpose)
        _, recv_counts, _ = exchange.all_to_allv_dynamic_p.bind(
            jnp.zeros(send_rows.shape, jnp.int8), counts, axis_name=axis_name, capacity=capacity, packed=False)
        written = jax.vmap(partial(_written_rows, capacity=capacity, out_rows=out_rows))(recv_counts, place)
        ct_output = jax.vmap(lambda ct, rows: ct.at[rows].set(0, mode="drop"))(ct_y, written)
    return [ct_x, None, None, None, ct_output]


ragged_all_to_all_p.def_effectful_abstract_eval(_ragged_all_to_all_abstract_eval)
lowering.register_lowerings(ragged_all_to_all_p, "ncclx_ragged_all_to_all", _ragged_all_to_all_attrs,
                             _ragged_all_to_all_cuda_route, aliases={4: 0})
batching.fancy_primitive_batchers[ragged_all_to_all_p] = _ragged_all_to_all_batching
ad.primitive_jvps[ragged_all_to_all_p] = _ragged_all_to_all_jvp
ad.primitive_transposes[ragged_all_to_all_p] = _ragged_all_to_all_transpose
