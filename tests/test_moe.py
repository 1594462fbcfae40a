"""jax_ncclx.moe dispatch / combine against a dense per-device NumPy reference: expert-major rows and group
sizes, drops over capacity, the round trip, ragged_dot experts, gradients against jax.grad of a dense layer,
vmap, bf16 and argument errors; on CPU and, where present, GPUs. The round trips run both ways of combining:
with the weights given to combine (one row per pair comes back) and given to dispatch (each member sums a
token's pairs and sends one row back). benchmarks/xla_moe.py, the benchmark's XLA-only layer, is checked
against the same reference."""

import logging
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import gpu_devices, gpu_skip_reason
from helpers import assert_same, random_array
from jax_ncclx import moe
from jax_ncclx._src.ops import moe_dispatch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import xla_moe  # noqa: E402

TOKENS, HIDDEN, TOP_K = 8, 4, 2  # per member
AMPLE = TOKENS * TOP_K           # a capacity nothing can overflow
TIGHT = 2                        # about the mean load per member pair: some rows drop
HIGHEST = jax.lax.Precision.HIGHEST  # no TF32 on GPUs, so float32 compares tightly
WEIGHTS_IN = ["combine", "dispatch"]  # where the round trips give the router weights


def dispatch_and_combine(tokens, ids, weights, *, weights_in, expert=lambda rows, sizes: rows, **kwargs):
    """dispatch, expert(rows, group_sizes), combine, with the weights given to combine or to dispatch:
    (expert_rows, group_sizes, handle, out)."""
    if weights_in == "dispatch":
        rows, sizes, handle = moe.dispatch(tokens, ids, weights=weights, **kwargs)
        return rows, sizes, handle, moe.combine(expert(rows, sizes), handle)
    rows, sizes, handle = moe.dispatch(tokens, ids, **kwargs)
    return rows, sizes, handle, moe.combine(expert(rows, sizes), handle, weights)


def scaled_by_expert(axis_name):
    """An expert function that multiplies each row by 1 + the global index of the expert it reached (member
    ``jax.lax.axis_index(axis_name)``, local expert from the group sizes), so that a row handled by the wrong
    expert or member changes the result."""
    def expert(rows, sizes):
        local = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows.shape[0]), side="right")  # zero rows: past E
        first = jax.lax.axis_index(axis_name) * sizes.shape[0]
        return rows * (1 + first + local).astype(rows.dtype)[:, None]

    return expert


def line_mesh(devices):
    return jax.sharding.Mesh(np.asarray(devices), ("x",))


def random_ids(n, num_experts, seed, shape=(TOKENS, TOP_K)):
    """[n, T, k] expert ids, skewed towards low experts, with some -1 (no expert)."""
    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.integers(0, num_experts, size=(n, *shape)), rng.integers(0, num_experts, size=(n, *shape)))
    return np.where(rng.random((n, *shape)) < 0.1, -1, ids).astype(np.int32)


