"""The NVLink kernels of all_reduce / all_gather / all_to_all / reduce_scatter (GPU only).

Each algorithm and one-shot protocol (LL128 lines, LL words, simple; forced through the thresholds and
JAX_NCCLX_NVLINK_PROTOCOL), with data written into the peers' outputs and through slots
(JAX_NCCLX_NVLINK_DIRECT), against an exact NumPy reference for every size class and dtype: all_reduce sums
in rank order with 16-bit floats accumulated in float32 and rounded once (which only 3 or more GPUs can tell
from 16-bit accumulation), so the expected bits are known exactly, and every rank must hold the same bits.
Moves get random bits. Flags and slots are reused over thousands of calls that mix ops and algorithms in one
program, and the lowering picks the algorithm by size. Sub-communicators of a 2-D mesh go through these
kernels in test_collectives.py (4 or more GPUs); command buffers and one process per GPU in
test_all_to_allv.py / test_multiprocess.py (their workers cover these ops too).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ncclx as nx
import reference
from conftest import gpu_devices, gpu_skip_reason
from helpers import assert_bits_equal, random_bits

pytestmark = pytest.mark.gpu

EVERYTHING = str(1 << 40)
PROTOCOLS = ("ll128", "ll", "simple")
ALGORITHMS = {  # param -> (one-shot max bytes, NVLink max bytes, one-shot protocol, JAX_NCCLX_NVLINK_DIRECT)
    **{f"one-shot-{protocol}": (EVERYTHING, EVERYTHING, protocol, "1") for protocol in PROTOCOLS},
    "two-shot": ("0", EVERYTHING, "ll128", "1"),            # the all-gather writes into the peers' outputs
    "two-shot-staged": ("0", EVERYTHING, "ll128", "0"),     # through slots, as one process per GPU does
}
# Elements per rank: one, odd counts (scalar path, short last chunks and lines; 16-bit odd counts are not
# whole 4-byte words, so they go simple), 16 and 64 KiB of f32 (64 KiB: the largest one-shot call sent as LL128
# lines or LL words), a few blocks, many blocks.
ELEMENTS = [1, 3, 4096, 4099, 16384, 65544, 300001]
REDUCE_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32]
MOVE_DTYPES = [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn]


@pytest.fixture
def gpus(monkeypatch):
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "nvlink")  # a fallback to NCCL is an error
    return gpu_devices()


@pytest.fixture(params=ALGORITHMS)
def algorithm(request, monkeypatch):
    """all_reduce's algorithm (and one-shot protocol, or two-shot's all-gather), forced for every size."""
    oneshot_max, nvlink_max, protocol, direct = ALGORITHMS[request.param]
    monkeypatch.setenv("JAX_NCCLX_NVLINK_DIRECT", direct)
    monkeypatch.setenv("JAX_NCCLX_NVLINK_ONESHOT_MAX_BYTES", oneshot_max)
    monkeypatch.setenv("JAX_NCCLX_NVLINK_MAX_BYTES", nvlink_max)
    monkeypatch.setenv("JAX_NCCLX_NVLINK_PROTOCOL", protocol)
    return request.param


MOVE_PROTOCOLS = {  # param -> (one-shot protocol, JAX_NCCLX_NVLINK_DIRECT); simple writes into the peers' outputs
    **{protocol: (protocol, "1") for protocol in PROTOCOLS},
    "simple-staged": ("simple", "0"),
}
FROM_ANY_SIZE = "0"  # JAX_NCCLX_NVLINK_DIRECT_MIN_BYTES: moves write into the peers' outputs at every size


@pytest.fixture(params=MOVE_PROTOCOLS)
def nvlink_any_size(request, monkeypatch):
    """all_gather / all_to_all (one-shot only) take their NVLink kernel at every size, in each protocol, and
    simple calls both into the peers' outputs and through slots."""
    protocol, direct = MOVE_PROTOCOLS[request.param]
    monkeypatch.setenv("JAX_NCCLX_NVLINK_MAX_BYTES", EVERYTHING)
    monkeypatch.setenv("JAX_NCCLX_NVLINK_PROTOCOL", protocol)
    monkeypatch.setenv("JAX_NCCLX_NVLINK_DIRECT", direct)
    monkeypatch.setenv("JAX_NCCLX_NVLINK_DIRECT_MIN_BYTES", FROM_ANY_SIZE)
    return request.param


def per_rank(devices, fn):
    """jit(shard_map(fn)) over a 1-D mesh "x" of ``devices``; arrays are [n, ...], row r on rank r."""
    mesh = jax.sharding.Mesh(np.asarray(devices), ("x",))
    mapped = jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    return lambda x: np.asarray(mapped(jax.device_put(x, NamedSharding(mesh, P("x")))))


