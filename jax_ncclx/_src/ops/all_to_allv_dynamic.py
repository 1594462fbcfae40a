"""all_to_allv_dynamic: NCCLX's AllToAllvDynamic, an all-to-all-v whose split counts stay on the device.

Each member sends a variable number of rows to every peer; the counts are device arrays (no host sync), they
travel with the data, and the receiver learns them from the result. Rows beyond a static per-source capacity
are dropped and counted, so bad or unlucky counts never write out of bounds.

The primitive is batched: x ``[B, X, ...]``, counts ``[B, N, K]`` and the optional send_rows ``[B, S]`` and
suffix ``[B, S, G]`` move in one collective call, which is how ``vmap`` over a non-mesh axis stays one call (a
suffix comes with send_rows: the FFI binds them as optional operands in that order). Sharding model: varying in,
varying out; outside ``shard_map`` the leading dimension of every global array (x, counts, send_rows, suffix and
the three results) is sharded over the axis.

Clamping (the same code runs on CPU and GPU, ``xla_ffi/common/all_to_allv_plan.h``; in jnp,
``all_to_allv_plan.py``): counts are walked peer by peer, chunk by chunk; a negative count sends nothing; counts
that run past the S send rows are cut at the end; each peer takes at most ``max_recv_per_peer`` rows from this
member, chunk after chunk. ``dropped[j]`` counts requested rows that did not reach peer j, with a negative count
contributing its magnitude, so any nonzero ``dropped`` flags overflow or bad counts.
"""


from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad
from jax.interpreters import batching
from jax.sharding import PartitionSpec as P

from jax_ncclx._src import all_to_allv_plan
from jax_ncclx._src import checksum
from jax_ncclx._src import config
from jax_ncclx._src import contract
from jax_ncclx._src import global_view
from jax_ncclx._src import lib
from jax_ncclx._src import lowering
from jax_ncclx._src import nvlink
from jax_ncclx._src import primitive
from jax_ncclx._src import validation
from jax_ncclx._src.ops.take_rows import add_rows
from jax_ncclx._src.ops.take_rows import outside_to_end

LAYOUTS = ("padded", "packed")