def reference_dispatch(tokens, ids, num_experts, capacity):
    """Per member: (expert_rows, group_sizes, dropped), plus the [n, T, k] mask of pairs that were delivered."""
    n = len(tokens)
    local = num_experts // n
    delivered = np.zeros(ids.shape, bool)
    dropped = np.zeros((n, n), np.int32)
    sent = {}  # (source, expert) -> rows delivered to the expert, in send order
    for src in range(n):
        flat = ids[src].reshape(-1)
        taken = np.zeros(n, int)
        for pair in np.argsort(np.where(flat < 0, num_experts, flat), kind="stable"):
            expert = flat[pair]
            if expert < 0:
                continue
            dst = expert // local
            if taken[dst] == capacity:
                dropped[src, dst] += 1
                continue
            taken[dst] += 1
            delivered[src].reshape(-1)[pair] = True
            sent.setdefault((src, expert), []).append(tokens[src][pair // ids.shape[2]])
    out = []
    for dst in range(n):
        rows = np.zeros((n * capacity, tokens.shape[2]), tokens.dtype)
        sizes = np.zeros(local, np.int32)
        at = 0
        for e in range(local):
            for src in range(n):
                for row in sent.get((src, dst * local + e), []):
                    rows[at] = row
                    at += 1
                    sizes[e] += 1
        out.append((rows, sizes, dropped[dst]))
    return out, delivered


def run_dispatch_combine(mesh, tokens, ids, weights, num_experts, capacity, weights_in="combine"):
    """Per member: dispatch, combine. Returns stacked (expert_rows, group_sizes, dropped, out)."""

    def body(t, i, w):
        rows, sizes, handle, out = dispatch_and_combine(t[0], i[0], w[0], weights_in=weights_in,
                                                        num_experts=num_experts, axis_name="x", capacity=capacity)
        return rows[None], sizes[None], handle.dropped[None], out[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x")))
    return [np.asarray(o) for o in f(tokens, ids, weights)]


def check_against_reference(tokens, ids, weights, num_experts, capacity, rows, sizes, dropped, out):
    """Each member's expert-major rows, group sizes and drops are the reference's (drops exactly when the
    capacity is TIGHT), and identity experts give sum_j w * token over the delivered pairs."""
    expected, delivered = reference_dispatch(tokens, ids, num_experts, capacity)
    for member, (ref_rows, ref_sizes, ref_dropped) in enumerate(expected):
        np.testing.assert_array_equal(rows[member], ref_rows)
        np.testing.assert_array_equal(sizes[member], ref_sizes)
        np.testing.assert_array_equal(dropped[member], ref_dropped)
    assert (dropped.sum() > 0) == (capacity == TIGHT)
    ref_out = (tokens[:, :, None, :] * (weights * delivered)[..., None]).sum(axis=2)
    np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("weights_in", WEIGHTS_IN)
@pytest.mark.parametrize("capacity", [AMPLE, TIGHT], ids=["ample", "tight"])
def test_dispatch_and_round_trip(backend, capacity, weights_in):
    """Expert-major rows, group sizes and drops match the reference; identity experts give sum_j w * token over
    the delivered pairs."""
    n = len(backend)
    num_experts = 2 * n
    tokens = random_array((n, TOKENS, HIDDEN), jnp.float32)
    ids = random_ids(n, num_experts, seed=capacity)
    weights = random_array((n, TOKENS, TOP_K), jnp.float32, seed=1)
    rows, sizes, dropped, out = run_dispatch_combine(line_mesh(backend), tokens, ids, weights, num_experts, capacity,
                                                     weights_in)
    check_against_reference(tokens, ids, weights, num_experts, capacity, rows, sizes, dropped, out)


@pytest.fixture(params=["cpu", pytest.param("gpu-nvlink", marks=pytest.mark.gpu),
                        pytest.param("gpu-nccl", marks=pytest.mark.gpu)])
def combine_path(request, monkeypatch):
    """(devices, the FFI target combine's forward pass must lower to): on CPU the exchange chain; on every
    local GPU (one is enough) the NVLink kernel, or with JAX_NCCLX_TRANSPORT=nccl the chain over NCCL."""
    if request.param == "cpu":
        return jax.devices("cpu"), "ncclx_all_to_allv_dynamic"
    reason = gpu_skip_reason(minimum=1)
    if reason:
        pytest.skip(reason)
    transport = request.param.removeprefix("gpu-")
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", transport)
    return gpu_devices(), "ncclx_moe_combine_nvlink" if transport == "nvlink" else "ncclx_all_to_allv_dynamic"


@pytest.mark.parametrize("capacity", [AMPLE, TIGHT], ids=["ample", "tight"])
def test_combine_with_dispatch_weights_on_every_path(combine_path, capacity):
    """combine(expert_out, handle) is one NVLink kernel on GPU and the exchange chain elsewhere: both give the
    reference's round trip (experts scale rows by their index, so a row at the wrong expert shows), and the
    gradient in tokens and weights is the dense one."""
    devices, target = combine_path
    n = len(devices)
    num_experts = 2 * n
    mesh = line_mesh(devices)
    tokens = random_array((n, TOKENS, HIDDEN), jnp.float32)
    ids = random_ids(n, num_experts, seed=capacity)
    weights = random_array((n, TOKENS, TOP_K), jnp.float32, seed=1)

    def round_trip(t, i, w):
        return dispatch_and_combine(t[0], i[0], w[0], weights_in="dispatch", expert=scaled_by_expert("x"),
                                    num_experts=num_experts, axis_name="x", capacity=capacity)[3][None]

    f = jax.jit(jax.shard_map(round_trip, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x")))
    forward = f.lower(tokens, ids, weights).as_text()
    assert target in forward and ("ncclx_moe_combine_nvlink" in forward) == (target == "ncclx_moe_combine_nvlink")
    _, delivered = reference_dispatch(tokens, ids, num_experts, capacity)
    masked = weights * delivered * (1 + ids)
    np.testing.assert_allclose(f(tokens, ids, weights), (tokens[:, :, None, :] * masked[..., None]).sum(2),
                               rtol=1e-6, atol=1e-6)
    grad_t, grad_w = jax.jit(jax.grad(lambda t, i, w: f(t, i, w).sum(), argnums=(0, 2)))(tokens, ids, weights)
    np.testing.assert_allclose(grad_t, np.broadcast_to(masked.sum(-1, keepdims=True), grad_t.shape), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(grad_w, tokens.sum(-1)[..., None] * delivered * (1 + ids), rtol=1e-5, atol=1e-5)


# combine(expert_out, handle, weights) of bfloat16 pairs: 1 * 1 + (1.125 * 2^-8) * 0.890625 = 1 + 2^-8 + 2^-17,
# which rounds up to 1 + 2^-7; a product rounded to bfloat16 first (2^-8, then a tie) gives 1. argv[1]: layout.
COMBINE_IN_FLOAT32 = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from jax_ncclx import moe
layout = sys.argv[1]
scale = jnp.asarray([[1.0], [1.125 * 2.0 ** -8]], jnp.bfloat16)  # expert 0's output, expert 1's

def layer(t, i, w):
    capacity = 1 if layout == "masked" else 2  # per expert, per member
    rows, _, handle = moe.dispatch(t, i, num_experts=2, axis_name="x", capacity=capacity, layout=layout)
    return moe.combine(rows * scale.reshape((2, 1, 1) if layout == "masked" else (2, 1)), handle, w)

mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:1]), ("x",))
f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x")))
out = f(jnp.ones((1, 8), jnp.bfloat16), jnp.asarray([[0, 1]], jnp.int32),
        jnp.asarray([[1.0, 0.890625]], jnp.bfloat16))
print(out.dtype, *np.unique(np.asarray(out, np.float32)))
"""


@pytest.mark.parametrize("layout", ["packed", "masked"])
def test_combine_with_weights_sums_in_float32(layout):
    """With the weights given to combine, bfloat16 pairs are scaled and summed in float32 and rounded once,
    also where XLA keeps no excess precision (its default may compute a bfloat16 product in float32 anyway)."""
    env = dict(os.environ, XLA_FLAGS="--xla_allow_excess_precision=false", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(sys.path))  # this jax_ncclx
    run = subprocess.run([sys.executable, "-c", COMBINE_IN_FLOAT32, layout], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["bfloat16", str(1 + 2.0 ** -7)], run.stdout


@pytest.mark.gpu
def test_combine_kernel_takes_calls_up_to_its_limit(monkeypatch):
    """The NVLink kernel takes combine where a member's rows fit its 64 MiB; a larger call, and rows it cannot
    move as 16-byte vectors, lower to the exchange chain (lowering only)."""
    reason = gpu_skip_reason(minimum=1)
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "auto")
    mesh = line_mesh(gpu_devices()[:1])

    def lowered(tokens, hidden):
        def body(t, i, w):
            rows, _, handle = moe.dispatch(t, i, weights=w, num_experts=2, axis_name="x", capacity=tokens)
            return moe.combine(rows, handle)

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x")))
        args = (jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16), jax.ShapeDtypeStruct((tokens, 2), jnp.int32),
                jax.ShapeDtypeStruct((tokens, 2), jnp.float32))
        return f.lower(*args).as_text()

    assert "ncclx_moe_combine_nvlink" in lowered(256, 7168)          # 256 rows of 14 KiB: 3.5 MiB
    assert "ncclx_moe_combine_nvlink" in lowered(4096, 7168)         # 56 MiB
    assert "ncclx_moe_combine_nvlink" not in lowered(8192, 7168)     # 112 MiB
    assert "ncclx_moe_combine_nvlink" not in lowered(16, 7)          # 14-byte rows


def dispatch_routing(pattern, tokens=16, top_k=4, num_experts=8):
    """(expert ids [T, k], capacity) for one member: skewed ids with -1 and ids >= E, all on one expert, none,
    a capacity exactly the number of valid pairs, one that drops, one token."""
    rng = np.random.default_rng(len(pattern))
    ids = np.minimum(rng.integers(0, num_experts, (tokens, top_k)), rng.integers(0, num_experts, (tokens, top_k)))
    ids = np.where(rng.random(ids.shape) < 0.1, -1, np.where(rng.random(ids.shape) < 0.05, num_experts + 2, ids))
    if pattern == "one_expert":
        ids = np.full_like(ids, 3)
    elif pattern == "no_expert":
        ids = np.full_like(ids, -1)
    elif pattern == "one_token":
        ids = ids[:1]
    valid = int(np.sum((ids >= 0) & (ids < num_experts)))
    capacity = {"at_capacity": max(valid, 1), "tight": 3}.get(pattern, ids.size)
    return ids.astype(np.int32), capacity


@pytest.mark.gpu
@pytest.mark.parametrize("weighted", [False, True], ids=["", "weights"])
@pytest.mark.parametrize("pattern", ["random", "one_expert", "no_expert", "at_capacity", "tight", "one_token"])
def test_dispatch_kernel_gives_the_chains_results(monkeypatch, pattern, weighted):
    """On one GPU, dispatch's NVLink kernel and the exchange chain (over NCCL) give the same expert rows,
    group sizes and handle arrays, bit for bit, for adversarial routings."""
    reason = gpu_skip_reason(minimum=1)
    if reason:
        pytest.skip(reason)
    mesh = line_mesh(gpu_devices()[:1])
    ids, capacity = dispatch_routing(pattern)
    tokens = random_array((ids.shape[0], 64), jnp.bfloat16, seed=2)
    weights = random_array(ids.shape, jnp.float32, seed=3)

    def run(transport):
        monkeypatch.setenv("JAX_NCCLX_TRANSPORT", transport)

        def body(t, i, w):
            return tuple(moe_dispatch.dispatch_rows(t, i, w if weighted else None, num_experts=8, axis_name="x",
                                                    capacity=capacity))

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x")))
        return f.lower(tokens, ids, weights).as_text(), [np.asarray(o) for o in f(tokens, ids, weights)]

    fused_text, fused = run("auto")
    chain_text, chain = run("nccl")
    assert "ncclx_moe_dispatch_nvlink" in fused_text and "ncclx_moe_dispatch_nvlink" not in chain_text
    for name, got, expected in zip(moe_dispatch.Dispatched._fields, fused, chain):
        assert got.shape == expected.shape and got.dtype == expected.dtype, name
        np.testing.assert_array_equal(got.view(np.uint16) if got.dtype == jnp.bfloat16 else got,
                                      expected.view(np.uint16) if got.dtype == jnp.bfloat16 else expected,
                                      err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("weighted", [False, True], ids=["", "weights"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("wire_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("pattern", ["random", "tight", "one_token"])
def test_dispatch_kernel_8bit_wire_gives_the_chains_results(monkeypatch, pattern, wire_dtype, dtype, weighted):
    """On an 8-bit wire the kernel quantizes as it sends and dequantizes as it places: its handle arrays are
    the chain's bit for bit, its rows the chain's within one step of the format (should XLA's float32
    division round otherwise than the kernel's), and zero exactly where the chain's are. Each token's
    first block is 10^3 times smaller than the rest, and one token's third block is all zeros (scale 0)."""
    reason = gpu_skip_reason(minimum=1)
    if reason:
        pytest.skip(reason)
    mesh = line_mesh(gpu_devices()[:1])
    ids, capacity = dispatch_routing(pattern)
    hidden = 512
    tokens = np.array(random_array((ids.shape[0], hidden), jnp.float32, seed=4))
    tokens *= np.where(np.arange(hidden) < 128, 1e-3, 1.0)
    tokens[0, 256:384] = 0.0
    tokens = jnp.asarray(tokens, dtype)
    weights = random_array(ids.shape, jnp.float32, seed=5)

    def run(transport):
        monkeypatch.setenv("JAX_NCCLX_TRANSPORT", transport)

        def body(t, i, w):
            return tuple(moe_dispatch.dispatch_rows(t, i, w if weighted else None, num_experts=8, axis_name="x",
                                                    capacity=capacity, wire_dtype=wire_dtype))

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x")))
        return f.lower(tokens, ids, weights).as_text(), [np.asarray(o) for o in f(tokens, ids, weights)]

    fused_text, fused = run("auto")
    chain_text, chain = run("nccl")
    assert "ncclx_moe_dispatch_nvlink" in fused_text and "ncclx_moe_dispatch_nvlink" not in chain_text
    step = 2.0 ** -jnp.finfo(wire_dtype).nmant  # one unit in the last place, relative
    for name, got, expected in zip(moe_dispatch.Dispatched._fields, fused, chain):
        assert got.shape == expected.shape and got.dtype == expected.dtype, name
        if name != "expert_rows":
            np.testing.assert_array_equal(got, expected, err_msg=name)
            continue
        got, expected = got.astype(np.float32), expected.astype(np.float32)
        np.testing.assert_array_equal(got == 0, expected == 0, err_msg=name)
        for block in range(hidden // 128):  # within a step of the block's largest value
            cols = slice(128 * block, 128 * (block + 1))
            largest = np.abs(expected[:, cols]).max(axis=1, keepdims=True)
            bound = np.broadcast_to(step * largest + 1e-30, got[:, cols].shape)  # assert_array_less won't broadcast
            np.testing.assert_array_less(np.abs(got[:, cols] - expected[:, cols]), bound,
                                         err_msg=f"{name}, block {block}")
        assert (got == expected).mean() > 0.99, "the kernel's rounding is not the chain's"


@pytest.mark.gpu
def test_dispatch_kernel_takes_decode_sizes(monkeypatch):
    """The NVLink kernel takes dispatch at decode sizes, on an 8-bit wire too; more pairs than its plan holds,
    rows past 4 MiB per member, rows it cannot move as 16-byte vectors and an 8-bit wire of H not a multiple
    of 512 lower to the exchange chain."""
    reason = gpu_skip_reason(minimum=1)
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "auto")
    mesh = line_mesh(gpu_devices()[:1])

    def lowered(tokens, hidden, top_k=8, wire_dtype=None):
        def body(t, i):
            return moe.dispatch(t, i, num_experts=8, axis_name="x", capacity=tokens * top_k,
                                wire_dtype=wire_dtype)[0]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 2, out_specs=P("x")))
        args = (jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16),
                jax.ShapeDtypeStruct((tokens, top_k), jnp.int32))
        return f.lower(*args).as_text()

    assert "ncclx_moe_dispatch_nvlink" in lowered(128, 7168)                   # 128 rows of 14 KiB per member
    assert "ncclx_moe_dispatch_nvlink" not in lowered(512, 7168)               # 4096 pairs
    assert "ncclx_moe_dispatch_nvlink" not in lowered(256, 16384)              # 8 MiB per member
    assert "ncclx_moe_dispatch_nvlink" not in lowered(16, 7)                   # 14-byte rows
    assert "ncclx_moe_dispatch_nvlink" in lowered(16, 7168, wire_dtype=jnp.float8_e4m3fn)
    assert "ncclx_moe_dispatch_nvlink" not in lowered(16, 256, wire_dtype=jnp.float8_e4m3fn)


@pytest.mark.parametrize("capacity", [AMPLE, TIGHT], ids=["ample", "tight"])
def test_benchmark_xla_layer_matches_the_reference(backend, capacity):
    """benchmarks/xla_moe.py, the XLA-only layer that benchmarks/all_to_allv.py times moe against, gives the
    reference's rows, group sizes, drops and round trip: the speedups over it compare the same work."""
    n = len(backend)
    num_experts = 2 * n
    tokens = random_array((n, TOKENS, HIDDEN), jnp.float32)
    ids = random_ids(n, num_experts, seed=capacity)
    weights = random_array((n, TOKENS, TOP_K), jnp.float32, seed=1)

    def body(t, i, w):
        rows, sizes, routing = xla_moe.dispatch(t[0], i[0], num_experts=num_experts, axis_name="x",
                                                capacity=capacity)
        return rows[None], sizes[None], routing.dropped[None], xla_moe.combine(rows, routing, w[0])[None]

    f = jax.jit(jax.shard_map(body, mesh=line_mesh(backend), in_specs=(P("x"),) * 3, out_specs=P("x")))
    rows, sizes, dropped, out = (np.asarray(o) for o in f(tokens, ids, weights))
    check_against_reference(tokens, ids, weights, num_experts, capacity, rows, sizes, dropped, out)


@pytest.mark.parametrize("weights_in", WEIGHTS_IN)
def test_dispatch_combine_and_grads_have_no_loops(weights_in):
    """The routing arithmetic around the two exchanges is straight-line code: a while loop (e.g. jnp's default
    binary search) would make XLA's GPU runtime read its predicate back to the host every iteration."""
    mesh = line_mesh(jax.devices("cpu")[:4])
    tokens, weights = jnp.ones((4 * TOKENS, HIDDEN)), jnp.ones((4 * TOKENS, TOP_K))
    ids = jnp.asarray(random_ids(4, 8, seed=0).reshape(4 * TOKENS, TOP_K))

    def loss(t, i, w):
        return dispatch_and_combine(t, i, w, weights_in=weights_in, num_experts=8, axis_name="x",
                                    capacity=AMPLE)[3].sum()

    for fn in (loss, jax.grad(loss, argnums=(0, 2))):
        step = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P(), check_vma=False))
        text = step.lower(tokens, ids, weights).as_text()
        assert "ncclx_all_to_allv_dynamic" in text and "stablehlo.while" not in text