def inputs(n, elements, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return rng.integers(max(info.min, -100), min(info.max, 100), size=(n, elements)).astype(dtype)
    return rng.normal(size=(n, elements)).astype(dtype)


@pytest.mark.parametrize("elements", ELEMENTS)
@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_all_reduce_sum_is_exact(gpus, algorithm, dtype, elements):
    n = len(gpus)
    x = inputs(n, elements, dtype)
    out = per_rank(gpus, lambda v: nx.all_reduce(v, "x"))(x)
    expected = reference.reduce_in_rank_order(list(x), "sum", dtype)
    for rank in range(n):  # every rank holds the same bits
        assert_bits_equal(out[rank], expected)


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32], ids=lambda d: jnp.dtype(d).name)
def test_all_reduce_max_min(gpus, algorithm, dtype, op):
    n = len(gpus)
    x = inputs(n, 4099, dtype, seed=1)
    out = per_rank(gpus, lambda v: nx.all_reduce(v, "x", op))(x)
    for rank in range(n):
        assert_bits_equal(out[rank], reference.reduce_in_rank_order(list(x), op, dtype))


@pytest.mark.parametrize("elements", [1, 5, 4096, 4099, 65536])
@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_all_gather(gpus, nvlink_any_size, dtype, elements):
    n = len(gpus)
    x = random_bits((n, elements), dtype)
    out = per_rank(gpus, lambda v: nx.all_gather(v, "x", tiled=True))(x)
    for rank in range(n):
        assert_bits_equal(out[rank], x.reshape(-1))


@pytest.mark.parametrize("block", [1, 5, 1025, 16384, 16385])  # 16384 f32: 64 KiB per peer, the largest in lines
@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_all_to_all(gpus, nvlink_any_size, dtype, block):
    n = len(gpus)
    x = random_bits((n, n * block), dtype)  # rank r's block j goes to rank j
    out = per_rank(gpus, lambda v: nx.all_to_all(v, "x", 0, 0, tiled=True))(x)
    blocks = x.reshape(n, n, block)
    for rank in range(n):
        assert_bits_equal(out[rank], blocks[:, rank].reshape(-1))


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("block", [1, 3, 1025, 16384, 16385])  # 16384 f32: 64 KiB per peer, the largest in lines
@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_reduce_scatter_sum_is_exact(gpus, monkeypatch, dtype, block, protocol):
    """Rank j gets block j of the sum, summed in rank order as all_reduce's kernels sum (16-bit floats in
    float32, rounded once)."""
    monkeypatch.setenv("JAX_NCCLX_NVLINK_MAX_BYTES", EVERYTHING)
    monkeypatch.setenv("JAX_NCCLX_NVLINK_PROTOCOL", protocol)
    n = len(gpus)
    x = inputs(n, n * block, dtype)
    out = per_rank(gpus, lambda v: nx.reduce_scatter(v, "x", tiled=True))(x)
    blocks = x.reshape(n, n, block)
    for rank in range(n):
        assert_bits_equal(out[rank], reference.reduce_in_rank_order(list(blocks[:, rank]), "sum", dtype))


def custom_calls(text):
    """(target, algorithm or None) of every jax_ncclx custom call in lowered StableHLO text."""
    calls = []
    for line in text.splitlines():
        if "ncclx_" not in line or "custom_call" not in line:
            continue
        target = line.split("@")[1].split("(")[0]
        algorithm = int(line.split("algorithm = ")[1].split(" ")[0]) if "algorithm = " in line else None
        calls.append((target, algorithm))
    return calls


