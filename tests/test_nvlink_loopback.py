"""The NVLink kernels with 2 to 8 ranks on ONE GPU (tests/nvlink_loopback.py): the same kernels and launch
arguments the FFI handlers use, each logical rank with its own stream and symmetric memory, so their
protocols are checked on machines with a single GPU and at rank counts no lent machine has.

Against NumPy, bit for bit: all_reduce in every algorithm and protocol (sums in rank order, 16-bit floats in
float32), all_gather, all_to_all and reduce_scatter in every protocol, all_to_allv_dynamic on the adversarial
count patterns in both layouts and both modes (rows written into the peers' outputs, or staged), and placed on
the rows a place table names (ragged_all_to_all's exchange). Flags are reused over thousands of calls, with
one rank late to every call, and as replays of one CUDA graph; every rank's device trace holds one ordered
record per call; a rank that never launches, or launches after the timeout, is named by every peer. Seeded
random configurations reach 5 to 7 ranks, odd sizes and requested block counts. What this does not cover
(NVLink, CUDA IPC, the handlers, XLA) the multi-GPU suites do.
"""

import ml_dtypes
import numpy as np
import pytest

import nvlink_loopback as loopback
import reference
from helpers import assert_bits_equal, assert_wire_rows, random_array, random_bits, wire_takes_lines, wire_tokens
from jax_ncclx._src import contract

pytestmark = pytest.mark.gpu

SIZES = [2, 3, 4, 8]
ALL_REDUCE = {  # param -> (algorithm, one-shot protocol, direct)
    "one-shot-ll128": ("one-shot", "ll128", False),
    "one-shot-ll": ("one-shot", "ll", False),
    "one-shot-simple": ("one-shot", "simple", False),
    "two-shot": ("two-shot", "ll128", True),           # the all-gather writes into the peers' outputs
    "two-shot-staged": ("two-shot", "ll128", False),   # through slots, as one process per GPU does
}
MOVES = {  # param -> (protocol, direct)
    "ll128": ("ll128", True),
    "ll": ("ll", True),
    "simple": ("simple", True),
    "simple-staged": ("simple", False),
}
REDUCE_DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, np.int32]
MOVE_DTYPES = [np.float32, ml_dtypes.bfloat16, np.int8, np.complex64, np.complex128]  # 1- to 16-byte elements
# Elements per rank: one, odd counts (scalar path; 16-bit odd counts go simple), 64 KiB of f32 (the largest
# one-shot segment sent as LL128 lines or LL words), just above, and many blocks.
ELEMENTS = [1, 3, 4099, 16384, 16390, 300001]


@pytest.fixture(autouse=True)
def loopback_module():
    return loopback.module()  # skips, before any input is built, where no GPU or no CUDA build is


def assert_healthy(ranks, calls):
    for rank, state in enumerate(ranks):
        assert state["fault"] == "healthy" and state["calls_finished"] == calls, (rank, state)


@pytest.mark.parametrize("elements", ELEMENTS)
@pytest.mark.parametrize("algorithm", ALL_REDUCE)
@pytest.mark.parametrize("size", SIZES)
def test_all_reduce_is_exact(size, algorithm, elements):
    kind, protocol, direct = ALL_REDUCE[algorithm]
    for dtype in REDUCE_DTYPES:
        x = random_array((2, size, elements), dtype, seed=elements)
        y, ranks = loopback.collective("all_reduce", x, algorithm=kind, protocol=protocol, direct=direct)
        assert_healthy(ranks, calls=2)
        for call in range(2):
            expected = reference.reduce_in_rank_order(list(x[call]), "sum", dtype)
            for rank in range(size):  # every rank holds the same bits
                assert_bits_equal(y[call, rank], expected)


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("algorithm", ALL_REDUCE)
@pytest.mark.parametrize("size", [3, 4])
def test_all_reduce_max_min(size, algorithm, op):
    kind, protocol, direct = ALL_REDUCE[algorithm]
    for dtype in [np.float32, ml_dtypes.bfloat16, np.int32]:
        x = random_array((1, size, 4099), dtype, seed=1)
        y, ranks = loopback.collective("all_reduce", x, algorithm=kind, protocol=protocol, direct=direct, reduce=op)
        assert_healthy(ranks, calls=1)
        for rank in range(size):
            assert_bits_equal(y[0, rank], reference.reduce_in_rank_order(list(x[0]), op, dtype))


def expected_collective(op, x):
    """NumPy's result of every call of ``op`` on x [calls, ranks, elements] (sums of integers: exact)."""
    calls, size, elements = x.shape
    if op == "all_reduce":
        return np.broadcast_to(x.sum(axis=1, keepdims=True), x.shape)
    if op == "all_gather":
        return np.broadcast_to(x.reshape(calls, 1, size * elements), (calls, size, size * elements))
    if op == "reduce_scatter":  # rank j: block j of the sum
        return x.reshape(calls, size, size, -1).sum(axis=1)
    return x.reshape(calls, size, size, -1).transpose(0, 2, 1, 3).reshape(x.shape)  # all_to_all


# Elements per rank and peer: one, odd (byte path), 64 KiB of f32 (the largest segment in lines or words), above.
@pytest.mark.parametrize("block", [1, 5, 1025, 16384, 16385])
@pytest.mark.parametrize("protocol", MOVES)
@pytest.mark.parametrize("op", ["all_gather", "all_to_all"])
@pytest.mark.parametrize("size", SIZES)
def test_moves(size, op, protocol, block):
    """all_gather of `block` elements per rank; all_to_all of `block` per peer (rank r's block j goes to rank j)."""
    name, direct = MOVES[protocol]
    elements = size * block if op == "all_to_all" else block
    for dtype in MOVE_DTYPES:
        x = random_bits((2, size, elements), dtype, seed=block)
        y, ranks = loopback.collective(op, x, protocol=name, direct=direct)
        assert_healthy(ranks, calls=2)
        assert_bits_equal(y, np.ascontiguousarray(expected_collective(op, x)))


