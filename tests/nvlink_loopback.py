"""NumPy front end of the test-only module ``jax_ncclx._ncclx_loopback``: the NVLink kernels run with 2 to 8
logical ranks on one GPU, each with its own stream and symmetric memory (xla_ffi/testing/nvlink_loopback.cc).
Arrays are [calls, ranks, ...]: call c of rank r reads x[c, r] and writes y[c, r].

Every function returns, besides the outputs, one dict per rank: ``calls_finished`` (the rank's epoch),
``fault`` ("healthy", "gave_up" or "aborted"), ``fault_call``, ``aborted_by`` (-1 or a rank), ``missing``
(the ranks its waits named), ``trace`` (its device timeline, one dict per traced call with DeviceTraceRecord's
fields) and ``blocks`` (the grid of its kernels).
"""

import ml_dtypes
import numpy as np
import pytest

from conftest import gpu_skip_reason
from jax_ncclx._src import contract

PROTOCOLS = {"ll128": 0, "ll": 1, "simple": 2}
ALGORITHMS = {"one-shot": 1, "two-shot": 2}
REDUCE_OPS = {"sum": 0, "max": 1, "min": 2}
REDUCE_TYPES = {np.dtype(np.float32): 0, np.dtype(ml_dtypes.bfloat16): 1, np.dtype(np.float16): 2,
                np.dtype(np.int32): 3}


def module():
    """The loopback module; skips the test where no GPU or no CUDA build is, and fails where the build lacks
    the test-only modules (a GPU run must not skip these tests)."""
    reason = gpu_skip_reason(minimum=1)
    if reason:
        pytest.skip(reason)
    from jax_ncclx._src import lib

    if not lib.testing_built():
        pytest.fail(f"jax_ncclx._ncclx_loopback is test-only and this build lacks it: {lib.TESTING_BUILD_HINT}")
    from jax_ncclx import _ncclx_loopback  # built: failing to import it is a failure

    return _ncclx_loopback


def collective(op, x, *, algorithm="one-shot", protocol="ll128", reduce="sum", direct=False, **options):
    """One NVLink collective on x [calls, ranks, elements] (all_to_all, reduce_scatter: elements divisible by
    ranks); options: blocks, trace, graph, timeout_ms, absent. Returns (y [calls, ranks, elements, or ranks *
    elements for all_gather, elements / ranks for reduce_scatter], ranks)."""
    x = np.ascontiguousarray(x)
    calls, size, elements = x.shape
    done = module().collective(op, x.tobytes(), size=size, calls=calls, bytes=elements * x.itemsize,
                               element_bytes=x.itemsize, algorithm=ALGORITHMS[algorithm],
                               protocol=PROTOCOLS[protocol], reduce_op=REDUCE_OPS[reduce],
                               reduce_type=REDUCE_TYPES.get(x.dtype, 0), direct=direct, **options)
    y = np.frombuffer(done["y"], x.dtype).reshape(calls, size, -1)
    return y, with_grid(done)


def all_to_allv(x, counts, capacity, *, layout, direct, send_rows=None, suffix=None, place=None, out_rows=0,
                **options):
    """The all_to_allv_dynamic kernel. x [calls, ranks, B, X, F...], counts int32 [calls, ranks, B, ranks, K],
    send_rows int32 [calls, ranks, B, S] or None, suffix [calls, ranks, B, S, G...] or None (rows travel as
    raw bytes: x's features, then the suffix's). Returns (y uint8 [calls, ranks, B, ranks * capacity,
    row bytes], recv_counts [calls, ranks, B, ranks, K], dropped [calls, ranks, B, ranks], ranks); the padded
    layout's [ranks, capacity] rows are the same bytes flattened. With ``place`` (int32 [calls, ranks, B,
    ranks * capacity], ragged_all_to_all's placed exchange, padded layout): y is [calls, ranks, B, out_rows,
    row bytes], whose rows nothing places stay 0xA5 bytes."""
    x, counts = np.ascontiguousarray(x), np.ascontiguousarray(counts, np.int32)
    calls, size, batch, source_rows = x.shape[:4]
    feature_bytes = int(np.prod(x.shape[4:], dtype=np.int64)) * x.itemsize
    num_rows = send_rows.shape[-1] if send_rows is not None else source_rows
    suffix_bytes = 0
    if suffix is not None:
        suffix = np.ascontiguousarray(suffix)
        suffix_bytes = int(np.prod(suffix.shape[4:], dtype=np.int64)) * suffix.itemsize
    row_bytes = feature_bytes + suffix_bytes
    num_chunks = counts.shape[-1]
    done = module().all_to_allv(
        x.tobytes(), counts.tobytes(),
        None if send_rows is None else np.ascontiguousarray(send_rows, np.int32).tobytes(),
        None if suffix is None else suffix.tobytes(),
        None if place is None else np.ascontiguousarray(place, np.int32).tobytes(),
        size=size, calls=calls, batch=batch, source_rows=source_rows, num_rows=num_rows, num_chunks=num_chunks,
        capacity=capacity, row_bytes=row_bytes, suffix_bytes=suffix_bytes, out_rows=out_rows,
        packed=layout == "packed", direct=direct, **options)
    rows = size * capacity if place is None else out_rows
    y = np.frombuffer(done["y"], np.uint8).reshape(calls, size, batch, rows, row_bytes)
    recv = np.frombuffer(done["recv_counts"], np.int32).reshape(calls, size, batch, size, num_chunks)
    dropped = np.frombuffer(done["dropped"], np.int32).reshape(calls, size, batch, size)
    return y, recv, dropped, with_grid(done)