def test_lowering_picks_the_algorithm_by_size(gpus, monkeypatch):
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "auto")
    monkeypatch.setenv("JAX_NCCLX_NVLINK_ONESHOT_MAX_BYTES", "1024")
    monkeypatch.setenv("JAX_NCCLX_NVLINK_MAX_BYTES", "65536")
    n = len(gpus)
    mesh = jax.sharding.Mesh(np.asarray(gpus), ("x",))

    def lowered(fn, elements):
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        return custom_calls(f.lower(jnp.zeros((n * elements,), jnp.float32)).as_text())

    all_reduce = lambda v: nx.all_reduce(v, "x")  # noqa: E731
    all_gather = lambda v: nx.all_gather(v, "x", tiled=True)  # noqa: E731
    assert lowered(all_reduce, 256) == [("ncclx_all_reduce_nvlink", 1)]     # 1 KiB: one-shot
    assert lowered(all_reduce, 257) == [("ncclx_all_reduce_nvlink", 2)]     # just above: two-shot
    assert lowered(all_reduce, 16384) == [("ncclx_all_reduce_nvlink", 2)]   # 64 KiB: still NVLink
    assert lowered(all_reduce, 16385) == [("ncclx_all_reduce", None)]       # above the NVLink max: NCCL
    assert lowered(all_gather, 16384) == [("ncclx_all_gather_nvlink", None)]
    assert lowered(all_gather, 16385) == [("ncclx_all_gather", None)]
    reduce_scatter = lambda v: nx.reduce_scatter(v, "x", tiled=True)  # noqa: E731
    assert lowered(reduce_scatter, 16384) == [("ncclx_reduce_scatter_nvlink", None)]
    assert lowered(reduce_scatter, 16392) == [("ncclx_reduce_scatter", None)]  # above, split over up to 8 ranks
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "nccl")
    assert lowered(all_reduce, 2) == [("ncclx_all_reduce", None)]
    monkeypatch.setenv("JAX_NCCLX_NCCL_COMMAND_BUFFERS", "1")  # NCCL, recorded into command buffers; NVLink as is
    assert lowered(all_reduce, 2) == [("ncclx_all_reduce_cmdbuf", None)]
    assert lowered(all_gather, 2) == [("ncclx_all_gather_cmdbuf", None)]
    monkeypatch.delenv("JAX_NCCLX_NVLINK_ONESHOT_MAX_BYTES")
    monkeypatch.delenv("JAX_NCCLX_NVLINK_MAX_BYTES")
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "auto")
    assert lowered(all_reduce, 2) == [("ncclx_all_reduce_nvlink", 1)]       # defaults: 8 B is one-shot
    stats = [s for s in nx.memory_stats() if s["low_latency_bytes"] > 0]
    assert stats and all(s["low_latency_bytes"] <= s["symmetric_data_bytes"] for s in stats)


@pytest.mark.parametrize("protocol", ["auto", "simple"])
def test_flags_survive_thousands_of_mixed_calls(gpus, monkeypatch, protocol):
    """One program: 2000 steps, each a one-shot all_reduce, a two-shot all_reduce, an all_gather and an
    all_to_all on the same communicator (8000 calls), checked against NumPy at the end. In simple, the moves
    and the two-shot all-gather write into the peers' outputs, between one-shot all_reduces through slots."""
    monkeypatch.setenv("JAX_NCCLX_NVLINK_ONESHOT_MAX_BYTES", "512")
    monkeypatch.setenv("JAX_NCCLX_NVLINK_MAX_BYTES", EVERYTHING)
    monkeypatch.setenv("JAX_NCCLX_NVLINK_PROTOCOL", protocol)
    monkeypatch.setenv("JAX_NCCLX_NVLINK_DIRECT_MIN_BYTES", FROM_ANY_SIZE)
    n, steps, k = len(gpus), 2000, 3
    mesh = jax.sharding.Mesh(np.asarray(gpus), ("x",))

    def step(rank, a, b):
        a = nx.all_reduce(a, "x") % 1009 + rank                       # 32 B: one-shot
        b = nx.all_reduce(b, "x") % 1013 + a[0]                       # 4 KiB: two-shot
        a = a + nx.all_gather(a[:2], "x", tiled=True).sum() % 7       # every rank's a[:2]
        moved = nx.all_to_all(b[: n * k], "x", 0, 0, tiled=True)      # block j of b to rank j
        return a, b.at[: n * k].set(moved)

    def program(a, b):
        rank = jax.lax.axis_index("x").astype(jnp.int32)
        a, b = jax.lax.fori_loop(0, steps, lambda _, c: step(rank, *c), (a[0], b[0]))
        return a[None], b[None]

    f = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    a0 = np.arange(n * 8, dtype=np.int32).reshape(n, 8)
    b0 = (np.arange(n * 1024, dtype=np.int32) % 97).reshape(n, 1024)
    sharding = NamedSharding(mesh, P("x"))
    a, b = (np.asarray(o) for o in f(jax.device_put(a0, sharding), jax.device_put(b0, sharding)))

    ra, rb = a0.copy(), b0.copy()
    ranks = np.arange(n, dtype=np.int32)[:, None]
    for _ in range(steps):
        ra = ra.sum(0, keepdims=True) % 1009 + ranks
        rb = rb.sum(0, keepdims=True) % 1013 + ra[:, :1]
        ra = ra + ra[:, :2].sum() % 7
        blocks = rb[:, : n * k].reshape(n, n, k)
        rb[:, : n * k] = blocks.transpose(1, 0, 2).reshape(n, n * k)
    np.testing.assert_array_equal(a, ra)
    np.testing.assert_array_equal(b, rb)