@pytest.mark.parametrize("block", [1, 3, 1025, 16384, 16385])
@pytest.mark.parametrize("protocol", ["ll128", "ll", "simple"])
@pytest.mark.parametrize("size", SIZES)
def test_reduce_scatter_is_exact(size, protocol, block):
    """Rank j gets block j of the sum of `block` elements per rank and peer, in rank order (16-bit floats in
    float32, rounded once), bit for bit."""
    for dtype in REDUCE_DTYPES:
        x = random_array((2, size, size * block), dtype, seed=block)
        y, ranks = loopback.collective("reduce_scatter", x, protocol=protocol)
        assert_healthy(ranks, calls=2)
        for call in range(2):
            blocks = x[call].reshape(size, size, block)
            for rank in range(size):
                assert_bits_equal(y[call, rank], reference.reduce_in_rank_order(list(blocks[:, rank]), "sum", dtype))


REUSE = {  # param -> (op, options, elements per rank): every call's inputs differ, every call is checked
    "all_reduce-ll-8B": ("all_reduce", dict(protocol="ll"), 2),
    "all_reduce-ll128-traced": ("all_reduce", dict(protocol="ll128", trace=True), 256),
    "all_reduce-two-shot": ("all_reduce", dict(algorithm="two-shot", direct=True), 1024),
    "all_gather-simple-direct": ("all_gather", dict(protocol="simple", direct=True), 64),
    "all_to_all-ll128": ("all_to_all", dict(protocol="ll128"), 256),
    "reduce_scatter-ll": ("reduce_scatter", dict(protocol="ll"), 256),
}


@pytest.mark.parametrize("graph", [False, True], ids=["streams", "graph"])
@pytest.mark.parametrize("case", REUSE)
def test_flags_survive_thousands_of_calls(case, graph):
    """Epochs only grow and nothing is reset between calls; the parity halves alternate. As a graph, one call
    of every rank is recorded once and replayed (its kernels' arguments fixed, only the epochs move on)."""
    op, options, elements = REUSE[case]
    size, calls = 4, 300 if graph else 2000
    x = np.random.default_rng(calls).integers(-1000, 1000, size=(calls, size, elements)).astype(np.int32)
    y, ranks = loopback.collective(op, x, graph=graph, **options)
    assert_healthy(ranks, calls)
    bad = np.flatnonzero((y != expected_collective(op, x)).any(axis=(1, 2)))
    assert bad.size == 0, f"{bad.size} of {calls} calls differ, the first is call {bad[0]}"


@pytest.mark.parametrize("late", [0, 3])
@pytest.mark.parametrize("case", REUSE)
def test_a_late_rank_leaves_results_exact(case, late):
    """Rank ``late`` starts every call 200 µs after its peers. They wait for it, and as soon as its rows of call c
    have landed they finish c and write call c + 1 into the other parity half while it still reads call c's
    slots: the case the parity halves exist for."""
    op, options, elements = REUSE[case]
    size, calls = 4, 100
    x = np.random.default_rng(late).integers(-1000, 1000, size=(calls, size, elements)).astype(np.int32)
    y, ranks = loopback.collective(op, x, late=late, late_us=200, **options)
    assert_healthy(ranks, calls)
    bad = np.flatnonzero((y != expected_collective(op, x)).any(axis=(1, 2)))
    assert bad.size == 0, f"{bad.size} of {calls} calls differ, the first is call {bad[0]}"


TRACE_KERNELS = {name: kernel for kernel, name in contract.TRACE_KERNELS.items()}


def assert_timelines(ranks, calls, kernel):
    """Every rank's device trace holds one complete record per call, numbered 1.. in order, each ordered within
    itself and after the rank's previous call ended."""
    for rank, state in enumerate(ranks):
        timeline = state["trace"]
        assert [r["epoch"] for r in timeline] == list(range(1, calls + 1)), (rank, [r["epoch"] for r in timeline])
        previous_end = 0
        for r in timeline:
            assert r["kernel"] == TRACE_KERNELS[kernel] and r["blocks"] == state["blocks"], (rank, r)
            assert previous_end <= r["start_ns"] <= r["peers_ns"] <= r["sent_ns"] <= r["end_ns"], (rank, r)
            assert r["peers_ns"] <= r["data_ns"] <= r["end_ns"], (rank, r)
            if kernel == "moe.dispatch":  # its plan comes before the rows go out
                assert r["start_ns"] <= r["ready_ns"] <= r["sent_ns"], (rank, r)
            previous_end = r["end_ns"]


@pytest.mark.parametrize("graph", [False, True], ids=["streams", "graph"])
@pytest.mark.parametrize("case", REUSE)
def test_device_trace_records_every_call(case, graph):
    op, options, elements = REUSE[case]
    x = np.ones((20, 4, elements), np.int32)
    y, ranks = loopback.collective(op, x, graph=graph, **{**options, "trace": True})
    assert_healthy(ranks, calls=20)
    np.testing.assert_array_equal(y, expected_collective(op, x))
    assert_timelines(ranks, calls=20, kernel=op)


MISSING_RANK_CASES = {
    "all_reduce-ll": ("all_reduce", dict(protocol="ll"), 8),
    "all_reduce-ll128": ("all_reduce", dict(protocol="ll128"), 4096),
    "all_reduce-simple": ("all_reduce", dict(protocol="simple"), 4096),
    "all_reduce-two-shot": ("all_reduce", dict(algorithm="two-shot", direct=True), 65536),
    "all_gather-simple-direct": ("all_gather", dict(protocol="simple", direct=True), 4096),
    "all_to_all-ll": ("all_to_all", dict(protocol="ll"), 64),
    "reduce_scatter-simple": ("reduce_scatter", dict(protocol="simple"), 4096),
}


@pytest.mark.parametrize("graph", [False, True], ids=["streams", "graph"])
@pytest.mark.parametrize("case", MISSING_RANK_CASES)
def test_a_rank_that_never_launches_is_named(case, graph):
    op, options, elements = MISSING_RANK_CASES[case]
    x = np.ones((2, 4, elements), np.int32)
    _, ranks = loopback.collective(op, x, absent=2, timeout_ms=200, graph=graph, **options)
    loopback.assert_absent_rank_named(ranks, absent=2, calls=2)