def with_grid(done):
    return [dict(state, blocks=done["blocks"]) for state in done["ranks"]]


MOE_COMBINE_TYPES = {np.dtype(np.float32): 0, np.dtype(ml_dtypes.bfloat16): 1, np.dtype(np.float16): 2}


def moe_combine(expert_out, row_pairs, weights, recv_tokens, return_row, **options):
    """moe.combine's NVLink kernel. expert_out [calls, ranks, N * C, H'] (float32, bfloat16 or float16),
    row_pairs int32 [calls, ranks, N * R, k], weights float32 of the same shape, recv_tokens int32 [calls,
    ranks, N], return_row int32 [calls, ranks, T, N]. Returns (out [calls, ranks, T, H'], ranks); each rank's
    state says whether the call sent LL128 lines ('lines') or rows and flags."""
    expert_out = np.ascontiguousarray(expert_out)
    calls, size, expert_rows, hidden = expert_out.shape
    rows, top_k = row_pairs.shape[2:]
    tokens = return_row.shape[2]
    done = module().moe_combine(
        expert_out.tobytes(), np.ascontiguousarray(row_pairs, np.int32).tobytes(),
        np.ascontiguousarray(weights, np.float32).tobytes(), np.ascontiguousarray(recv_tokens, np.int32).tobytes(),
        np.ascontiguousarray(return_row, np.int32).tobytes(), size=size, calls=calls,
        type=MOE_COMBINE_TYPES[expert_out.dtype], expert_rows=expert_rows, rows_per_member=rows // size,
        top_k=top_k, tokens=tokens, hidden=hidden, **options)
    out = np.frombuffer(done["out"], expert_out.dtype).reshape(calls, size, tokens, hidden)
    return out, [dict(state, lines=done["lines"]) for state in with_grid(done)]


# moe.dispatch's results in the kernel's order, each (name, int32 or float32, shape from T, k, N, E_local, C, R, S).
MOE_DISPATCH_RESULTS = [
    ("group_sizes", np.int32, lambda T, k, N, L, C, R, S: (L,)),
    ("order", np.int32, lambda T, k, N, L, C, R, S: (T * k,)),
    ("send_counts", np.int32, lambda T, k, N, L, C, R, S: (N, L)),
    ("recv_counts", np.int32, lambda T, k, N, L, C, R, S: (N, L)),
    ("to_expert_major", np.int32, lambda T, k, N, L, C, R, S: (N * C,)),
    ("to_source_major", np.int32, lambda T, k, N, L, C, R, S: (N * C,)),
    ("return_slot", np.int32, lambda T, k, N, L, C, R, S: (T * k,)),
    ("dropped", np.int32, lambda T, k, N, L, C, R, S: (N,)),
    ("send_token", np.int32, lambda T, k, N, L, C, R, S: (S,)),
    ("token_counts", np.int32, lambda T, k, N, L, C, R, S: (N,)),
    ("return_row", np.int32, lambda T, k, N, L, C, R, S: (T, N)),
    ("recv_tokens", np.int32, lambda T, k, N, L, C, R, S: (N,)),
    ("expand_rows", np.int32, lambda T, k, N, L, C, R, S: (N * C,)),
    ("pair_entry", np.int32, lambda T, k, N, L, C, R, S: (N * C,)),
    ("row_pairs", np.int32, lambda T, k, N, L, C, R, S: (N * R, k)),
    ("send_back_rows", np.int32, lambda T, k, N, L, C, R, S: (N * R,)),
]