def all_to_allv_dynamic(x, send_counts, axis_name, *, max_recv_per_peer: int, layout: str = "padded",
                        send_rows=None, suffix=None):
    """All-to-all-v with device-resident counts.

    Args:
      x: ``[S, ...]`` rows grouped by destination: the rows for peer 0 first, then peer 1, ...; with K chunks
        per peer, chunk (j, 0), (j, 1), ... in that order. Any number or boolean dtype (float8 and complex
        included). With ``send_rows``, x is ``[X, ...]`` with any X, and the send rows are gathered from it.
        With ``suffix``, x is ``[X, F]``.
      send_counts: int32 ``[N]`` (rows for each peer) or ``[N, K]`` (rows of each chunk, e.g. K local experts);
        N is the size of ``axis_name``. Other integer dtypes are converted to int32, values beyond its
        range saturated (a count too large stays too large).
      axis_name: the mesh axis, or a tuple of axes taken as one (static; the first axis major, as
        ``jax.lax.axis_index`` of the tuple).
      max_recv_per_peer: C, the most rows taken from any one source (static Python int, 0 to 2**31 - 1).
      layout: ``"padded"``: y is ``[N, C, ...]`` and ``y[i, :r_i]`` holds the rows from source i in send
        order, zeros after. ``"packed"``: y is ``[N * C, ...]`` with all received rows packed from row 0,
        source-major then chunk-major, zeros after (static; default ``"padded"``).
      send_rows: None, or integer ``[S]``: send row s is ``x[send_rows[s]]`` (a zero row where the index is
        outside ``[0, X)``), read by the kernel that sends it, so the gather costs no copy of its own. It
        replaces ``all_to_allv_dynamic(x[send_rows], ...)``; the counts split the S send rows.
      suffix: None, or ``[S, G]`` with x's dtype: send row s is ``concat(x[send_rows[s]], suffix[s])`` (or
        ``concat(x[s], suffix[s])`` without send_rows), so y's rows have F + G columns. Per-row metadata
        (tags, weights bitcast to x's dtype) travels with the rows without a copy that appends it first.

    Returns:
      ``(y, recv_counts, dropped)``: y as above with x's dtype; recv_counts int32 ``[N]`` or ``[N, K]`` (the
      shape of send_counts), the rows each source delivered to this member per chunk; dropped int32 ``[N]``,
      the rows this member asked to send to each peer that did not arrive. The counts are walked peer by
      peer, chunk by chunk: a negative count sends nothing (its magnitude counts as dropped), counts that run
      past the S send rows are cut at the end, and each peer takes at most C rows from this member; so any
      nonzero ``dropped`` flags overflow or bad counts, and no count writes out of bounds. Each peer's rows
      start in x at the sum of the earlier non-negative counts as given: a count cut at C does not move the
      next peer's rows.

    Differentiable in x and the suffix (the VJP sends cotangents back to the rows they came from, at the cost
    of one extra exchange of counts, and sums them over the send rows that read one row of x) and vmap-able
    over non-mesh axes (one collective call for the whole batch) or over its own axis (every member here,
    the rows moved by gathers). The counts and send_rows get no gradient.

    Raises:
      NameError: ``axis_name`` is not bound by an enclosing ``jax.shard_map`` (and no mesh shards ``x``).
      ValueError: outside ``jax.shard_map``, an argument sharded otherwise than over ``axis_name`` along its
        leading dimension, or whose leading dimension the axis size does not divide.
      ValueError: a scalar x; send_counts not ``[N]`` / ``[N, K]``; ``max_recv_per_peer`` out of range; an
        unknown layout; a suffix whose shape or dtype does not fit.
      TypeError: an argument that is no array (a Python list); non-integer send_counts; send_rows not a 1-D
        integer array; ``max_recv_per_peer`` not a static int; a dtype the op cannot take (not a number or
        boolean, or under a byte).
      NotImplementedError: vmap over ``axis_name`` inside a tuple with mesh axes; a shard_map that leaves a mesh
        axis of size > 1 to the compiler.
    """
    axis_name = validation.check_axis_name(axis_name, "all_to_allv_dynamic")
    max_recv_per_peer = validation.check_static_int(max_recv_per_peer, "max_recv_per_peer", "all_to_allv_dynamic",
                                                   minimum=0, maximum=contract.MAX_CAPACITY)
    if layout not in LAYOUTS:
        raise ValueError(f"jax_ncclx.all_to_allv_dynamic: layout must be one of {LAYOUTS}, got {layout!r}")
    optional = {name: value for name, value in (("send_rows", send_rows), ("suffix", suffix)) if value is not None}
    validation.check_arrays("all_to_allv_dynamic", x=x, send_counts=send_counts, **optional)
    if not validation.is_bound(axis_name):
        def op(x, send_counts, *values):
            return all_to_allv_dynamic(x, send_counts, axis_name, max_recv_per_peer=max_recv_per_peer,
                                       layout=layout, **dict(zip(optional, values)))
        args = (x, send_counts, *optional.values())
        return global_view.global_view(op, args, axis_name, "all_to_allv_dynamic", (P(axis_name),) * len(args),
                                     (P(axis_name),) * 3)

    size = jax.lax.axis_size(axis_name)
    if jnp.ndim(x) < 1:
        raise ValueError("jax_ncclx.all_to_allv_dynamic: x must have a leading row dimension, got a scalar")
    counts_dtype = jax.typeof(send_counts).dtype
    if not jnp.issubdtype(counts_dtype, jnp.integer):
        raise TypeError(f"jax_ncclx.all_to_allv_dynamic: send_counts must be integers, got {counts_dtype}")
    counts_shape = jnp.shape(send_counts)
    if len(counts_shape) not in (1, 2) or counts_shape[0] != size:
        raise ValueError(
            f"jax_ncclx.all_to_allv_dynamic: send_counts must be [N] or [N, K] with N = {size} (the size of "
            f"axis {axis_name!r}), got shape {counts_shape}")
    if send_rows is not None:
        rows_dtype = jax.typeof(send_rows).dtype
        if not jnp.issubdtype(rows_dtype, jnp.integer) or jnp.ndim(send_rows) != 1:
            raise TypeError(f"jax_ncclx.all_to_allv_dynamic: send_rows must be a 1-D integer array, got "
                            f"{rows_dtype}{list(jnp.shape(send_rows))}")
    if suffix is not None:
        num_rows = jnp.shape(x)[0] if send_rows is None else jnp.shape(send_rows)[0]
        suffix_shape, suffix_dtype = jnp.shape(suffix), jax.typeof(suffix).dtype
        if jnp.ndim(x) != 2 or len(suffix_shape) != 2 or suffix_shape[0] != num_rows or \
                suffix_dtype != jax.typeof(x).dtype:
            raise ValueError(
                f"jax_ncclx.all_to_allv_dynamic: a suffix needs x [X, F] and suffix [S, G] with x's dtype and "
                f"S = {num_rows} (the send rows), got x {jax.typeof(x).dtype}{list(jnp.shape(x))} and suffix "
                f"{suffix_dtype}{list(suffix_shape)}")
        if send_rows is None:  # the kernels take a suffix only after send_rows
            send_rows = jnp.arange(num_rows, dtype=jnp.int32)
    validation.check_dtype(x, "all_to_allv_dynamic")
    extra = () if send_rows is None else (validation.as_int32(send_rows)[None],)
    if suffix is not None:
        extra += (primitive.ensure_varying(suffix, axis_name)[None],)
    counts = validation.as_int32(send_counts).reshape(1, size, -1)
    y, recv_counts, dropped = all_to_allv_dynamic_p.bind(
        primitive.ensure_varying(x, axis_name)[None], counts, *extra, axis_name=axis_name,
        capacity=int(max_recv_per_peer), packed=layout == "packed")
    if config.current().checksum:
        sent = x if send_rows is None else jnp.take(x, outside_to_end(extra[0][0], x.shape[0]), axis=0,
                                                      mode="fill", fill_value=0)
        if suffix is not None:
            sent = jnp.concatenate([sent, suffix], axis=1)
        checksum.verify_all_to_allv(axis_name, sent, counts[0], y[0], recv_counts[0], int(max_recv_per_peer),
                                    layout == "packed")
    return y[0], recv_counts.reshape(counts_shape), dropped[0]