def test_bf16_sum_accumulates_in_f32(gpus, algorithm):
    """Values whose bf16 running sum would lose the small terms: accumulating in f32 keeps them."""
    n = len(gpus)
    if n < 3:  # one addition rounds the same either way: the loopback tests check the kernels at 3 to 8 ranks
        pytest.skip("bf16 and f32 accumulation agree on the sum of 2 values: needs 3 or more GPUs")
    x = np.zeros((n, 4096), ml_dtypes.bfloat16)
    x[0] = 256.0
    x[1:] = 1.0  # 256 + 1 rounds back to 256 in bf16, but 256 + (n - 1) is exact in f32 for n - 1 >= 2
    out = per_rank(gpus, lambda v: nx.all_reduce(v, "x"))(x)
    expected = np.full(4096, 256.0 + (n - 1), np.float32).astype(ml_dtypes.bfloat16)
    for rank in range(n):
        assert_bits_equal(out[rank], expected)


@pytest.mark.parametrize("protocol", ["ll128", "ll"])
@pytest.mark.parametrize("big_algorithm", ["two-shot", "one-shot"])
def test_low_latency_flags_ignore_other_calls_data(gpus, monkeypatch, protocol, big_algorithm):
    """Other calls leave their data in the same parity halves: two-shot calls raw data, one-shot calls of
    another size their lines or words at other offsets. Data made of small integers looks exactly like the
    tags of LL words and the epochs that flag LL128 lines. The small one-shot calls that follow must still
    wait for their own lines or words."""
    monkeypatch.setenv("JAX_NCCLX_NVLINK_ONESHOT_MAX_BYTES", "0" if big_algorithm == "two-shot" else EVERYTHING)
    monkeypatch.setenv("JAX_NCCLX_NVLINK_MAX_BYTES", EVERYTHING)
    monkeypatch.setenv("JAX_NCCLX_NVLINK_PROTOCOL", protocol)
    n, steps = len(gpus), 100
    mesh = jax.sharding.Mesh(np.asarray(gpus), ("x",))

    def program(big, small):
        def step(_, carry):
            big, small = carry
            big = nx.all_reduce(big, "x") % 8191 + 1                 # every value 1..8191 on the wire
            small = nx.all_gather(small, "x", tiled=True)[: small.shape[0]] + big[:1]  # one-shot, 256 B
            return big, small
        big, small = jax.lax.fori_loop(0, steps, step, (big[0], small[0]))
        return big[None], small[None]

    # check_vma=False: the loop carries all_reduce's (invariant) result back into a varying input.
    f = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    big0 = (np.arange(n * 8192, dtype=np.int32) % 8191 + 1).reshape(n, 8192)
    small0 = np.arange(n * 64, dtype=np.int32).reshape(n, 64)
    sharding = NamedSharding(mesh, P("x"))
    big, small = (np.asarray(o) for o in f(jax.device_put(big0, sharding), jax.device_put(small0, sharding)))
    rbig, rsmall = big0.copy(), small0.copy()
    for _ in range(steps):
        rbig = np.broadcast_to(rbig.sum(0) % 8191 + 1, rbig.shape).copy()
        rsmall = np.broadcast_to(rsmall.reshape(-1)[:64], rsmall.shape) + rbig[:, :1]
    np.testing.assert_array_equal(big, rbig)
    np.testing.assert_array_equal(small, rsmall)


def test_protocol_reaches_the_kernel(gpus, monkeypatch):
    """JAX_NCCLX_NVLINK_PROTOCOL becomes the one-shot call's protocol attribute (0 LL128, 1 LL, 2 simple); auto
    takes LL below JAX_NCCLX_NVLINK_LL128_MIN_BYTES per peer and LL128 from there."""
    monkeypatch.setenv("JAX_NCCLX_NVLINK_MAX_BYTES", EVERYTHING)
    monkeypatch.setenv("JAX_NCCLX_NVLINK_LL128_MIN_BYTES", "1024")
    n = len(gpus)
    mesh = jax.sharding.Mesh(np.asarray(gpus), ("x",))
    for protocol, per_peer, attr in (("ll128", 8, 0), ("ll", 8, 1), ("simple", 8, 2), ("auto", 255, 1),
                                     ("auto", 256, 0)):
        monkeypatch.setenv("JAX_NCCLX_NVLINK_PROTOCOL", protocol)
        f = jax.jit(jax.shard_map(lambda v: nx.all_to_all(v, "x", 0, 0, tiled=True), mesh=mesh,
                                  in_specs=P("x"), out_specs=P("x")))
        text = f.lower(jnp.zeros((n * n * per_peer,), jnp.float32)).as_text()
        assert f"protocol = {attr}" in text, (protocol, per_peer)