def test_a_rank_later_than_the_timeout_is_named():
    """Rank 1 starts 300 ms late, its peers wait 100 ms: they give up naming it. When it does start, its peers'
    lines are already in its slots (they sent before waiting), so it may finish without waiting at all, and
    then without a fault: it only learns of the abort at its next wait. If it does wait, it reports the abort
    with itself named."""
    x = np.ones((1, 4, 1024), np.int32)
    _, ranks = loopback.collective("all_reduce", x, protocol="ll128", late=1, late_us=300_000, timeout_ms=100)
    for rank, state in enumerate(ranks):
        assert state["calls_finished"] == 1, (rank, state)
        if rank == 1:
            assert state["fault"] == "healthy" or (state["fault"] == "aborted" and state["missing"] == [1]), state
        else:
            assert state["fault"] in ("gave_up", "aborted") and state["missing"] == [1], (rank, state)
    assert any(state["fault"] == "gave_up" for state in ranks), ranks


LATE, UNWRITTEN = 1, 0xA5  # the harness fills every output with UNWRITTEN bytes before a call


def _late_rank_writes(run):
    """run(late=..., late_us=..., timeout_ms=...) -> (y [calls, ranks, ...] as bytes, the block of y that rank
    LATE writes into its peers' outputs, ranks). The peers give up at 100 ms, rank LATE starts at 300 ms."""
    y, region, ranks = run(late=LATE, late_us=300_000, timeout_ms=100)
    assert any(state["fault"] == "gave_up" for state in ranks), ranks
    return [np.asarray(y[0, rank]).view(np.uint8).reshape(len(ranks), -1)[region] for rank in range(len(ranks))
            if rank != LATE]


@pytest.mark.parametrize("case", ["all_gather-simple", "all_reduce-two-shot"])
def test_a_rank_later_than_the_timeout_writes_no_peer_output(case):
    """Direct mode: the peers published their outputs and entered, then gave up on rank LATE and left the call,
    handing the outputs back to XLA. When LATE starts, their entry flags are long set; it must see the abort
    and write nothing into those outputs."""
    size, elements = 4, 4096
    x = np.ones((1, size, elements), np.int32)

    def run(**fault):
        if case == "all_gather-simple":
            y, ranks = loopback.collective("all_gather", x, protocol="simple", direct=True, **fault)
        else:
            y, ranks = loopback.collective("all_reduce", x, algorithm="two-shot", direct=True, **fault)
        return y, LATE, ranks  # [ranks, ...]: its block, all_gather's x or all_reduce's share

    for block in _late_rank_writes(run):
        assert (block == UNWRITTEN).all(), np.unique(block)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_rank_later_than_the_timeout_sends_no_rows(layout):
    """As above, for all_to_allv_dynamic's rows (and counts) written into the peers' outputs: no byte of rank
    LATE's rows (each rank's rows are bytes 0x10 + its rank) reaches a peer that gave up on it."""
    size, calls = 4, 1
    x = np.broadcast_to((0x10 + np.arange(size, dtype=np.uint8))[None, :, None, None, None],
                        (calls, size, 1, ROWS, FEATURES)).copy()
    counts = np.full((calls, size, 1, size, 1), CAPACITY, np.int32)

    def run(**fault):
        y, _, _, ranks = loopback.all_to_allv(x, counts, CAPACITY, layout=layout, direct=True, **fault)
        return y, slice(None), ranks

    for rows in _late_rank_writes(run):
        assert not (rows == 0x10 + LATE).any()


# ---- all_to_allv_dynamic -------------------------------------------------------------------------------------

ROWS, FEATURES, CAPACITY = 12, 5, 4


def expected_all_to_allv(x, counts, capacity, layout, send_rows=None, suffix=None):
    """NumPy's (y, recv_counts, dropped) for nvlink_loopback.all_to_allv's arguments, y as raw row bytes."""
    calls, size, batch, source_rows = x.shape[:4]
    rows = x.reshape(calls, size, batch, source_rows, -1).view(np.uint8)
    row_bytes = rows.shape[-1] + (0 if suffix is None else suffix[0, 0, 0, 0].nbytes)
    recv = np.zeros((calls, size, batch, size, counts.shape[-1]), np.int32)
    dropped = np.zeros((calls, size, batch, size), np.int32)
    ys = []
    for c in range(calls):
        for b in range(batch):
            sent = list(rows[c, :, b])
            if send_rows is not None:
                sent = reference.gather_rows(sent, send_rows[c, :, b])
            if suffix is not None:
                tails = suffix[c, :, b].reshape(size, suffix.shape[3], -1).view(np.uint8)
                sent = [np.concatenate([r, t], axis=1) for r, t in zip(sent, tails)]
            for me, (ym, rm, dm) in enumerate(reference.all_to_allv(sent, list(counts[c, :, b]), capacity, layout)):
                ys.append(ym.reshape(size * capacity, row_bytes))
                recv[c, me, b], dropped[c, me, b] = rm, dm
    y = np.stack(ys).reshape(calls, batch, size, size * capacity, row_bytes).transpose(0, 2, 1, 3, 4)
    return y, recv, dropped


def counts_of(pattern, size, k, calls, batch, rows=ROWS, capacity=CAPACITY, seed=0):
    """[calls, ranks, batch, ranks, k] counts: count_pattern's, a different draw for every call and batch element."""
    drawn = [[reference.count_pattern(pattern, size, k, seed + 10 * c + b, rows=rows, capacity=capacity)
              for b in range(batch)] for c in range(calls)]
    return np.asarray(drawn, np.int32).transpose(0, 2, 1, 3, 4)


