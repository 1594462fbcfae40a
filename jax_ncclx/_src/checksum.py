"""Checksum mode (``JAX_NCCLX_CHECKSUM=1``): collectives verify their payload end to end.

When the mode is on at trace time, each data-moving call of a public op also computes, on the sender, a
checksum of every block it sends, ships those checksums through XLA's own collectives (an independent path),
and compares them on the receiver with checksums of what arrived. A mismatch names the op, the axis, the
receiving rank and the rank(s) whose data arrived corrupted: it is logged at error level as soon as the
receiver's check runs, and ``jax_ncclx.check_errors()`` raises it (once). Checks run as host callbacks
beside the program, so the program's outputs are not held back for them.

* all_gather, all_to_all, ppermute and all_to_allv_dynamic: per source block (for all_to_allv_dynamic, the
  rows that actually reached the receiver, after clamping);
* all_reduce: a reduction has no per-source payload to compare, so every rank checks that all ranks hold
  the same result (the ranks that differ from the majority are named);
* reduce_scatter is not covered (each rank holds a different, reduced chunk), nor are the collectives that
  autodiff and vmap rules emit (only calls of the public functions are).

The checksum is a position-weighted sum of the bytes modulo 2^32 with odd weights, so any single changed
byte (and any changed word) is detected. The mode costs an extra small XLA collective and a pass over the
data per call: it is for debugging, not for production runs.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jax_ncclx._src import all_to_allv_plan

logger = logging.getLogger("jax_ncclx")

_GOLDEN = np.uint32(2654435761)
_ROW_PRIME = np.uint32(40503)

_mismatches: list[str] = []


def take_mismatches() -> list[str]:
    """Messages of the checksum mismatches seen since the last call, oldest first (after waiting for the checks
    of programs already dispatched)."""
    jax.effects_barrier()
    taken = list(_mismatches)
    del _mismatches[: len(taken)]
    return taken


def _odd_weights(positions, prime) -> jax.Array:
    """Odd uint32 weights of ``positions``: a change d of one byte (0 < |d| < 256) changes the sum by an odd
    multiple of d, never 0 modulo 2^32."""
    return jnp.asarray(positions).astype(jnp.uint32) * prime | jnp.uint32(1)


def _row_sums(x, rows: int) -> jax.Array:
    """uint32 [rows]: the checksum of each of ``rows`` equal slices of ``x``'s bytes."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    elif jnp.iscomplexobj(x):  # bitcast_convert_type takes no complex numbers: their parts, side by side
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    data = x if x.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(x, jnp.uint8)
    data = data.reshape(rows, -1).astype(jnp.uint32) + jnp.uint32(1)
    return jnp.sum(data * _odd_weights(jnp.arange(data.shape[1]), _GOLDEN), axis=1, dtype=jnp.uint32)


def _report(op: str, axis_name, bad, what: str):
    """Logs and keeps a mismatch on each rank whose ``bad`` [N] (per source rank) has a true entry."""
    me = jax.lax.axis_index(axis_name)

    def check(bad, me):
        ranks = np.flatnonzero(np.asarray(bad)).tolist()
        if not ranks:
            return
        message = f"checksum mismatch in {op} on axis {axis_name!r}: rank {int(me)} {what} {ranks}"
        logger.error("jax_ncclx: %s", message)
        _mismatches.append(message)  # check_errors puts its "jax_ncclx: " in front

    jax.debug.callback(check, bad, me)


def verify_all_gather(axis_name, x, y):
    """y [N, *x.shape] = all_gather(x)."""
    expected = jax.lax.all_gather(_row_sums(x.reshape(1, -1), 1)[0], axis_name)
    _report("all_gather", axis_name, _row_sums(y, y.shape[0]) != expected, "received corrupted data from rank(s)")


def verify_all_to_all(axis_name, blocks, y):
    """blocks [N, ...] sent (block j to rank j), y [N, ...] received (block i from rank i)."""
    size = blocks.shape[0]
    expected = jax.lax.all_to_all(_row_sums(blocks, size), axis_name, 0, 0)
    _report("all_to_all", axis_name, _row_sums(y, size) != expected, "received corrupted data from rank(s)")


def verify_ppermute(axis_name, x, y, sources):
    """y = ppermute(x); ``sources[r]`` is the rank that sends to rank r, or -1."""
    size = len(sources)
    perm = [(s, r) for r, s in enumerate(sources) if s >= 0]
    expected = jax.lax.ppermute(_row_sums(x.reshape(1, -1), 1), axis_name, perm)[0]
    me = jax.lax.axis_index(axis_name)
    source = jnp.asarray(sources, jnp.int32)[me]
    bad = (jnp.arange(size) == source) & (_row_sums(y.reshape(1, -1), 1)[0] != expected)
    _report("ppermute", axis_name, bad, "received corrupted data from rank(s)")


def verify_all_reduce(axis_name, y):
    """Every rank must hold the same result: names the ranks whose result differs from the most common one."""
    sums = jax.lax.all_gather(_row_sums(y.reshape(1, -1), 1)[0], axis_name)
    agree = jnp.sum(sums[:, None] == sums[None, :], axis=1)
    majority = sums[jnp.argmax(agree)]
    _report("all_reduce", axis_name, sums != majority, "sees a result different from the majority on rank(s)")


def _segment_sums(row_sums, first, count):
    """uint32 [N]: for each j, sum over r < count[j] of row_sums[first[j] + r] * weight(r)."""
    n_rows = row_sums.shape[0]
    relative = jnp.arange(n_rows)[None, :] - first[:, None]  # [N, rows]
    inside = (relative >= 0) & (relative < count[:, None])
    weights = jnp.where(inside, _odd_weights(jnp.clip(relative, 0), _ROW_PRIME), 0)
    return jnp.sum(weights.astype(jnp.uint32) * row_sums[None, :], axis=1, dtype=jnp.uint32)


def verify_all_to_allv(axis_name, x, counts, y, recv_counts, capacity: int, packed: bool):
    """x [S, ...] with counts [N, K] sent; y and recv_counts [N, K] received (padded [N, C, ...] or packed
    [N * C, ...])."""
    size = counts.shape[0]
    first, delivered = all_to_allv_plan.peer_spans(counts, x.shape[0], capacity)
    sent = _segment_sums(_row_sums(x, x.shape[0]), first, delivered) if x.shape[0] else jnp.zeros(size, jnp.uint32)
    expected = jax.lax.all_to_all(sent, axis_name, 0, 0)
    got_rows = recv_counts.astype(jnp.int32).sum(axis=1)
    flat = y.reshape(size * capacity, *y.shape[2:]) if not packed else y
    if capacity == 0:
        received = jnp.zeros(size, jnp.uint32)
    else:
        offsets = jnp.cumsum(got_rows) - got_rows if packed else jnp.arange(size) * capacity
        received = _segment_sums(_row_sums(flat, flat.shape[0]), offsets, got_rows)
    _report("all_to_allv_dynamic", axis_name, received != expected, "received corrupted data from rank(s)")