def moe_dispatch(tokens, expert_ids, weights, *, num_experts, capacity, wire=None, **options):
    """moe.dispatch's NVLink kernel. tokens [calls, ranks, T, H] (any dtype, rows of a multiple of 16 bytes; with
    an 8-bit wire float32, bfloat16 or float16 and H a multiple of 128), expert_ids int32 [calls, ranks, T, k],
    weights float32 of the same shape or None; wire None, "float8_e4m3fn" or "float8_e5m2". Returns (a dict of every
    result by name, expert_rows [calls, ranks, N * C, H] in tokens' dtype and recv_weights float32 [calls,
    ranks, N * R, k or 0] among them, ranks); each rank's state says whether the call sent LL128 lines ('lines')
    or rows and flags."""
    tokens = np.ascontiguousarray(tokens)
    calls, size, num_tokens, hidden = tokens.shape
    top_k = expert_ids.shape[-1]
    with_weights = weights is not None
    weights = np.zeros(expert_ids.shape, np.float32) if weights is None else weights
    done = module().moe_dispatch(
        tokens.tobytes(), np.ascontiguousarray(expert_ids, np.int32).tobytes(),
        np.ascontiguousarray(weights, np.float32).tobytes(), size=size, calls=calls, num_tokens=num_tokens,
        row_bytes=hidden * tokens.itemsize, top_k=top_k, num_experts=num_experts, capacity=capacity,
        with_weights=with_weights, wire=contract.MOE_WIRES[wire or "none"],
        type=MOE_COMBINE_TYPES[tokens.dtype] if contract.MOE_WIRES[wire or "none"] else 0, **options)
    R = min(capacity, num_tokens)
    dims = (num_tokens, top_k, size, num_experts // size, capacity, R,
            min(num_tokens * min(top_k, size), size * capacity))
    results = {name: np.frombuffer(done[name], dtype).reshape(calls, size, *shape(*dims))
               for name, dtype, shape in MOE_DISPATCH_RESULTS}
    results["expert_rows"] = np.frombuffer(done["expert_rows"], tokens.dtype).reshape(calls, size, size * capacity,
                                                                                    hidden)
    results["recv_weights"] = np.frombuffer(done["recv_weights"], np.float32).reshape(
        calls, size, size * R, top_k if with_weights else 0)
    add_phase_clocks(results, done, size)
    return results, [dict(state, lines=done["lines"]) for state in with_grid(done)]


