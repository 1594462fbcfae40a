"""NumPy references for the tests (jax.lax.ragged_all_to_all does not run on XLA:CPU)."""

import ml_dtypes
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


def padded_words(top_k):
    return -(-top_k // 4) * 4


def moe_plan_sends(ids, num_experts, num_members, capacity, weights=None):
    """jax_ncclx._src.ops.moe_routing.plan_sends for one member, pair by pair: a dict of its results."""
    num_tokens, top_k = ids.shape
    local = num_experts // num_members
    key = ids.reshape(-1).astype(np.int64)
    key = np.where((key >= 0) & (key < num_experts), key, num_experts)
    order = np.argsort(key, kind="stable")
    return_slot = np.full(num_tokens * top_k, num_members * capacity)
    taken = [[] for _ in range(num_members)]  # each member's delivered pairs, in order
    for pair in order:
        if key[pair] == num_experts:
            continue
        member = key[pair] // local
        if len(taken[member]) < capacity:
            return_slot[pair] = member * capacity + len(taken[member])
            taken[member].append(pair)
    num_rows = min(num_tokens * min(top_k, num_members), num_members * capacity)
    send_token = np.full(num_rows, num_tokens)
    tags = np.full(num_rows * top_k, -1)
    rows_per_member = min(capacity, num_tokens)
    return_row = np.full((num_tokens, num_members), num_members * rows_per_member)
    token_counts, row = [], 0
    for member, pairs in enumerate(taken):
        tokens = sorted({pair // top_k for pair in pairs})
        row_of = {token: r for r, token in enumerate(tokens)}
        send_token[row: row + len(tokens)] = tokens
        for token, r in row_of.items():
            return_row[token, member] = member * rows_per_member + r
        for i, pair in enumerate(pairs):
            tags[row * top_k + i] = (row_of[pair // top_k] * top_k + pair % top_k) * local + key[pair] % local
        token_counts.append(len(tokens))
        row += len(tokens)
    send_counts = np.bincount(key, minlength=num_experts + 1)[:num_experts].reshape(num_members, local)
    padded = padded_words(top_k)
    suffix = np.full((num_rows, padded), -1)
    suffix[:, :top_k] = tags.reshape(num_rows, top_k)
    if weights is not None:  # the weights of each row's token, as float32 bits (zeros past the data)
        bits = np.zeros((num_rows, padded), np.int32)
        sent = send_token < num_tokens
        bits[sent, :top_k] = np.asarray(weights, np.float32)[send_token[sent]].view(np.int32)
        suffix = np.concatenate([suffix, bits], axis=1)
    result = dict(order=order, send_counts=send_counts, send_token=send_token, send_suffix=suffix,
                  token_counts=token_counts, return_slot=return_slot, return_row=return_row,
                  dropped=np.maximum(send_counts.sum(axis=1) - capacity, 0))
    return {name: np.asarray(value, np.int32) for name, value in result.items()}


def moe_place_received(suffixes, recv_tokens, local_experts, capacity, top_k, with_weights=False):
    """jax_ncclx._src.ops.moe_routing.place_received for one member, block by block, from the received rows'
    suffixes (int32 [N * R, words]): a dict of its results."""
    num_members = len(recv_tokens)
    rows_per_source = suffixes.shape[0] // num_members
    tags = suffixes[:, :top_k]
    num_rows = num_members * capacity
    lists = tags.reshape(num_members, -1)
    counts = np.zeros((num_members, local_experts), np.int64)
    for source, entries in enumerate(lists):
        for j, tag in enumerate(entries):
            if j // top_k < recv_tokens[source] and tag >= 0:
                counts[source, tag % local_experts] += 1
    received = num_members * rows_per_source
    expand = np.full(num_rows, received)
    pair_entry = np.full(num_rows, received * top_k)
    row_pairs = np.full(received * top_k, num_rows)
    to_expert_major = np.full(num_rows, num_rows)
    to_source_major = np.full(num_rows, num_rows)
    block_start, x = {}, 0
    for e in range(local_experts):
        for source in range(num_members):
            block_start[e, source] = x
            start = counts[source, :e].sum()
            for r in range(counts[source, e]):
                if x < num_rows:
                    if start + r < capacity:
                        to_expert_major[x] = source * capacity + start + r
                    tag = lists[source, start + r]  # (row * k + choice) * E_local + local expert
                    if tag >= 0 and tag // (top_k * local_experts) < rows_per_source:
                        expand[x] = source * rows_per_source + tag // (top_k * local_experts)
                        pair_entry[x] = expand[x] * top_k + tag // local_experts % top_k
                        row_pairs[pair_entry[x]] = x
                x += 1
    x = 0
    for source in range(num_members):
        for e in range(local_experts):
            for r in range(counts[source, e]):
                if x < num_rows:
                    to_source_major[x] = min(block_start[e, source] + r, num_rows)
                x += 1
    send_back_rows = [source * rows_per_source + r for source in range(num_members)
                      for r in range(min(max(int(recv_tokens[source]), 0), rows_per_source))]
    send_back_rows += [received] * (received - len(send_back_rows))
    result = dict(recv_counts=counts, group_sizes=counts.sum(axis=0), expand_rows=expand,
                  to_expert_major=to_expert_major, to_source_major=to_source_major, pair_entry=pair_entry,
                  row_pairs=row_pairs.reshape(received, top_k), send_back_rows=send_back_rows)
    result = {name: np.asarray(value, np.int32) for name, value in result.items()}
    padded = padded_words(top_k)
    result["recv_weights"] = (np.ascontiguousarray(suffixes[:, padded: padded + top_k]).view(np.float32)
                              if with_weights else np.zeros((received, 0), np.float32))
    return result


def moe_exchange_suffixes(plans, rows_per_source):
    """What each member receives of the members' plan_sends suffixes through dispatch's padded exchange, R rows
    per source: per member, (suffixes [N * R, words] with zero rows after each source's data, recv_tokens [N])."""
    num_members = len(plans)
    out = []
    for me in range(num_members):
        words = plans[me]["send_suffix"].shape[1]
        suffixes = np.zeros((num_members, rows_per_source, words), np.int32)
        recv_tokens = np.zeros(num_members, np.int32)
        for source, plan in enumerate(plans):
            first = int(np.sum(plan["token_counts"][:me]))
            rows = plan["send_suffix"][first: first + plan["token_counts"][me]]
            suffixes[source, : len(rows)] = rows
            recv_tokens[source] = len(rows)
        out.append((suffixes.reshape(-1, words), recv_tokens))
    return out


def count_pattern(pattern, n, k, seed, *, rows, capacity):
    """[n members, n peers, k chunks] send counts of one named pattern, for members of ``rows`` rows sending
    at most ``capacity`` rows to each peer."""
    rng = np.random.default_rng(seed)
    if pattern == "zero":
        return np.zeros((n, n, k), np.int32)
    if pattern == "one_peer":  # every member sends everything it may to peer 0
        counts = np.zeros((n, n, k), np.int32)
        counts[:, 0, :] = capacity // k
        return counts
    if pattern == "at_capacity":  # each peer gets exactly capacity rows from each member
        per_chunk = np.full(k, capacity // k)
        per_chunk[-1] += capacity - per_chunk.sum()
        return np.broadcast_to(per_chunk, (n, n, k)).astype(np.int32)
    if pattern == "overflow":  # more than capacity rows for some peers
        return rng.integers(0, 2 * capacity // k + 1, size=(n, n, k)).astype(np.int32)
    if pattern == "bad":  # negative counts and counts that run past the end of x
        return rng.integers(-3, rows, size=(n, n, k)).astype(np.int32)
    return rng.integers(0, rows // n + 1, size=(n, n, k)).astype(np.int32)  # random


def gather_rows(xs, send_rows):
    """Each member's x[send_rows] in NumPy, zero rows where the index is outside x."""
    out = []
    for x, index in zip(xs, send_rows):
        inside = (index >= 0) & (index < len(x))
        rows = x[np.where(inside, index, 0)]
        rows[~inside] = 0
        out.append(rows)
    return out


def reduce_in_rank_order(parts, op, dtype):
    """What the kernels compute: rank 0's values combined with rank 1's, then rank 2's, ...; 16-bit floats in
    float32, rounded once at the end."""
    accumulate = np.float32 if np.dtype(dtype) in (np.dtype(ml_dtypes.bfloat16), np.float16) else np.dtype(dtype)
    combine = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
    acc = parts[0].astype(accumulate)
    for part in parts[1:]:
        acc = combine(acc, part.astype(accumulate))
    return acc.astype(dtype)


def moe_masked_dispatch(tokens, ids, num_experts, capacity, weights=None):
    """moe.dispatch(layout="masked") of every member in NumPy, written from its spec (loops, no sorting tricks).

    tokens [N, T, H], ids [N, T, k] (an id outside [0, E) chooses no expert), weights [N, T, k] or None.
    Returns a dict of [N, ...] arrays named as the op's results: expert_rows [N, L, N * C, H], group_sizes,
    send_pairs, pair_slot, send_counts, dropped, recv_counts, row_pair, recv_weights ([N, L, N * C, or 0]),
    and per token row (R = min(T, L * C) per source, token order): recv_tokens [N, N], choice_rows
    [N, N * R, k], choice_weights [N, N * R, k or 0], send_back_rows [N, N * R], return_row [N, T, N]."""
    n, num_tokens, top_k = ids.shape
    local, pairs, capacity_rows = num_experts // n, num_tokens * top_k, n * capacity
    per_source = min(num_tokens, local * capacity)
    out = {"expert_rows": np.zeros((n, local, capacity_rows, tokens.shape[2]), tokens.dtype),
           "group_sizes": np.zeros((n, local), np.int32), "send_pairs": np.full((n, pairs), pairs, np.int32),
           "pair_slot": np.full((n, pairs), num_experts * capacity, np.int32),
           "send_counts": np.zeros((n, n, local), np.int32), "dropped": np.zeros((n, n), np.int32),
           "recv_counts": np.zeros((n, n, local), np.int32),
           "row_pair": np.full((n, local, capacity_rows), n * pairs, np.int32),
           "recv_weights": np.zeros((n, local, capacity_rows if weights is not None else 0), np.float32)}
    sent = {}  # (source, destination, local expert) -> the source's kept pairs, in rank order
    for src in range(n):
        flat = ids[src].reshape(-1)
        seen = {}
        for p, expert in enumerate(flat):
            if not 0 <= expert < num_experts:
                continue
            rank = seen.get(expert, 0)
            seen[expert] = rank + 1
            dst, e = divmod(int(expert), local)
            if rank >= capacity:
                out["dropped"][src, dst] += 1
                continue
            out["pair_slot"][src, p] = expert * capacity + rank
            sent.setdefault((src, dst, e), []).append(p)
        kept = np.flatnonzero(out["pair_slot"][src] < num_experts * capacity)
        kept = kept[np.argsort(out["pair_slot"][src][kept])]
        out["send_pairs"][src, : len(kept)] = kept
    for (src, dst, e), kept in sent.items():
        out["send_counts"][src, dst, e] = len(kept)
        out["recv_counts"][dst, src, e] = len(kept)
    for dst in range(n):
        for e in range(local):
            at = 0
            for src in range(n):
                for p in sent.get((src, dst, e), []):
                    out["expert_rows"][dst, e, at] = tokens[src, p // top_k]
                    out["row_pair"][dst, e, at] = src * pairs + p
                    if weights is not None:
                        out["recv_weights"][dst, e, at] = weights[src].reshape(-1)[p]
                    at += 1
            out["group_sizes"][dst, e] = at
    received = n * per_source
    out |= {"recv_tokens": np.zeros((n, n), np.int32),
            "choice_rows": np.full((n, received, top_k), local * capacity_rows, np.int32),
            "choice_weights": np.zeros((n, received, top_k if weights is not None else 0), np.float32),
            "send_back_rows": np.full((n, received), received, np.int32),
            "return_row": np.full((n, num_tokens, n), received, np.int32)}
    for dst in range(n):
        for src in range(n):
            # Source src's tokens with a kept pair at dst, in token order: its rows there.
            row_of = {}
            for e in range(local):
                for p in sent.get((src, dst, e), []):
                    row_of.setdefault(p // top_k, None)
            for r, t in enumerate(sorted(row_of)):
                row_of[t] = src * per_source + r
                out["return_row"][src, t, dst] = dst * per_source + r
            out["recv_tokens"][dst, src] = len(row_of)
            for e in range(local):
                start = sum(len(sent.get((s, dst, e), [])) for s in range(src))
                for j, p in enumerate(sent.get((src, dst, e), [])):
                    out["choice_rows"][dst, row_of[p // top_k], p % top_k] = e * capacity_rows + start + j
                    if weights is not None:
                        out["choice_weights"][dst, row_of[p // top_k], p % top_k] = weights[src].reshape(-1)[p]
        packed = [src * per_source + r for src in range(n) for r in range(out["recv_tokens"][dst, src])]
        out["send_back_rows"][dst, :len(packed)] = packed
    return out


def moe_masked_combine(expert_out, dispatched, num_tokens, weights=None):
    """moe.combine of a masked dispatch in NumPy (float64): expert_out [N, L, N * C, H'], ``dispatched`` the
    reference's dict; weights [N, T, k] (given to combine) or None (the dispatched recv_weights). Returns
    [N, T, H'] float64: out[t] = sum over t's kept pairs of weight * the pair's expert row."""
    n, pairs = dispatched["pair_slot"].shape
    top_k = pairs // num_tokens
    out = np.zeros((n, num_tokens, expert_out.shape[-1]), np.float64)
    for dst in range(n):
        for (e, i), tag in np.ndenumerate(dispatched["row_pair"][dst]):
            if tag >= n * pairs:
                continue
            src, p = divmod(int(tag), pairs)
            w = dispatched["recv_weights"][dst, e, i] if weights is None else weights[src, p // top_k, p % top_k]
            out[src, p // top_k] += float(w) * np.asarray(expert_out[dst, e, i], np.float64)
    return out