all_to_allv_dynamic_p = primitive.make_collective("all_to_allv_dynamic", multiple_results=True)


def _row_features(x_shape, suffix):
    """The trailing dims of a row that travels: x's, with the suffix's G columns appended to F."""
    features = tuple(x_shape[2:])
    return (features[0] + suffix[0].shape[2],) if suffix else features


def _out_shapes(x_shape, counts_shape, size, capacity, packed, suffix=()):
    batch, features = x_shape[0], _row_features(x_shape, suffix)
    y = (batch, size * capacity, *features) if packed else (batch, size, capacity, *features)
    return y, tuple(counts_shape), (batch, size)


def _all_to_allv_dynamic_abstract_eval(x, counts, *others, axis_name, capacity, packed):
    """``others``: send_rows and the suffix, where given."""
    size = jax.lax.axis_size(axis_name)
    y, recv, dropped = _out_shapes(x.shape, counts.shape, size, capacity, packed, others[1:])
    outs = [primitive.output_aval(x, axis_name, counts, *others, shape=y),
            primitive.output_aval(counts, axis_name, x, *others, shape=recv, dtype=jnp.int32),
            primitive.output_aval(counts, axis_name, x, *others, shape=dropped, dtype=jnp.int32)]
    return outs, primitive.effects(axis_name)


def _all_to_allv_dynamic_attrs(*, capacity, packed):
    # Decoded as the handlers' ExchangeAttrs (xla_ffi/ops/all_to_allv/all_to_allv_checks.h).
    return {"exchange": dict(capacity=np.int64(capacity), packed=np.bool_(packed))}


def _all_to_allv_dynamic_cuda_route(ctx, comm_id, size, *, capacity, packed):
    x, counts, *send_rows_and_suffix = ctx.avals_in
    return exchange_route("all_to_allv_dynamic", comm_id, size, x, counts.shape,
                          _row_features(x.shape, send_rows_and_suffix[1:]), capacity, received_apart=packed)