def moe_masked_dispatch(tokens, expert_ids, weights, *, num_experts, capacity, wire=None, **options):
    """The masked dispatch's NVLink kernel. tokens [calls, ranks, T, H] (float32, bfloat16 or float16; rows of a
    multiple of 16 bytes, and H a multiple of 128 with an 8-bit wire), expert_ids int32 [calls, ranks, T, k],
    weights float32 of the same shape or None; wire None, "float8_e4m3fn" or "float8_e5m2". Returns (a dict of
    every result by name, each [calls, ranks, ...]: expert_rows [L, N * C, H] in tokens' dtype, group_sizes [L],
    send_pairs [P], pair_slot [P], send_counts [N, L], dropped [N], recv_counts [N, L], row_pair [L, N * C],
    recv_weights float32 [L, N * C or 0], and with R = min(T, L * C): recv_tokens [N], choice_rows [N * R, k],
    choice_weights float32 [N * R, k or 0], send_back_rows [N * R], return_row [T, N]; ranks, each rank's state
    saying whether the call sent LL128 lines ('lines') or rows and flags)."""
    tokens = np.ascontiguousarray(tokens)
    calls, size, num_tokens, hidden = tokens.shape
    top_k = expert_ids.shape[-1]
    with_weights = weights is not None
    weights = np.zeros(expert_ids.shape, np.float32) if weights is None else weights
    done = module().moe_masked_dispatch(
        tokens.tobytes(), np.ascontiguousarray(expert_ids, np.int32).tobytes(),
        np.ascontiguousarray(weights, np.float32).tobytes(), size=size, calls=calls, num_tokens=num_tokens,
        hidden=hidden, type=MOE_COMBINE_TYPES[tokens.dtype], top_k=top_k, num_experts=num_experts,
        capacity=capacity, wire=contract.MOE_WIRES[wire or "none"], with_weights=with_weights, **options)
    local, rows, pairs = num_experts // size, size * capacity, num_tokens * top_k
    received = size * min(num_tokens, local * capacity)
    shapes = {"group_sizes": (local,), "send_pairs": (pairs,), "pair_slot": (pairs,), "send_counts": (size, local),
              "dropped": (size,), "recv_counts": (size, local), "row_pair": (local, rows), "recv_tokens": (size,),
              "choice_rows": (received, top_k), "send_back_rows": (received,), "return_row": (num_tokens, size)}
    results = {name: np.frombuffer(done[name], np.int32).reshape(calls, size, *shape)
               for name, shape in shapes.items()}
    results["expert_rows"] = np.frombuffer(done["expert_rows"], tokens.dtype).reshape(calls, size, local, rows,
                                                                                    hidden)
    results["recv_weights"] = np.frombuffer(done["recv_weights"], np.float32).reshape(
        calls, size, local, rows if with_weights else 0)
    results["choice_weights"] = np.frombuffer(done["choice_weights"], np.float32).reshape(
        calls, size, received, top_k if with_weights else 0)
    add_phase_clocks(results, done, size)
    return results, [dict(state, lines=done["lines"]) for state in with_grid(done)]


def add_phase_clocks(results, done, size):
    """options phases=True: results["phase_clocks"], int64 [ranks, blocks, phases] clock64() of the last call."""
    if "phase_clocks" in done:
        results["phase_clocks"] = np.frombuffer(done["phase_clocks"], np.int64).reshape(
            size, done["blocks"], len(done["phase_names"]))


def moe_masked_combine(expert_out, row_pair, pair_slot, weights, *, num_tokens, **options):
    """The masked combine's NVLink kernel (weights given to combine). expert_out [calls, ranks, L, N * C, H']
    (float32, bfloat16 or float16), row_pair int32 [calls, ranks, L, N * C], pair_slot int32 [calls, ranks,
    T * k], weights float32 [calls, ranks, T, k]. Returns (out [calls, ranks, T, H'] in expert_out's dtype,
    ranks); with phases=True ({"out": out, "phase_clocks": int64 [ranks, blocks, phases]}, ranks)."""
    expert_out = np.ascontiguousarray(expert_out)
    calls, size, local, rows, hidden = expert_out.shape
    pairs = pair_slot.shape[-1]
    done = module().moe_masked_combine(
        expert_out.tobytes(), np.ascontiguousarray(row_pair, np.int32).tobytes(),
        np.ascontiguousarray(pair_slot, np.int32).tobytes(), np.ascontiguousarray(weights, np.float32).tobytes(),
        size=size, calls=calls, type=MOE_COMBINE_TYPES[expert_out.dtype], local_experts=local,
        capacity=rows // size, tokens=num_tokens, top_k=pairs // num_tokens, hidden=hidden, **options)
    out = np.frombuffer(done["out"], expert_out.dtype).reshape(calls, size, num_tokens, hidden)
    if "phase_clocks" in done:  # options phases=True: ({"out", "phase_clocks"}, ranks)
        results = {"out": out}
        add_phase_clocks(results, done, size)
        return results, with_grid(done)
    return out, with_grid(done)


def assert_absent_rank_named(ranks, absent, calls):
    """Every rank that ran gave up (or was aborted by one that did), named ``absent`` alone, and still
    finished its calls; ``absent`` itself never ran."""
    for rank, state in enumerate(ranks):
        if rank == absent:
            assert state["calls_finished"] == 0 and state["fault"] == "healthy", state
            continue
        assert state["fault"] in ("gave_up", "aborted"), (rank, state)
        assert state["missing"] == [absent], (rank, state)
        assert state["fault_call"] == 1, (rank, state)  # the first call is the one that waited in vain
        assert state["calls_finished"] == calls, (rank, state)
    assert any(state["fault"] == "gave_up" for state in ranks), ranks