def check_all_to_allv(actual, expected, calls):
    y, recv, dropped, ranks = actual
    assert_healthy(ranks, calls)
    np.testing.assert_array_equal(recv, expected[1])
    np.testing.assert_array_equal(dropped, expected[2])
    bad = np.argwhere((y != expected[0]).any(axis=-1))
    assert bad.size == 0, f"{len(bad)} rows differ, the first at [call, rank, batch, row] = {bad[0].tolist()}"


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("pattern", ["zero", "one_peer", "at_capacity", "overflow", "bad", "random"])
@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_all_to_allv_patterns(size, pattern, k, layout, direct):
    calls, batch = 2, 2
    x = random_array((calls, size, batch, ROWS, FEATURES), np.float32, seed=size)
    counts = counts_of(pattern, size, k, calls, batch)
    actual = loopback.all_to_allv(x, counts, CAPACITY, layout=layout, direct=direct)
    check_all_to_allv(actual, expected_all_to_allv(x, counts, CAPACITY, layout), calls)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("pattern", ["overflow", "bad", "random"])
def test_all_to_allv_send_rows_and_suffix(pattern, layout, direct):
    """Rows gathered through send_rows (indices outside x give zero rows) with an odd-sized suffix appended:
    the byte-wise copy path."""
    size, calls, batch, num_rows = 4, 2, 2, 10
    rng = np.random.default_rng(3)
    x = random_array((calls, size, batch, ROWS, 3), ml_dtypes.bfloat16, seed=3)
    send_rows = rng.integers(-2, ROWS + 2, size=(calls, size, batch, num_rows)).astype(np.int32)
    suffix = rng.integers(0, 256, size=(calls, size, batch, num_rows, 3)).astype(np.uint8)
    counts = counts_of(pattern, size, 2, calls, batch, rows=num_rows)
    actual = loopback.all_to_allv(x, counts, CAPACITY, layout=layout, direct=direct, send_rows=send_rows,
                                  suffix=suffix)
    check_all_to_allv(actual, expected_all_to_allv(x, counts, CAPACITY, layout, send_rows, suffix), calls)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("k", [8, 33])
@pytest.mark.parametrize("pattern", ["at_capacity", "overflow", "bad", "random"])
@pytest.mark.parametrize("size, batch", [(4, 3), (2, 17)], ids=["warp-per-element", "thread-per-element"])
def test_all_to_allv_many_chunks(size, batch, pattern, k, layout, direct):
    """From 8 chunks per peer the plan made before the peer enters takes a warp per batch element
    (WarpPlanPeer, 33 chunks in two passes of its lanes), where a tile has at most 16 elements; 17 take a
    thread each."""
    calls, rows, capacity = 2, 160, 48
    x = random_array((calls, size, batch, rows, FEATURES), np.float32, seed=k)
    counts = counts_of(pattern, size, k, calls, batch, rows=rows, capacity=capacity, seed=k)
    actual = loopback.all_to_allv(x, counts, capacity, layout=layout, direct=direct)
    check_all_to_allv(actual, expected_all_to_allv(x, counts, capacity, layout), calls)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_all_to_allv_moe_sized_rows(layout, direct):
    """Rows of 7168 bf16 (the MoE benchmark's hidden size) and a capacity that makes staged calls send their
    pieces in several rounds."""
    size, calls, capacity, rows = 4, 2, 48, 160
    x = random_array((calls, size, 1, rows, 7168), ml_dtypes.bfloat16, seed=5)
    counts = counts_of("overflow", size, 2, calls, 1, rows=rows, capacity=capacity, seed=5)
    actual = loopback.all_to_allv(x, counts, capacity, layout=layout, direct=direct)
    check_all_to_allv(actual, expected_all_to_allv(x, counts, capacity, layout), calls)