@pytest.mark.parametrize("weights_in", WEIGHTS_IN)
def test_dropped_pairs_contribute_zero(backend, weights_in):
    """All tokens pick expert 0: only `capacity` rows per member get through, the rest count as dropped."""
    n = len(backend)
    tokens = random_array((n, TOKENS, HIDDEN), jnp.float32)
    ids = np.zeros((n, TOKENS, TOP_K), np.int32)
    weights = np.ones((n, TOKENS, TOP_K), np.float32)
    _, sizes, dropped, out = run_dispatch_combine(line_mesh(backend), tokens, ids, weights, n, TIGHT, weights_in)
    np.testing.assert_array_equal(sizes[:, 0], [n * TIGHT] + [0] * (n - 1))
    np.testing.assert_array_equal(dropped[:, 0], TOKENS * TOP_K - TIGHT)
    # The sorted pairs (0, 0), (0, 1) of each member arrive: token 0 comes back twice, the rest not at all.
    np.testing.assert_allclose(out[:, 0], 2 * tokens[:, 0], rtol=1e-6)
    np.testing.assert_array_equal(out[:, 1:], 0)


def test_each_token_crosses_once_per_member(backend):
    """Two members, k = 4 choices among one member's two experts (each twice): a token crosses the wire once
    per member, tagged with its pairs, so the exchange holds T rows per member rather than T * k, and the
    member still gets one expert-major row per pair."""
    n, top_k, num_experts = 2, 4, 4
    mesh = line_mesh(backend[:n])
    tokens = random_array((n, TOKENS, HIDDEN), jnp.float32)
    member = np.random.default_rng(11).integers(0, n, size=(n, TOKENS, 1))
    ids = (2 * member + np.arange(top_k) % 2).astype(np.int32)  # experts 2m, 2m + 1, 2m, 2m + 1
    weights = random_array((n, TOKENS, top_k), jnp.float32, seed=12)
    capacity = TOKENS * top_k
    rows, sizes, dropped, out = run_dispatch_combine(mesh, tokens, ids, weights, num_experts, capacity)
    expected, _ = reference_dispatch(tokens, ids, num_experts, capacity)
    for m, (ref_rows, ref_sizes, _) in enumerate(expected):
        np.testing.assert_array_equal(rows[m], ref_rows)
        np.testing.assert_array_equal(sizes[m], ref_sizes)
    np.testing.assert_allclose(out, (tokens[:, :, None, :] * weights[..., None]).sum(axis=2), rtol=1e-6, atol=1e-6)

    def traced(body):
        return jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 2, out_specs=P("x")))(
            tokens.reshape(-1, HIDDEN), ids.reshape(-1, top_k))

    # dispatch is one op; its exchange chain (what CPU and NCCL lower) holds the one exchange.
    jaxpr = traced(lambda t, i: moe.dispatch(t, i, num_experts=num_experts, axis_name="x", capacity=capacity)[0])
    assert [e.primitive.name for e in _equations(jaxpr.jaxpr) if e.primitive.name.startswith("ncclx_")] == [
        "ncclx_moe_dispatch"]
    jaxpr = traced(lambda t, i: moe_dispatch._exchange_chain(t, i, axis_name="x", num_experts=num_experts,
                                                            num_members=n, capacity=capacity, wire_dtype=None)[0])
    exchanges = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name == "ncclx_all_to_allv_dynamic"]
    assert len(exchanges) == 1
    # T * min(k, N) send rows (not T * k) read straight from the tokens, each H values followed by the k int32
    # tags (4 float32 columns) from the suffix operand: no copy of the rows before the exchange.
    tokens_in, _, send_rows, suffix = (v.aval.shape for v in exchanges[0].invars)
    assert (tokens_in, send_rows, suffix) == ((1, TOKENS, HIDDEN), (1, TOKENS * n), (1, TOKENS * n, top_k))
    assert exchanges[0].outvars[0].aval.shape[-1] == HIDDEN + top_k
    assert not [e for e in _equations(jaxpr.jaxpr) if e.primitive.name == "ncclx_take_rows"
                and e.invars[0].aval.shape == (1, TOKENS, HIDDEN)]


