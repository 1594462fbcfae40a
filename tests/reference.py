"""NumPy references for the tests (jax.lax.ragged_all_to_all does not run on XLA:CPU)."""

import numpy as np


def plan_sends(counts, num_rows, capacity):
    """Per-peer (first_row, delivered, dropped) and per-chunk delivered counts, clamped as documented."""
    counts = np.asarray(counts, np.int64).reshape(counts.shape[0], -1)
    consumed = 0
    first, delivered, dropped = [], [], []
    chunks = np.zeros_like(counts)
    for peer, row in enumerate(counts):
        first.append(consumed)
        room, sent = capacity, 0
        for k, c in enumerate(row):
            rows = min(max(c, 0), num_rows - consumed)
            consumed += rows
            fits = min(rows, room)
            room -= fits
            sent += fits
            chunks[peer, k] = fits
        delivered.append(sent)
        dropped.append(int(np.abs(row).sum()) - sent)
    return np.array(first), np.array(delivered), np.array(dropped), chunks


def all_to_allv(xs, counts, capacity, layout):
    """xs[i]: member i's rows; counts[i]: its [N] or [N, K] send counts. Returns per-member (y, recv, dropped)."""
    n = len(xs)
    plans = [plan_sends(np.asarray(c).reshape(n, -1), len(x), capacity) for x, c in zip(xs, counts)]
    out = []
    for me in range(n):
        features = xs[me].shape[1:]
        padded = np.zeros((n, capacity, *features), xs[me].dtype)
        recv = np.zeros((n, plans[0][3].shape[1]), np.int32)
        packed_rows = []
        for src in range(n):
            first, delivered, _, chunks = plans[src]
            rows = xs[src][first[me]: first[me] + delivered[me]]
            padded[src, : len(rows)] = rows
            packed_rows.append(rows)
            recv[src] = chunks[me]
        if layout == "packed":
            y = np.zeros((n * capacity, *features), xs[me].dtype)
            joined = np.concatenate(packed_rows)
            y[: len(joined)] = joined
        else:
            y = padded
        out.append((y, recv.reshape(np.shape(counts[me])), plans[me][2].astype(np.int32)))
    return out