def place_tables(calls, size, batch, capacity, out_rows, seed):
    """int32 [calls, ranks, batch, ranks * capacity] place tables: each valid row of the result named at most
    once (two rows naming one are undefined), the rest -1 or outside [0, out_rows)."""
    rng = np.random.default_rng(seed)
    slots = size * capacity
    tables = np.empty((calls, size, batch, slots), np.int32)
    for index in np.ndindex(calls, size, batch):
        table = np.full(slots, -1, np.int32)
        chosen = rng.choice(slots, size=min(slots, out_rows) * 3 // 4, replace=False)
        table[chosen] = rng.choice(out_rows, size=len(chosen), replace=False)
        table[rng.choice(slots, size=2, replace=False)] = [out_rows, -7]  # outside: written nowhere
        tables[index] = table
    return tables


def expected_placed(x, counts, capacity, place, out_rows, send_rows=None):
    """NumPy's (y, recv_counts, dropped) of the placed exchange: the padded layout's rows that their source
    delivered, moved to the rows place names, on a result of 0xA5 bytes (the loopback's unwritten value)."""
    padded, recv, dropped = expected_all_to_allv(x, counts, capacity, "padded", send_rows)
    calls, size, batch = padded.shape[:3]
    y = np.full((calls, size, batch, out_rows, padded.shape[-1]), 0xA5, np.uint8)
    delivered = np.minimum(recv.sum(axis=-1), capacity)                        # [calls, ranks, batch, sources]
    for c, me, b in np.ndindex(calls, size, batch):
        for slot, row in enumerate(place[c, me, b]):
            source, r = divmod(slot, capacity)
            if r < delivered[c, me, b, source] and 0 <= row < out_rows:
                y[c, me, b, row] = padded[c, me, b, slot]
    return y, recv, dropped


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
@pytest.mark.parametrize("pattern", ["one_peer", "at_capacity", "overflow", "bad", "random"])
@pytest.mark.parametrize("size", [2, 4, 8])
def test_all_to_allv_placed(size, pattern, direct):
    """ragged_all_to_all's exchange: rows land on the rows of the result that the receiver's place table
    names (in direct mode the sender writes them there), and no other row of the result is written."""
    calls, batch, out_rows = 2, 2, size * CAPACITY + 3
    rng = np.random.default_rng(size)
    x = random_array((calls, size, batch, ROWS, FEATURES), np.float32, seed=size)
    send_rows = rng.integers(-1, ROWS + 1, size=(calls, size, batch, size * CAPACITY)).astype(np.int32)
    counts = counts_of(pattern, size, 2, calls, batch, rows=size * CAPACITY)
    place = place_tables(calls, size, batch, CAPACITY, out_rows, seed=size)
    actual = loopback.all_to_allv(x, counts, CAPACITY, layout="padded", direct=direct, send_rows=send_rows,
                                  place=place, out_rows=out_rows)
    check_all_to_allv(actual, expected_placed(x, counts, CAPACITY, place, out_rows, send_rows), calls)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
@pytest.mark.parametrize("schedule", ["late-rank", "graph"])
def test_all_to_allv_placed_in_rounds_and_replays(schedule, direct):
    """Rows of 7168 bf16 and a capacity that sends staged pieces in several rounds, each placed as it lands;
    with a late rank, and as replays of one recorded call."""
    size, calls, capacity, rows = 4, 3, 48, 160
    options = dict(late=1, late_us=200) if schedule == "late-rank" else dict(graph=True)
    x = random_array((calls, size, 1, rows, 7168), ml_dtypes.bfloat16, seed=6)
    counts = counts_of("overflow", size, 2, calls, 1, rows=rows, capacity=capacity, seed=6)
    place = place_tables(calls, size, 1, capacity, size * capacity, seed=6)
    actual = loopback.all_to_allv(x, counts, capacity, layout="padded", direct=direct, place=place,
                                  out_rows=size * capacity, **options)
    check_all_to_allv(actual, expected_placed(x, counts, capacity, place, size * capacity), calls)


SCHEDULES = {  # param -> (calls, how they are issued)
    "streams": (500, {}),
    "graph": (100, dict(graph=True)),
    "late-rank": (50, dict(late=2, late_us=200)),
}


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_all_to_allv_many_calls(schedule, direct):
    """New counts every call, over many calls on one set of flags: issued call after call, as replays of one
    recorded call, and with rank 2 starting every call 200 µs after its peers; each call traced on the device."""
    size, (calls, options) = 4, SCHEDULES[schedule]
    x = random_array((calls, size, 1, ROWS, FEATURES), np.float32, seed=9)
    counts = counts_of("overflow", size, 2, calls, 1, seed=9)
    actual = loopback.all_to_allv(x, counts, CAPACITY, layout="packed", direct=direct, trace=True, **options)
    check_all_to_allv(actual, expected_all_to_allv(x, counts, CAPACITY, "packed"), calls)
    assert_timelines(actual[-1], calls, kernel="all_to_allv_dynamic")


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_all_to_allv_missing_rank_is_named(direct):
    size, calls = 4, 2
    x = random_array((calls, size, 1, ROWS, FEATURES), np.float32, seed=4)
    counts = counts_of("random", size, 1, calls, 1, seed=4)
    *_, ranks = loopback.all_to_allv(x, counts, CAPACITY, layout="padded", direct=direct, absent=1, timeout_ms=200)
    loopback.assert_absent_rank_named(ranks, absent=1, calls=calls)


# ---- moe.combine ---------------------------------------------------------------------------------------------
# Routings as dispatch leaves them, consistent across ranks: source s sends member m its first counts[s, m] of
# a random choice of its tokens; m's row s * R + r is the r-th of them, with k random expert-major rows (or
# none: N * C) and weights; return_row on s names where each token's row from m lands.

MOE_PATTERNS = ("random", "all_dropped", "empty_members", "one_token_everywhere", "at_capacity")


def moe_routing(pattern, size, calls, tokens, capacity, top_k, seed):
    rng = np.random.default_rng(seed)
    R = min(capacity, tokens)
    expert_rows = size * capacity
    row_pairs = np.full((calls, size, size * R, top_k), expert_rows, np.int32)
    weights = rng.normal(size=row_pairs.shape).astype(np.float32)
    recv_tokens = np.zeros((calls, size, size), np.int32)
    return_row = np.full((calls, size, tokens, size), size * R, np.int32)
    for c in range(calls):
        for s in range(size):
            for m in range(size):
                count = {"random": int(rng.integers(0, R + 1)), "all_dropped": int(rng.integers(0, R + 1)),
                         "empty_members": R if m == 0 else 0, "one_token_everywhere": min(1, R),
                         "at_capacity": R}[pattern]
                sent = rng.permutation(tokens)[:count]
                recv_tokens[c, m, s] = count
                return_row[c, s, sent, m] = m * R + np.arange(count)
                pairs = rng.integers(0, expert_rows, size=(count, top_k))
                if pattern == "random":  # some choices elsewhere or dropped
                    pairs = np.where(rng.random(pairs.shape) < 0.3, expert_rows, pairs)
                if pattern != "all_dropped":
                    row_pairs[c, m, s * R:s * R + count] = pairs
    return row_pairs, weights, recv_tokens, return_row


def expected_moe_combine(expert_out, row_pairs, weights, recv_tokens, return_row):
    """In float64: each member's weighted sums rounded to the dtype, then each token's rows added."""
    calls, size, expert_rows, hidden = expert_out.shape
    tokens, R = return_row.shape[2], row_pairs.shape[2] // size
    sums = np.zeros((calls, size, row_pairs.shape[2], hidden))  # on each member, per received row
    for c in range(calls):
        for m in range(size):
            here = row_pairs[c, m] < expert_rows
            picked = expert_out[c, m].astype(np.float64)[np.where(here, row_pairs[c, m], 0)]
            sums[c, m] = np.sum(picked * np.where(here, weights[c, m], 0.0)[..., None], axis=1)
    sums = sums.astype(expert_out.dtype).astype(np.float64)
    out = np.zeros((calls, size, tokens, hidden))
    for c in range(calls):
        for s in range(size):
            for m in range(size):
                landed = return_row[c, s, :, m] < size * R
                r = return_row[c, s, landed, m] - m * R  # the r-th row s sent m: m's received row s * R + r
                out[c, s, landed] += sums[c, m, s * R + r]
    return out


def check_moe_combine(actual, expert_out, routing, calls):
    out, ranks = actual
    assert_healthy(ranks, calls)
    expected = expected_moe_combine(expert_out, *routing)
    # float32 accumulation against float64, and one rounding of the members' sums that may land either way
    tolerance = {np.dtype(np.float32): 1e-5, np.dtype(ml_dtypes.bfloat16): 2 ** -7,
                 np.dtype(np.float16): 2 ** -10}[np.dtype(out.dtype)]
    scale = np.abs(expected).max() + 1
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=2 * tolerance, atol=2 * tolerance * scale)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("pattern", MOE_PATTERNS)
@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_moe_combine(size, pattern, dtype):
    """The expert side's weighted sums reach their tokens, summed over the members, for the adversarial
    routings; three calls, so both parity halves and their reuse are in play."""
    calls, tokens, capacity, top_k, hidden = 3, 16, 12, 4, 256
    routing = moe_routing(pattern, size, calls, tokens, capacity, top_k, seed=size)
    expert_out = random_array((calls, size, size * capacity, hidden), dtype, seed=size)
    check_moe_combine(loopback.moe_combine(expert_out, *routing), expert_out, routing, calls)