def _equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs in its equations' parameters (shard_map, custom_vjp, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _equations(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _equations(sub)


def route(tokens, router):
    logits = jnp.dot(tokens, router, precision=HIGHEST)
    gates, ids = jax.lax.top_k(logits, TOP_K)
    return ids.astype(jnp.int32), jax.nn.softmax(gates, axis=-1)


def dense_layer(tokens, router, expert_weights, delivered):
    """tokens [M, H], router [H, E], expert_weights [E, H, H'], delivered [M, k] -> [M, H']."""
    ids, gates = route(tokens, router)
    y = jnp.tanh(jnp.einsum("mh,mkhd->mkd", tokens, expert_weights[ids], precision=HIGHEST))
    return (y * (gates * delivered)[..., None]).sum(axis=1)


@pytest.mark.parametrize("weights_in", WEIGHTS_IN)
@pytest.mark.parametrize("capacity", [AMPLE, TIGHT], ids=["ample", "tight"])
def test_ragged_dot_layer_and_grads(backend, capacity, weights_in):
    """A routed layer (top-k router, tanh(ragged_dot) experts with H' != H): output and gradients in tokens,
    router and expert weights match jax.grad of the dense layer (dropped pairs masked out)."""
    n = len(backend)
    num_experts, out_features = 2 * n, 3
    mesh = line_mesh(backend)
    tokens = random_array((n * TOKENS, HIDDEN), jnp.float32)
    router = random_array((HIDDEN, num_experts), jnp.float32, seed=1)
    expert_weights = random_array((num_experts, HIDDEN, out_features), jnp.float32, seed=2) / 2
    cotangent = random_array((n * TOKENS, out_features), jnp.float32, seed=3)

    def body(t, r, w):
        ids, gates = route(t, r)
        _, _, handle, out = dispatch_and_combine(
            t, ids, gates, weights_in=weights_in, num_experts=num_experts, axis_name="x", capacity=capacity,
            expert=lambda rows, sizes: jnp.tanh(jax.lax.ragged_dot(rows, w, sizes, precision=HIGHEST)))
        return out, handle.dropped[None]

    layer = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P("x")), out_specs=(P("x"), P("x")))
    loss = lambda *args: (layer(*args)[0] * cotangent).sum()  # noqa: E731
    out, dropped = jax.jit(layer)(tokens, router, expert_weights)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(tokens, router, expert_weights)

    ids = np.asarray(route(tokens, router)[0]).reshape(n, TOKENS, TOP_K)
    expected, delivered = reference_dispatch(tokens.reshape(n, TOKENS, HIDDEN), ids, num_experts, capacity)
    np.testing.assert_array_equal(dropped, np.stack([d for _, _, d in expected]))
    assert (np.asarray(dropped).sum() > 0) == (capacity == TIGHT)
    delivered = jnp.asarray(delivered.reshape(n * TOKENS, TOP_K), jnp.float32)
    dense_loss = lambda *args: (dense_layer(*args, delivered) * cotangent).sum()  # noqa: E731
    np.testing.assert_allclose(out, dense_layer(tokens, router, expert_weights, delivered), rtol=1e-5, atol=1e-6)
    for grad, ref in zip(grads, jax.grad(dense_loss, argnums=(0, 1, 2))(tokens, router, expert_weights)):
        np.testing.assert_allclose(grad, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("weights_in", WEIGHTS_IN)
def test_vmap_over_a_batch_axis(backend, weights_in):
    """Two routings per member under vmap match the reference, with one exchange each way, and the gradient
    in the tokens under vmap is the weighted sum of delivered choices (experts scale rows by their index, so
    a row at the wrong expert shows)."""
    n, batch = len(backend), 2
    num_experts = 2 * n
    mesh = line_mesh(backend)
    tokens = random_array((n, batch, TOKENS, HIDDEN), jnp.float32)
    ids = random_ids(n, num_experts, seed=4, shape=(batch, TOKENS, TOP_K))
    weights = random_array((n, batch, TOKENS, TOP_K), jnp.float32, seed=5)

    def round_trip(t, i, w):
        return dispatch_and_combine(t, i, w, weights_in=weights_in, expert=scaled_by_expert("x"),
                                    num_experts=num_experts, axis_name="x", capacity=TIGHT)[3]

    def body(t, i, w):
        out = jax.vmap(round_trip)(t[0], i[0], w[0])
        grad = jax.vmap(jax.grad(lambda u, v, c: round_trip(u, v, c).sum()))(t[0], i[0], w[0])
        return out[None], grad[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x")))
    out, grad = f(tokens, ids, weights)
    for b in range(batch):
        _, delivered = reference_dispatch(tokens[:, b], ids[:, b], num_experts, TIGHT)
        masked = weights[:, b] * delivered * (1 + ids[:, b])  # each delivered choice, scaled by its expert
        np.testing.assert_allclose(out[:, b], (tokens[:, b, :, None, :] * masked[..., None]).sum(2), rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_allclose(grad[:, b], np.broadcast_to(masked.sum(-1, keepdims=True), grad[:, b].shape),
                                   rtol=1e-5, atol=1e-5)
    forward = jax.make_jaxpr(jax.shard_map(lambda t, i, w: jax.vmap(round_trip)(t[0], i[0], w[0])[None], mesh=mesh,
                                           in_specs=(P("x"),) * 3, out_specs=P("x")))(tokens, ids, weights)
    assert str(forward).count("ncclx_all_to_allv_dynamic") == 2


@pytest.mark.parametrize("weights_in", WEIGHTS_IN)
@pytest.mark.parametrize("capacity", [AMPLE, TIGHT], ids=["ample", "tight"])
def test_vmap_over_the_expert_axis(capacity, weights_in):
    """jax.vmap(..., axis_name="ep") in place of shard_map puts every member on this device, and the exchanges
    become gathers (no collective in the jaxpr): rows, group sizes, drops and the round trip match the
    reference, and so does the vmap of the gradient in the tokens."""
    n = 4
    num_experts = 2 * n
    tokens = random_array((n, TOKENS, HIDDEN), jnp.float32)
    ids = random_ids(n, num_experts, seed=capacity)
    weights = random_array((n, TOKENS, TOP_K), jnp.float32, seed=1)

    def body(t, i, w):
        rows, sizes, handle, out = dispatch_and_combine(t, i, w, weights_in=weights_in, num_experts=num_experts,
                                                        axis_name="ep", capacity=capacity)
        return rows, sizes, handle.dropped, out

    f = jax.jit(jax.vmap(body, axis_name="ep"))
    check_against_reference(tokens, ids, weights, num_experts, capacity,
                            *(np.asarray(o) for o in f(tokens, ids, weights)))
    assert "ncclx_all_to_allv" not in str(jax.make_jaxpr(f)(tokens, ids, weights))
    grad = jax.jit(jax.vmap(jax.grad(lambda t, i, w: body(t, i, w)[3].sum()), axis_name="ep"))(tokens, ids, weights)
    _, delivered = reference_dispatch(tokens, ids, num_experts, capacity)
    expected = np.broadcast_to((weights * delivered).sum(-1, keepdims=True), grad.shape)
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["packed", "masked"])
@pytest.mark.parametrize("last", ["dispatch", "combine_with_dispatch_weights", "combine_with_weights"])
def test_grad_of_vmap_over_the_expert_axis_names_the_fix(layout, last):
    """Under jax.grad(jax.vmap(..., axis_name="ep")) JAX 0.11 leaves the axis unbound in a custom VJP's backward
    pass: the NameError names the op whose backward pass runs first and the order that works."""
    n = 4

    def body(t, i, w):
        if last == "dispatch":
            return moe.dispatch(t, i, num_experts=8, axis_name="ep", capacity=AMPLE, layout=layout)[0].sum()
        weights_in = "dispatch" if last == "combine_with_dispatch_weights" else "combine"
        return dispatch_and_combine(t, i, w, weights_in=weights_in, num_experts=8, axis_name="ep",
                                    capacity=AMPLE, layout=layout)[3].sum()

    tokens = random_array((n, TOKENS, HIDDEN), jnp.float32)
    ids, weights = random_ids(n, 8, seed=0), random_array((n, TOKENS, TOP_K), jnp.float32, seed=1)
    op = "dispatch" if last == "dispatch" else "combine"
    with pytest.raises(NameError, match=rf"jax_ncclx.moe.{op}: axis 'ep' is unbound in the backward pass; .* "
                                        r"write jax.vmap\(jax.grad\(...\), axis_name='ep'\) instead"):
        jax.grad(lambda t: jax.vmap(body, axis_name="ep")(t, ids, weights).sum())(tokens)


@pytest.mark.parametrize("weights_in", WEIGHTS_IN)
@pytest.mark.parametrize("axis", ["b", ("a", "b"), ("b", "a")], ids=lambda a: "+".join(a))
def test_2d_mesh_with_replicated_routing(mesh, axis, weights_in):
    """Experts over axis "b" of an ("a", "b") mesh, or over both axes taken as one (in either order: the experts
    scale rows by their global index, so a row at the wrong member shows); the routing and the weights are
    replicated (invariant), so their gradient sums over the whole mesh."""
    num_members = mesh.size
    num_experts = 2 * math.prod(mesh.shape[name] for name in axis)
    tokens = random_array((num_members * TOKENS, HIDDEN), jnp.float32)
    ids = random_ids(1, num_experts, seed=8)[0]
    weights = random_array((TOKENS, TOP_K), jnp.float32, seed=9)
    cotangent = random_array((num_members * TOKENS, HIDDEN), jnp.float32, seed=10)

    def body(t, i, w):
        return dispatch_and_combine(t, i, w, weights_in=weights_in, expert=scaled_by_expert(axis),
                                    num_experts=num_experts, axis_name=axis, capacity=AMPLE)[3]

    layer = jax.shard_map(body, mesh=mesh, in_specs=(P(("a", "b")), P(), P()), out_specs=P(("a", "b")))
    chosen = jnp.asarray((ids >= 0) * (1 + ids), jnp.float32)  # each choice, scaled by its expert

    def dense(t, w):
        per_member = t.reshape(num_members, TOKENS, 1, HIDDEN) * (w * chosen)[None, :, :, None]
        return per_member.sum(axis=2).reshape(-1, HIDDEN)

    sharded = lambda t, w: layer(t, jnp.asarray(ids), w)  # noqa: E731
    gradient = lambda f: jax.grad(lambda t, w: (f(t, w) * cotangent).sum(), argnums=(0, 1))  # noqa: E731
    np.testing.assert_allclose(jax.jit(sharded)(tokens, weights), dense(tokens, weights), rtol=1e-6, atol=1e-6)
    for grad, ref in zip(jax.jit(gradient(sharded))(tokens, weights), gradient(dense)(tokens, weights)):
        np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights_in", WEIGHTS_IN)
def test_bfloat16_tokens(backend, weights_in):
    n = len(backend)
    num_experts = 2 * n
    tokens = random_array((n, TOKENS, HIDDEN), jnp.bfloat16)
    ids = random_ids(n, num_experts, seed=6)
    weights = random_array((n, TOKENS, TOP_K), jnp.float32, seed=7)
    rows, _, _, out = run_dispatch_combine(line_mesh(backend), tokens, ids, weights, num_experts, AMPLE, weights_in)
    expected, delivered = reference_dispatch(tokens, ids, num_experts, AMPLE)
    assert rows.dtype == out.dtype == jnp.bfloat16
    for member, (ref_rows, _, _) in enumerate(expected):
        np.testing.assert_array_equal(rows[member], ref_rows)
    ref_out = (tokens.astype(np.float32)[:, :, None, :] * (weights * delivered)[..., None]).sum(axis=2)
    assert_same(out, ref_out.astype(jnp.bfloat16), jnp.bfloat16, reduced=True)


def _dispatch(t, i, **kw):
    return moe.dispatch(t, i, **{"num_experts": 8, "axis_name": "x", "capacity": 2, **kw})


def _combine(t, i, *, out=None, weights=None, handle=None):
    rows, _, h = _dispatch(t, i)
    return moe.combine(rows if out is None else out(rows), h if handle is None else handle,
                       i.astype(jnp.float32) if weights is None else weights(i))


@pytest.mark.parametrize("call, error, message", [
    (lambda t, i: _dispatch(t, i, num_experts=6), ValueError, r"num_experts \(6\) must be a multiple of .* \(4\)"),
    (lambda t, i: _dispatch(t, i, num_experts=8.0), TypeError, "num_experts must be a static Python int"),
    (lambda t, i: _dispatch(t, i, capacity=t.sum().astype(int)), TypeError, "capacity must be a static Python int"),
    (lambda t, i: _dispatch(t, i, capacity=0), ValueError, "capacity must be >= 1"),
    (lambda t, i: _dispatch(t, i, capacity=2**31), ValueError, "capacity must be <= 2147483647"),
    (lambda t, i: _dispatch(t, i, axis_name="y"), NameError, "unbound axis name 'y'"),
    (lambda t, i: _dispatch(t[0], i), ValueError, r"tokens must be 2-D, got shape \(4,\)"),
    (lambda t, i: _dispatch(t.astype(jnp.int32), i), TypeError, "tokens must have a float dtype"),
    (lambda t, i: _dispatch(t, i.astype(jnp.float32)), TypeError, "expert_ids must have an integer dtype"),
    (lambda t, i: _dispatch(t, i[:1]), ValueError, r"expert_ids must be \[T, k\] with T = 2"),
    (lambda t, i: _dispatch(t[:0], i[:0]), ValueError, r"tokens must have at least one row \(T >= 1\), got shape"),
    (lambda t, i: _dispatch(t, i, num_experts=2052), ValueError, r"num_experts \(2052\) must be at most 2048"),
    (lambda t, i: _dispatch(t, i, wire_dtype=jnp.bfloat16), ValueError,
     "wire_dtype must be None, float8_e4m3fn or float8_e5m2, got bfloat16"),
    (lambda t, i: _dispatch(t, i, wire_dtype="fp8"), ValueError,
     "moe.dispatch: wire_dtype must be None, float8_e4m3fn or float8_e5m2, got 'fp8'"),
    (lambda t, i: _combine(t, i, out=lambda r: r[:3]), ValueError, r"expert_out must be \[N \* capacity, H'\]"),
    (lambda t, i: _combine(t, i, weights=lambda i: i.astype(jnp.float32)[:, :1]), ValueError,
     r"weights must be \[T, k\] = \[2, 2\]"),
    (lambda t, i: _combine(t, i, weights=lambda i: i), TypeError, "weights must have a float dtype"),
    (lambda t, i: _combine(t, i, handle=(1, 2)), TypeError, "handle must be the DispatchHandle"),
    (lambda t, i: moe.combine(_dispatch(t, i)[0], _dispatch(t, i)[2]), ValueError,
     r"no weights: pass weights \[T, k\] here, or pass them to dispatch"),
    (lambda t, i: moe.combine(*_dispatch(t, i, weights=i.astype(jnp.float32))[::2], i.astype(jnp.float32)),
     ValueError, "weights were given to dispatch too; give them to one of the two"),
    (lambda t, i: _dispatch(t, i, weights=i.astype(jnp.float32)[:, :1]), ValueError,
     r"weights must be \[T, k\] = \[2, 2\] like expert_ids"),
    (lambda t, i: _dispatch(t, i, weights=i), TypeError, "weights must have a float dtype"),
])
def test_misuse(call, error, message):
    mesh = line_mesh(jax.devices("cpu")[:4])
    f = jax.shard_map(call, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"))
    with pytest.raises(error, match=message):
        jax.eval_shape(f, jnp.ones((8, 4)), jnp.ones((8, 2), jnp.int32))


def test_outside_shard_map():
    with pytest.raises(NameError, match="call it inside jax.shard_map"):
        moe.dispatch(jnp.ones((2, 4)), jnp.zeros((2, 1), jnp.int32), num_experts=2, axis_name="x", capacity=1)


def fp8_tokens(n, hidden):
    """[n, T, H] float32 tokens whose first 128-element block is 10^4 times smaller than the rest: one scale
    per row would flush it to zero, one per block keeps it."""
    tokens = random_array((n, TOKENS, hidden), jnp.float32)
    return tokens * np.where(np.arange(hidden) < 128, 1e-4, 1.0).astype(np.float32)


@pytest.mark.parametrize("wire_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=lambda d: jnp.dtype(d).name)
def test_8bit_wire(backend, wire_dtype):
    """Rows travel as scaled 8-bit floats (the exchange moves H bytes and a float32 scale per 128 values) and
    come back within the format's rounding of the reference, block by block, not exactly; the routing (group
    sizes, drops) is the same as in full precision."""
    n = len(backend)
    num_experts, hidden = 2 * n, 256
    tokens = fp8_tokens(n, hidden)
    ids = random_ids(n, num_experts, seed=8)

    def body(t, i):
        rows, sizes, handle = moe.dispatch(t[0], i[0], num_experts=num_experts, axis_name="x", capacity=TIGHT,
                                           wire_dtype=wire_dtype)
        return rows[None], sizes[None], handle.dropped[None]

    mapped = jax.shard_map(body, mesh=line_mesh(backend), in_specs=(P("x"),) * 2, out_specs=P("x"))
    # At H = 256 (not a multiple of 512) the 8-bit wire takes the exchange chain on every backend: its one
    # exchange moves uint8 rows.
    hlo = jax.jit(mapped).lower(tokens, ids).as_text().splitlines()
    exchanges = [line for line in hlo if "ncclx_all_to_allv_dynamic" in line and "custom_call" in line]
    assert len(exchanges) == 1 and f"x{hidden + 4 * hidden // 128}xui8>" in exchanges[0].split("->")[0]
    # Quantized in one pass by encode_rows, which takes the float32 tokens.
    encodes = [line for line in hlo if "ncclx_encode_rows" in line and "custom_call" in line]
    assert len(encodes) == 1 and f"x{hidden}xf32>" in encodes[0].split("->")[0]
    # Dequantized as the received rows are expanded: the row copy takes the uint8 rows, gives float32 ones.
    expansions = [line for line in hlo if "ncclx_expand_rows" in line and "custom_call" in line]
    assert len(expansions) == 1 and "xui8>, tensor" in expansions[0].split("->")[0]
    assert f"x{hidden}xf32>" in expansions[0].split("->")[1]
    rows, sizes, dropped = (np.asarray(o) for o in jax.jit(mapped)(tokens, ids))
    assert rows.dtype == np.float32
    rounding = 2.0 ** -(jnp.finfo(wire_dtype).nmant + 1)  # half a unit in the last place, relative
    expected, _ = reference_dispatch(tokens, ids, num_experts, TIGHT)
    for member, (ref_rows, ref_sizes, ref_dropped) in enumerate(expected):
        np.testing.assert_array_equal(sizes[member], ref_sizes)
        np.testing.assert_array_equal(dropped[member], ref_dropped)
        for block in (slice(0, 128), slice(128, hidden)):
            got, ref = rows[member][:, block], ref_rows[:, block]
            np.testing.assert_allclose(got, ref, rtol=rounding, atol=np.abs(ref).max() * 2.0 ** -14)
            assert np.count_nonzero(got) == np.count_nonzero(ref)  # the small block is not flushed to zero
        assert (rows[member] != ref_rows).any()  # rounded on the way


def test_8bit_wire_quantizes_in_xla_where_encode_rows_cannot(backend, caplog):
    """At H = 192 (not a multiple of 128: one scale per row) XLA quantizes the tokens, and the log says why;
    the rows still come back within the format's rounding."""
    n = len(backend)
    num_experts, hidden = 2 * n, 192
    tokens, ids = random_array((n, TOKENS, hidden), jnp.float32), random_ids(n, num_experts, seed=9)

    def body(t, i):
        return moe.dispatch(t[0], i[0], num_experts=num_experts, axis_name="x", capacity=TIGHT,
                            wire_dtype=jnp.float8_e4m3fn)[0][None]

    mapped = jax.jit(jax.shard_map(body, mesh=line_mesh(backend), in_specs=(P("x"),) * 2, out_specs=P("x")))
    with caplog.at_level(logging.DEBUG, logger="jax_ncclx"):
        hlo = mapped.lower(tokens, ids).as_text()
    assert "ncclx_encode_rows" not in hlo
    assert any("quantizes its tokens in XLA" in r.getMessage() and "H = 192" in r.getMessage()
               for r in caplog.records)
    rows = np.asarray(mapped(tokens, ids))
    expected, _ = reference_dispatch(tokens, ids, num_experts, TIGHT)
    for member, (ref_rows, _, _) in enumerate(expected):
        np.testing.assert_allclose(rows[member], ref_rows, rtol=2.0 ** -4, atol=np.abs(ref_rows).max() * 2.0 ** -9)


def test_8bit_wire_gradient_is_straight_through(backend):
    """The backward pass of a dispatch with an 8-bit wire is that of the full-precision one: each token's
    gradient is the sum of the probe's rows where the reference dispatch puts the token."""
    n = len(backend)
    num_experts, hidden = 2 * n, 256
    tokens = fp8_tokens(n, hidden)
    ids = random_ids(n, num_experts, seed=9)
    probe = random_array((n, n * AMPLE, hidden), jnp.float32, seed=10)

    def grads(wire_dtype):
        def loss(t, i, c):
            rows, _, _ = moe.dispatch(t, i, num_experts=num_experts, axis_name="x", capacity=AMPLE,
                                      wire_dtype=wire_dtype)
            return jax.lax.psum((rows * c).sum(), "x")

        step = jax.shard_map(jax.grad(loss), mesh=line_mesh(backend), in_specs=(P("x"),) * 3, out_specs=P("x"))
        return np.asarray(jax.jit(step)(tokens.reshape(n * TOKENS, hidden), ids.reshape(n * TOKENS, TOP_K),
                                        probe.reshape(-1, hidden)))

    # The reference's rows hold token numbers + 1 (0: empty), so each row's probe goes back to its token.
    numbers = (np.arange(n * TOKENS, dtype=np.float32) + 1).reshape(n, TOKENS, 1)
    expected = np.zeros((n * TOKENS, hidden), np.float32)
    for member, (rows, _, _) in enumerate(reference_dispatch(numbers, ids, num_experts, AMPLE)[0]):
        for row, number in enumerate(rows[:, 0].astype(int)):
            if number:
                expected[number - 1] += probe[member, row]
    assert expected.any()
    for wire_dtype in (jnp.float8_e4m3fn, None):
        np.testing.assert_allclose(grads(wire_dtype), expected, rtol=1e-6, atol=1e-6)


def test_weights_in_dispatch_with_8bit_wire(backend):
    """Weights that travel with 8-bit rows change neither the rows nor the combined result (up to the order
    of the float32 sums), which is the reference's sum_j w * token over the delivered pairs within the
    format's rounding of each term."""
    n = len(backend)
    num_experts, hidden = 2 * n, 256
    tokens = fp8_tokens(n, hidden)
    ids = random_ids(n, num_experts, seed=13)
    weights = random_array((n, TOKENS, TOP_K), jnp.float32, seed=14)

    def body(t, i, w):
        kwargs = dict(num_experts=num_experts, axis_name="x", capacity=TIGHT, wire_dtype=jnp.float8_e4m3fn)
        rows, _, handle = moe.dispatch(t[0], i[0], weights=w[0], **kwargs)
        plain_rows, _, plain_handle = moe.dispatch(t[0], i[0], **kwargs)
        return (rows[None], plain_rows[None], moe.combine(rows, handle)[None],
                moe.combine(plain_rows, plain_handle, w[0])[None])

    f = jax.jit(jax.shard_map(body, mesh=line_mesh(backend), in_specs=(P("x"),) * 3, out_specs=P("x")))
    rows, plain_rows, out, plain_out = (np.asarray(o) for o in f(tokens, ids, weights))
    np.testing.assert_array_equal(rows, plain_rows)
    np.testing.assert_allclose(out, plain_out, rtol=1e-5, atol=1e-6)
    delivered = reference_dispatch(tokens, ids, num_experts, TIGHT)[1]
    terms = tokens[:, :, None, :] * (weights * delivered)[..., None]  # [n, T, k, H]
    rounding = 2.0 ** -(jnp.finfo(jnp.float8_e4m3fn).nmant + 1)
    error = np.abs(out.reshape(terms.shape[0], TOKENS, hidden) - terms.sum(axis=2))
    assert (error <= rounding * np.abs(terms).sum(axis=2) + 1e-6).all(), error.max()
