"""all_to_allv_dynamic's plan in jnp: which send rows reach which peer, as the kernels clamp them.

One copy of ``xla_ffi/common/all_to_allv_plan.h`` for the code that must know the plan without running the
collective: the exchange over a vmapped axis, the transpose, and checksum mode; and :func:`locate`, which
finds the segment that holds a row. Counts are walked peer by peer, chunk by chunk; a negative count sends
nothing; counts that run past the send rows are cut at the end; each peer takes at most ``capacity`` rows,
chunk after chunk. It imports nothing of the package, so the ops and checksum can both use it.
"""

import jax
import jax.numpy as jnp
import numpy as np

_INT32_MAX = np.int32(np.iinfo(np.int32).max)


def plan(counts, num_rows: int, capacity: int):
    """From counts int32 ``[..., N, K]``: each chunk's first send row and the rows it delivers (both int32
    ``[..., N, K]``), and the rows dropped per peer (int32 ``[..., N]``, saturating at INT32_MAX)."""
    wanted = jnp.clip(counts, 0, num_rows)  # cut at the end anyway, and the sums stay in int32
    flat = wanted.reshape(*counts.shape[:-2], -1)
    through = jnp.cumsum(flat, axis=-1)  # send rows claimed through each chunk, peer after peer
    ends = jnp.minimum(through, num_rows).reshape(counts.shape)
    first = jnp.minimum(through - flat, num_rows).reshape(counts.shape)
    delivered = jnp.diff(jnp.minimum(jnp.cumsum(ends - first, axis=-1), capacity), axis=-1, prepend=0)
    magnitude = jnp.where(counts == np.iinfo(np.int32).min, _INT32_MAX, jnp.abs(counts))
    # int32 counts can request more than int32 holds: the kernels count in int64 and report at most INT32_MAX
    saturating_add = lambda a, b: jnp.where(a > _INT32_MAX - b, _INT32_MAX, a + b)  # noqa: E731
    dropped = jax.lax.reduce(magnitude - delivered, np.int32(0), saturating_add, (counts.ndim - 1,))
    return first, delivered, dropped


def peer_spans(counts, num_rows: int, capacity: int):
    """Per peer, from counts ``[..., N, K]``: the first send row of its first chunk and the rows it receives
    (both int32 ``[..., N]``). A peer's chunks are consecutive send rows, so this span is all it gets."""
    first, delivered, _ = plan(counts, num_rows, capacity)
    if not counts.shape[-1]:  # no chunks: nothing sent, every span empty
        return jnp.zeros(counts.shape[:-1], jnp.int32), jnp.zeros(counts.shape[:-1], jnp.int32)
    return first[..., 0], delivered.sum(axis=-1)


_MAX_COMPARED = 64  # segments up to which locate compares every position with every segment end


def locate(sizes, positions):
    """Positions in segments of ``sizes`` (non-negative ``[M]``, M >= 1) laid end to end: each position's
    segment (clamped to M - 1), its offset in that segment, and whether it lies inside them at all."""
    ends = jnp.cumsum(sizes)
    # Not searchsorted's default method: its loop is a while op, which XLA:GPU runs with a host round trip per
    # step.
    method = "compare_all" if sizes.shape[0] <= _MAX_COMPARED else "sort"
    segment = jnp.searchsorted(ends, positions, side="right", method=method).astype(jnp.int32)
    inside = segment < sizes.shape[0]
    segment = jnp.minimum(segment, sizes.shape[0] - 1)
    return segment, positions - (jnp.take(ends, segment) - jnp.take(sizes, segment)), inside