@pytest.mark.parametrize("tokens, hidden, lines", [(1, 8, True), (8, 7168, True), (128, 7168, False)],
                         ids=["one-token", "decode-rows-lines", "decode-rows-flags"])
def test_moe_combine_shapes(tokens, hidden, lines):
    """One token of one 16-byte vector, and DeepSeek-sized rows (7168 bfloat16) on 8 ranks: at 8 tokens (0.9 MiB
    of slot rows) as LL128 lines, at 128 (16 MB) as rows and flags."""
    size, calls, top_k = 8, 2, 8
    routing = moe_routing("random", size, calls, tokens, tokens, top_k, seed=tokens)
    expert_out = random_array((calls, size, size * tokens, hidden), ml_dtypes.bfloat16, seed=tokens)
    actual = loopback.moe_combine(expert_out, *routing)
    assert actual[1][0]["lines"] == lines
    check_moe_combine(actual, expert_out, routing, calls)


@pytest.mark.parametrize("path", ["lines", "flags"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_moe_combine_many_calls(schedule, path):
    """New routings every call on one set of flags and slots: call after call, as replays of one recorded call
    and with rank 2 late to every call (its peers write its next parity half while it reads the last). Rows of
    64 float32 travel as lines; rows of 8192 (1.1 MiB of slot rows) as rows and flags, over fewer calls."""
    size, (calls, options) = 4, SCHEDULES[schedule]
    calls, hidden = (min(calls, 100), 64) if path == "lines" else (min(calls, 20), 8192)
    routing = moe_routing("random", size, calls, 8, 8, 2, seed=5)
    expert_out = random_array((calls, size, size * 8, hidden), np.float32, seed=5)
    actual = loopback.moe_combine(expert_out, *routing, trace=True, **options)
    assert actual[1][0]["lines"] == (path == "lines")
    check_moe_combine(actual, expert_out, routing, calls)
    assert_timelines(actual[1], calls, kernel="moe.combine")


def test_moe_combine_missing_rank_is_named():
    size, calls = 4, 2
    routing = moe_routing("random", size, calls, 8, 8, 2, seed=6)
    expert_out = random_array((calls, size, size * 8, 64), np.float32, seed=6)
    _, ranks = loopback.moe_combine(expert_out, *routing, absent=1, timeout_ms=200)
    loopback.assert_absent_rank_named(ranks, absent=1, calls=calls)


# ---- moe.dispatch ----------------------------------------------------------------------------------------------
# The kernel against the NumPy reference of the chain it replaces (reference.moe_plan_sends on every rank, the
# suffixes as the exchange moves them, reference.moe_place_received, the rows expanded), every result bit for bit.

DISPATCH_PATTERNS = ("random", "one_expert", "no_expert", "empty_members", "at_capacity", "tight")


def dispatch_routing(pattern, size, calls, tokens, top_k, num_experts, seed):
    """(expert ids [calls, size, T, k], capacity) of a named pattern: ids skewed to low experts with some -1
    and some >= E (random), all on expert 0, none, only member 0's experts, a capacity exactly the largest
    load any rank gives any member, or one that drops."""
    rng = np.random.default_rng(seed)
    shape = (calls, size, tokens, top_k)
    ids = np.minimum(rng.integers(0, num_experts, size=shape), rng.integers(0, num_experts, size=shape))
    ids = np.where(rng.random(shape) < 0.05, -1, np.where(rng.random(shape) < 0.02, num_experts + 3, ids))
    if pattern == "one_expert":
        ids = np.zeros(shape)
    elif pattern == "no_expert":
        ids = np.full(shape, -1)
    elif pattern == "empty_members":
        ids = rng.integers(0, num_experts // size, size=shape)
    ids = ids.astype(np.int32)
    local = num_experts // size
    valid = (ids >= 0) & (ids < num_experts)
    loads = [np.bincount(ids[c, r][valid[c, r]] // local, minlength=size).max(initial=0)
             for c in range(calls) for r in range(size)]
    capacity = {"at_capacity": max(1, max(loads)), "tight": 2}.get(pattern, tokens * top_k)
    return ids, capacity


def expected_moe_dispatch(tokens, ids, weights, num_experts, capacity):
    """Per (call, rank), the dict of results the chain gives: plan, exchange, placement, expansion."""
    calls, size, num_tokens, hidden = tokens.shape
    top_k, R, local = ids.shape[-1], min(capacity, num_tokens), num_experts // size
    expected = []
    for c in range(calls):
        plans = [reference.moe_plan_sends(ids[c, r], num_experts, size, capacity,
                                          None if weights is None else weights[c, r]) for r in range(size)]
        per_rank = []
        for me, (suffixes, recv_tokens) in enumerate(reference.moe_exchange_suffixes(plans, R)):
            placed = reference.moe_place_received(suffixes, recv_tokens, local, capacity, top_k, weights is not None)
            received = np.zeros((size * R, hidden), tokens.dtype)
            for source, plan in enumerate(plans):
                first = int(np.sum(plan["token_counts"][:me]))
                sent = plan["send_token"][first: first + plan["token_counts"][me]]
                received[source * R: source * R + len(sent)] = tokens[c, source, sent]
            expand = placed["expand_rows"]
            rows = np.where((expand < size * R)[:, None], received[np.minimum(expand, size * R - 1)], 0)
            plan = {name: value for name, value in plans[me].items() if name != "send_suffix"}
            per_rank.append({**plan, **placed, "recv_tokens": recv_tokens, "expert_rows": rows.astype(tokens.dtype)})
        expected.append(per_rank)
    return expected


def check_moe_dispatch(actual, tokens, ids, weights, num_experts, capacity, wire=None):
    """Every result equals the chain's; with an 8-bit wire the expert rows are the chain's rows through it."""
    results, ranks = actual
    calls, size = tokens.shape[:2]
    assert_healthy(ranks, calls)
    for c, per_rank in enumerate(expected_moe_dispatch(tokens, ids, weights, num_experts, capacity)):
        for rank, expected in enumerate(per_rank):
            for name, value in expected.items():
                got = results[name][c, rank]
                try:
                    if name == "expert_rows" and wire is not None:
                        assert_wire_rows(got, value, wire)
                    else:
                        assert_bits_equal(got, np.asarray(value, got.dtype))
                except AssertionError as error:
                    raise AssertionError(f"{name} of call {c} on rank {rank}: {error}") from None


@pytest.mark.parametrize("weighted", [False, True], ids=["", "weights"])
@pytest.mark.parametrize("pattern", DISPATCH_PATTERNS)
@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_moe_dispatch(size, pattern, weighted):
    """Every result of the dispatch kernel equals the chain's for the adversarial routings; three calls, so
    both parity halves and their reuse are in play."""
    calls, tokens, top_k, hidden = 3, 16, 4, 64
    num_experts = 4 * size
    ids, capacity = dispatch_routing(pattern, size, calls, tokens, top_k, num_experts, seed=size)
    x = random_array((calls, size, tokens, hidden), np.float32, seed=size)
    weights = random_array(ids.shape, np.float32, seed=size + 1) if weighted else None
    actual = loopback.moe_dispatch(x, ids, weights, num_experts=num_experts, capacity=capacity)
    check_moe_dispatch(actual, x, ids, weights, num_experts, capacity)


@pytest.mark.parametrize("tokens, top_k, hidden, experts, lines",
                         [(1, 1, 8, 8, True), (1, 8, 64, 64, True), (8, 8, 7168, 256, True),
                          (128, 8, 7168, 256, False)],
                         ids=["one-token-top-1", "one-token", "decode-rows-lines", "decode-rows-flags"])
def test_moe_dispatch_shapes(tokens, top_k, hidden, experts, lines):
    """T = 1 (one 16-byte vector per row), and DeepSeek-V3's decode shape: tokens of 7168 bfloat16, top-8 of
    256 experts on 8 ranks; 8 tokens (0.9 MiB of slot rows) travel as LL128 lines, 128 (16 MB) as rows and
    flags."""
    size, calls = 8, 2
    ids, capacity = dispatch_routing("random", size, calls, tokens, top_k, experts, seed=tokens)
    x = random_array((calls, size, tokens, hidden), ml_dtypes.bfloat16, seed=tokens)
    weights = random_array(ids.shape, np.float32, seed=3)
    actual = loopback.moe_dispatch(x, ids, weights, num_experts=experts, capacity=capacity)
    assert actual[1][0]["lines"] == lines
    check_moe_dispatch(actual, x, ids, weights, experts, capacity)


@pytest.mark.parametrize("wire", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("hidden", [7168, 1536, 512], ids=["deepseek", "whole-steps", "one-step"])
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32, np.float16], ids=["bf16", "f32", "f16"])
@pytest.mark.parametrize("size, tokens", [(1, 8), (2, 8), (8, 8), (2, 64)],
                         ids=["1-rank", "2-ranks", "8-ranks", "2-ranks-64"])
def test_moe_dispatch_8bit_wire(size, tokens, dtype, hidden, wire):
    """On an 8-bit wire at decode sizes the rows travel as LL128 lines, three quantized blocks and their scales a
    warp step (a partial last step at H = 7168 and 512, whole steps at 1536); 64 tokens on 2 ranks at H = 7168
    (over 1 MiB of lines) take rows and flags. The expert rows are the chain's rows through the wire, every other
    result is the chain's, over three calls (both parity halves)."""
    calls, top_k = 3, 4
    num_experts = 4 * size
    ids, capacity = dispatch_routing("random", size, calls, tokens, top_k, num_experts, seed=size)
    x = wire_tokens((calls, size, tokens, hidden), dtype, seed=size)
    weights = random_array(ids.shape, np.float32, seed=size + 1)
    actual = loopback.moe_dispatch(x, ids, weights, num_experts=num_experts, capacity=capacity, wire=wire)
    assert actual[1][0]["lines"] == wire_takes_lines(size * tokens, hidden)
    check_moe_dispatch(actual, x, ids, weights, num_experts, capacity, wire=wire)


@pytest.mark.parametrize("path", ["lines", "flags", "lines-fp8"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_moe_dispatch_many_calls(schedule, path):
    """New routings and weights every call on one set of flags and slots, as for combine. Rows of 16 float32
    (a capacity that drops) travel as lines, and rows of 512 on the 8-bit wire; rows of 8192 (1.1 MiB of slot
    rows) as rows and flags, over fewer calls."""
    size, (calls, options) = 4, SCHEDULES[schedule]
    wire = "float8_e4m3fn" if path == "lines-fp8" else None
    if path == "flags":
        calls, hidden = min(calls, 20), 8192
        ids, capacity = dispatch_routing("random", size, calls, 8, 2, 8, seed=7)
    else:
        calls, hidden = min(calls, 60), 16 if wire is None else 512
        ids, capacity = dispatch_routing("tight", size, calls, 8, 2, 8, seed=7)
    x = random_array((calls, size, 8, hidden), np.float32, seed=7)
    weights = random_array(ids.shape, np.float32, seed=8)
    actual = loopback.moe_dispatch(x, ids, weights, num_experts=8, capacity=capacity, trace=True, wire=wire,
                                   **options)
    assert actual[1][0]["lines"] == path.startswith("lines")
    check_moe_dispatch(actual, x, ids, weights, 8, capacity, wire=wire)
    assert_timelines(actual[1], calls, kernel="moe.dispatch")


def test_moe_dispatch_phase_clocks():
    """A profiled call (time_loopback_collectives.py --moe-phases) computes the same results and has every
    block read its clock at each phase, in order."""
    size, calls = 2, 2
    ids, capacity = dispatch_routing("random", size, calls, 16, 4, 8, seed=9)
    x = random_array((calls, size, 16, 64), np.float32, seed=9)
    actual = loopback.moe_dispatch(x, ids, None, num_experts=8, capacity=capacity, phases=True)
    check_moe_dispatch(actual, x, ids, None, 8, capacity)
    clocks = actual[0]["phase_clocks"]
    assert clocks.shape == (size, actual[1][0]["blocks"], 10) and (clocks > 0).all()
    assert (np.diff(clocks, axis=-1) >= 0).all()


@pytest.mark.parametrize("hidden, wire", [(16, None), (8192, None), (512, "float8_e4m3fn")],
                         ids=["lines", "flags", "lines-fp8"])
def test_moe_dispatch_missing_rank_is_named(hidden, wire):
    size, calls = 4, 2
    ids, capacity = dispatch_routing("random", size, calls, 8, 2, 8, seed=8)
    x = random_array((calls, size, 8, hidden), np.float32, seed=8)
    _, ranks = loopback.moe_dispatch(x, ids, None, num_experts=8, capacity=capacity, wire=wire, absent=1,
                                     timeout_ms=200)
    assert ranks[0]["lines"] == (hidden != 8192)
    loopback.assert_absent_rank_named(ranks, absent=1, calls=calls)


# ---- random configurations ------------------------------------------------------------------------------------
# Shapes and settings the grids above do not reach: 5 to 7 ranks, sizes off every boundary, requested block
# counts. Seeded, so a failure names a configuration that reproduces.


def test_collectives_random_configurations():
    rng = np.random.default_rng(2026)
    for case in range(80):
        size = int(rng.integers(2, 9))
        op = str(rng.choice(["all_reduce", "all_gather", "all_to_all", "reduce_scatter"]))
        dtypes = REDUCE_DTYPES if op in ("all_reduce", "reduce_scatter") else MOVE_DTYPES
        dtype = dtypes[int(rng.integers(len(dtypes)))]
        elements = int(rng.choice([rng.integers(1, 80), rng.integers(80, 20000), rng.integers(20000, 150000)]))
        if op in ("all_to_all", "reduce_scatter"):
            elements = size * max(1, elements // size)
        config = dict(algorithm="two-shot" if op == "all_reduce" and rng.random() < 0.4 else "one-shot",
                      protocol=str(rng.choice(list(loopback.PROTOCOLS))), direct=bool(rng.random() < 0.5),
                      blocks=int(rng.integers(1, 80)) if rng.random() < 0.3 else 0)
        where = f"case {case}: {op} of {elements} {np.dtype(dtype).name} on {size} ranks, {config}"
        x = random_array((2, size, elements), dtype, seed=case)
        y, ranks = loopback.collective(op, x, **config)
        assert all(state["fault"] == "healthy" for state in ranks), (where, ranks)
        for call in range(2):
            if op == "all_reduce":
                expected = np.broadcast_to(reference.reduce_in_rank_order(list(x[call]), "sum", dtype), y[call].shape)
            elif op == "reduce_scatter":
                blocks = x[call].reshape(size, size, -1)
                expected = np.stack([reference.reduce_in_rank_order(list(blocks[:, j]), "sum", dtype)
                                     for j in range(size)])
            else:
                expected = expected_collective(op, x[call:call + 1])[0]
            mismatch = np.flatnonzero(y[call].view(np.uint8) != np.ascontiguousarray(expected).view(np.uint8))
            assert mismatch.size == 0, f"{where}: call {call}, {mismatch.size} bytes differ"


def test_all_to_allv_random_configurations():
    rng = np.random.default_rng(7)
    for case in range(50):
        size, k, batch = int(rng.integers(2, 9)), int(rng.integers(1, 5)), int(rng.integers(1, 4))
        capacity, source_rows = int(rng.integers(0, 9)), int(rng.integers(1, 30))
        feature_bytes = int(rng.choice([rng.integers(1, 40), 4 * rng.integers(1, 40), 16 * rng.integers(1, 40)]))
        num_rows = int(rng.integers(1, 30)) if rng.random() < 0.5 else None
        suffix_bytes = int(rng.integers(1, 17)) if rng.random() < 0.4 else 0
        config = dict(layout=str(rng.choice(["padded", "packed"])), direct=bool(rng.random() < 0.5),
                      blocks=int(rng.integers(1, 200)) if rng.random() < 0.3 else 0)
        where = (f"case {case}: {size} ranks, batch {batch}, k {k}, capacity {capacity}, rows {source_rows} of "
                 f"{feature_bytes} bytes, send_rows {num_rows}, suffix {suffix_bytes} bytes, {config}")
        calls = 2
        x = rng.integers(0, 256, size=(calls, size, batch, source_rows, feature_bytes)).astype(np.uint8)
        send_rows = suffix = None
        rows = source_rows
        if num_rows is not None:
            rows = num_rows
            send_rows = rng.integers(-2, source_rows + 2, size=(calls, size, batch, rows)).astype(np.int32)
        if suffix_bytes:
            suffix = rng.integers(0, 256, size=(calls, size, batch, rows, suffix_bytes)).astype(np.uint8)
        counts = rng.integers(-2, capacity + 4, size=(calls, size, batch, size, k)).astype(np.int32)
        actual = loopback.all_to_allv(x, counts, capacity, send_rows=send_rows, suffix=suffix, **config)
        expected = expected_all_to_allv(x, counts, capacity, config["layout"], send_rows, suffix)
        try:
            check_all_to_allv(actual, expected, calls)
        except AssertionError as e:
            raise AssertionError(f"{where}: {e}") from None