def exchange_route(op: str, comm_id, size, x, counts_shape, features, capacity: int, *, received_apart: bool):
    """The CUDA route of an exchange on these kernels (``op``: all_to_allv_dynamic or ragged_all_to_all): the
    NVLink kernel when the communicator's ranks reach each other over NVLink, else the NCCL path, whose
    workspace holds a receive buffer too when rows do not land where NCCL receives them (``received_apart``:
    the packed layout, placed rows)."""
    batch, _, chunks = counts_shape
    row_bytes = int(np.prod(features, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    settings = config.current()
    direct = nvlink.writes_direct(settings)
    if settings.transport != "nccl":
        staging, slots = lib.cuda_module().all_to_allv_symmetric_bytes(batch, size, chunks, capacity, row_bytes,
                                                                       direct)
        if nvlink.usable(op, comm_id):
            attrs = {"blocks": np.int64(settings.nvlink_blocks), "direct": np.bool_(direct)}
            return lowering.CudaRoute("nvlink", attrs, staging_bytes=staging, slot_bytes=slots)
    workspace = lib.cuda_module().all_to_allv_workspace_bytes(batch, size, chunks, capacity, row_bytes, received_apart)
    return lowering.CudaRoute(workspace_bytes=workspace)


def _all_to_allv_dynamic_batching(axis_data, args, dims, *, axis_name, capacity, packed):
    if primitive.batches_own_axis(axis_data, axis_name, "all_to_allv_dynamic"):
        members = [primitive.members_first(axis_data, a, d) for a, d in zip(args, dims)]
        return exchange_between_members(*members, capacity=capacity, packed=packed), [0, 0, 0]
    return primitive.fold_vmap_into_batch(all_to_allv_dynamic_p, axis_data, args, dims, axis_name=axis_name,
                                          capacity=capacity, packed=packed)


def exchange_between_members(x, counts, *send_rows_and_suffix, capacity, packed):
    """The exchange over a vmapped axis, whose members are all here: every operand and result leads with the
    member dimension N (then the primitive's batch B), and the rows move by gathers, clamped as the kernels
    clamp (module docstring)."""
    sent = x
    if send_rows_and_suffix:
        index = outside_to_end(send_rows_and_suffix[0], x.shape[2])
        sent = jax.vmap(jax.vmap(lambda rows, i: jnp.take(rows, i, axis=0, mode="fill", fill_value=0)))(x, index)
        if len(send_rows_and_suffix) == 2:
            sent = jnp.concatenate([sent, send_rows_and_suffix[1]], axis=3)
    # first [N, B, N, K], delivered ..., dropped [N, B, N]
    first, delivered, dropped = all_to_allv_plan.plan(counts, sent.shape[2], capacity)
    # receiver j's rows from source i: source i's send rows, chunk after chunk of its plan for peer j
    pieces = jax.vmap(jax.vmap(jax.vmap(partial(_piece, capacity=capacity), (None, 0, 0)), (0, 0, 0)), (0, 0, 0))
    padded = jnp.swapaxes(pieces(sent, first, delivered), 0, 2)                      # [N(j), B, N(i), C, ...]
    recv_counts = jnp.swapaxes(delivered, 0, 2)                                       # [N(j), B, N(i), K]
    if packed:
        padded = jax.vmap(jax.vmap(partial(_pack, capacity=capacity)))(padded, recv_counts.sum(axis=3))
    return padded, recv_counts, dropped


def _piece(sent, first, delivered, *, capacity):
    """``[C, ...]``: what one source sends one peer, from its send rows and its plan for that peer (``[K]``)."""
    if not delivered.shape[0]:  # no chunks, nothing sent
        return jnp.zeros((capacity, *sent.shape[1:]), sent.dtype)
    chunk, within, inside = all_to_allv_plan.locate(delivered, jnp.arange(capacity))
    row = jnp.where(inside, jnp.take(first, chunk) + within, sent.shape[0])
    return jnp.take(sent, row, axis=0, mode="fill", fill_value=0)


def _pack(padded, totals, *, capacity):
    """``[N, C, ...]`` padded rows and the rows from each source ``[N]`` -> ``[N * C, ...]`` packed from row 0."""
    rows = padded.shape[0] * capacity
    source, slot, inside = all_to_allv_plan.locate(totals, jnp.arange(rows))
    flat = jnp.where(inside, source * capacity + slot, rows)
    return jnp.take(padded.reshape(-1, *padded.shape[2:]), flat, axis=0, mode="fill", fill_value=0)


def _all_to_allv_dynamic_jvp(primals, tangents, *, axis_name, capacity, packed):
    """Linear in x and the suffix; counts and send_rows are integers."""
    params = dict(axis_name=axis_name, capacity=capacity, packed=packed)
    y, recv_counts, dropped = all_to_allv_dynamic_p.bind(*primals, **params)
    linear = [ad.instantiate_zeros(t) for t in (tangents[0], *tangents[3:])]
    ty, _, _ = all_to_allv_dynamic_p.bind(linear[0], *primals[1:3], *linear[1:], **params)
    integer_zeros = [ad.Zero(jax.typeof(v).to_tangent_aval()) for v in (recv_counts, dropped)]
    return [y, recv_counts, dropped], [ty, *integer_zeros]


def all_to_allv_dynamic_transpose(cts, x, counts, *send_rows_and_suffix, axis_name, capacity, packed):
    """Sends each received row's cotangent back to the send row it came from (dropped rows get zeros), then,
    with send_rows, sums the send rows' cotangents into the rows of x they read; the suffix's columns of each
    send row's cotangent are the suffix's cotangent."""
    send_rows, suffix = send_rows_and_suffix[:1], send_rows_and_suffix[1:]
    x_shape = x.aval.shape if ad.is_undefined_primal(x) else jnp.shape(x)
    ct_y = ad.instantiate_zeros(cts[0])
    batch, source_rows = x_shape[:2]
    num_rows = send_rows[0].shape[1] if send_rows else source_rows
    features = ct_y.shape[2:] if packed else ct_y.shape[3:]
    params = dict(axis_name=axis_name, capacity=capacity)
    # What each source delivered here (the forward's recv_counts), exchanged again with one-byte rows (not
    # zero-size ones: XLA 0.11.2's Shardy pass crashes on zero-size values crossing a shard_map boundary).
    _, recv_counts, _ = all_to_allv_dynamic_p.bind(jnp.zeros((batch, num_rows), jnp.int8), counts, packed=False,
                                                   **params)
    size = recv_counts.shape[1]
    if packed:
        rows, back_counts = ct_y, recv_counts
    else:  # padded rows: send each source its C rows, the part after its rows as one extra (ignored) chunk
        rows = ct_y.reshape(batch, size * capacity, *features)
        gap = capacity - recv_counts.sum(axis=2, keepdims=True)
        back_counts = jnp.concatenate([recv_counts, gap], axis=2)
    back, returned, _ = all_to_allv_dynamic_p.bind(rows, back_counts, packed=False, **params)
    delivered = returned[:, :, : counts.shape[2]].sum(axis=2)  # rows each peer got from x   [B, N]
    first = all_to_allv_plan.peer_spans(counts, num_rows, capacity)[0]  # [B, N]
    r = jnp.arange(num_rows)
    peer = jnp.sum(first[:, None, :] <= r[None, :, None], axis=2) - 1  # owner of row r        [B, S]
    offset = r[None, :] - jnp.take_along_axis(first, peer, axis=1)
    valid = offset < jnp.take_along_axis(delivered, peer, axis=1)
    slot = peer * capacity + jnp.clip(offset, 0, max(capacity - 1, 0))
    flat = back.reshape(batch, size * capacity, *features)
    gathered = jnp.take_along_axis(flat, slot.reshape(batch, num_rows, *([1] * len(features))), axis=1) \
        if capacity else jnp.zeros((batch, num_rows, *features), ct_y.dtype)
    mask = valid.reshape(batch, num_rows, *([1] * len(features)))
    ct_sent = jnp.where(mask, gathered, jnp.zeros((), ct_y.dtype))
    if not send_rows:
        return [ct_sent, None]
    width = x_shape[2] if suffix else None  # the columns of a send row that came from x
    ct_x = add_rows(x_shape, send_rows[0], ct_sent[..., :width]) if ad.is_undefined_primal(x) else None
    ct_suffix = [ct_sent[..., width:] if ad.is_undefined_primal(s) else None for s in suffix]
    return [ct_x, None, None, *ct_suffix]


all_to_allv_dynamic_p.def_effectful_abstract_eval(_all_to_allv_dynamic_abstract_eval)
lowering.register_lowerings(all_to_allv_dynamic_p, "ncclx_all_to_allv_dynamic", _all_to_allv_dynamic_attrs,
                             _all_to_allv_dynamic_cuda_route)
batching.fancy_primitive_batchers[all_to_allv_dynamic_p] = _all_to_allv_dynamic_batching
ad.primitive_jvps[all_to_allv_dynamic_p] = _all_to_allv_dynamic_jvp
ad.primitive_transposes[all_to_allv_dynamic_p] = all_to_allv_dynamic_transpose
