"""jax_ncclx.moe's masked layout (``dispatch(..., layout="masked")``) against the NumPy reference written from
its spec (tests/reference.py): every result and handle array for adversarial routings, the round trip both
ways of combining, gradients against jax.grad of a dense layer, vmap and argument errors; on CPU (8 virtual
devices), on one GPU (the NVLink kernels against the exchange chain, bit for bit) and, where present, on
several GPUs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import reference
from conftest import gpu_devices, gpu_skip_reason
from helpers import assert_wire_rows, drop_warnings, random_array, wire_takes_lines, wire_tokens
from jax_ncclx import moe
from jax_ncclx._src.ops import moe_masked

HIGHEST = jax.lax.Precision.HIGHEST
WEIGHTS_IN = ["combine", "dispatch"]
PATTERNS = ["random", "one_expert", "no_expert", "at_capacity", "tight", "one_token", "empty_member"]


def line_mesh(devices):
    return jax.sharding.Mesh(np.asarray(devices), ("x",))


def routing(pattern, n, *, tokens=8, top_k=3, num_experts=None, seed=0):
    """(expert ids [n, T, k], num_experts, capacity) of one named pattern: skewed ids with -1 and ids >= E;
    every pair on one expert; none; a capacity exactly the most pairs any (member, expert) gets; one that
    drops; one token; members 1.. choosing no expert."""
    num_experts = num_experts or 2 * n
    rng = np.random.default_rng(seed + len(pattern))
    shape = (n, tokens, top_k)
    ids = np.minimum(rng.integers(0, num_experts, shape), rng.integers(0, num_experts, shape))
    ids = np.where(rng.random(shape) < 0.1, -1, np.where(rng.random(shape) < 0.05, num_experts + 2, ids))
    if pattern == "one_expert":
        ids = np.full(shape, num_experts - 1)
    elif pattern == "no_expert":
        ids = np.full(shape, -1)
    elif pattern == "one_token":
        ids = ids[:, :1]
    elif pattern == "empty_member":
        ids[1:] = -1
    ids = ids.astype(np.int32)
    most = max([int(np.sum(ids[s] == e)) for s in range(n) for e in range(num_experts)] + [1])
    capacity = {"at_capacity": most, "tight": 1}.get(pattern, ids.shape[1] * top_k)
    return ids, num_experts, capacity


def run_masked(devices, tokens, ids, weights, *, num_experts, capacity, weights_in, wire_dtype=None,
               expert=lambda rows: rows):
    """Per member: every dispatch result and handle array (named as moe_masked.Masked), and the round trip's
    output, stacked over members."""
    mesh = line_mesh(devices)

    def body(t, i, w):
        rows, sizes, handle = moe.dispatch(t[0], i[0], num_experts=num_experts, axis_name="x", capacity=capacity,
                                           weights=w[0] if weights_in == "dispatch" else None, layout="masked",
                                           wire_dtype=wire_dtype)
        out = moe.combine(expert(rows), handle, None if weights_in == "dispatch" else w[0])
        empty = dict(recv_weights=(rows.shape[0], 0), choice_weights=(handle.choice_rows.shape[0], 0))
        arrays = dict(expert_rows=rows, group_sizes=sizes)
        for name in moe_masked.Masked._fields[2:]:  # a weights field is None without weights: the op's empty one
            value = getattr(handle, name)
            arrays[name] = jnp.zeros(empty[name]) if value is None else value
        return {k: v[None] for k, v in arrays.items()}, out[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x")))
    arrays, out = f(tokens, ids, weights)
    return {k: np.asarray(v) for k, v in arrays.items()}, np.asarray(out)


@pytest.mark.parametrize("weights_in", WEIGHTS_IN)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_dispatch_and_round_trip_match_the_reference(any_backend, pattern, weights_in):
    """Every result and handle array equals the reference's, and the round trip (experts scale rows by their
    global index, so a row at the wrong expert shows) is the reference combine's."""
    n = len(any_backend)
    ids, num_experts, capacity = routing(pattern, n)
    tokens = random_array((n, ids.shape[1], 16), jnp.float32)
    weights = random_array(ids.shape, jnp.float32, seed=1)
    local = num_experts // n

    def expert(rows):
        first = jax.lax.axis_index("x") * local
        return rows * (1 + first + jnp.arange(local, dtype=rows.dtype))[:, None, None]

    got, out = run_masked(any_backend, tokens, ids, weights, num_experts=num_experts, capacity=capacity,
                          weights_in=weights_in, expert=expert)
    expected = reference.moe_masked_dispatch(np.asarray(tokens), ids, num_experts, capacity,
                                             weights=np.asarray(weights) if weights_in == "dispatch" else None)
    for name in moe_masked.Masked._fields:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    assert (expected["dropped"].sum() > 0) == (pattern == "tight"), expected["dropped"]
    scale = (1 + np.arange(num_experts, dtype=np.float32)).reshape(n, local)[:, :, None, None]
    ref_out = reference.moe_masked_combine(expected["expert_rows"] * scale, expected, ids.shape[1],
                                           None if weights_in == "dispatch" else np.asarray(weights))
    np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-6)


def dense_layer(tokens, ids, gates, expert_weights, kept):
    """tokens [M, H], ids / gates / kept [M, k], expert_weights [E, H, H'] -> [M, H']."""
    y = jnp.tanh(jnp.einsum("mh,mkhd->mkd", tokens, expert_weights[ids], precision=HIGHEST))
    return (y * (gates * kept)[..., None]).sum(axis=1)


@pytest.mark.parametrize("weights_in", WEIGHTS_IN)
@pytest.mark.parametrize("pattern", ["random", "tight"])
def test_grouped_matmul_layer_and_grads(any_backend, pattern, weights_in):
    """A layer of masked per-expert matmuls (einsum over the expert blocks, H' != H): its output and gradients
    in tokens, router weights and expert weights match jax.grad of the dense layer with dropped pairs masked
    out."""
    n = len(any_backend)
    ids, num_experts, capacity = routing(pattern, n, seed=3)
    ids = np.where((ids >= 0) & (ids < num_experts), ids, 0)  # the dense layer indexes experts by id
    num_tokens, hidden, out_features = ids.shape[1], 4, 3
    tokens = random_array((n * num_tokens, hidden), jnp.float32)
    gates = random_array((n * num_tokens, ids.shape[2]), jnp.float32, seed=1)
    expert_weights = random_array((num_experts, hidden, out_features), jnp.float32, seed=2) / 2
    cotangent = random_array((n * num_tokens, out_features), jnp.float32, seed=4)
    flat_ids = jnp.asarray(ids.reshape(n * num_tokens, -1))
    mesh = line_mesh(any_backend)

    def body(t, i, g, w):
        local = w.shape[0] // n
        mine = jax.lax.dynamic_slice_in_dim(w, jax.lax.axis_index("x") * local, local)
        rows, _, handle = moe.dispatch(t, i, num_experts=num_experts, axis_name="x", capacity=capacity,
                                       weights=g if weights_in == "dispatch" else None, layout="masked")
        y = jnp.tanh(jnp.einsum("lrh,lhd->lrd", rows, mine, precision=HIGHEST))
        return moe.combine(y, handle, None if weights_in == "dispatch" else g)

    layer = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x"), P("x"), P()), out_specs=P("x"))
    loss = lambda t, g, w: (layer(t, flat_ids, g, w) * cotangent).sum()  # noqa: E731
    out = jax.jit(layer)(tokens, flat_ids, gates, expert_weights)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(tokens, gates, expert_weights)

    expected = reference.moe_masked_dispatch(np.asarray(tokens).reshape(n, num_tokens, hidden), ids, num_experts,
                                             capacity)
    kept = jnp.asarray((expected["pair_slot"] < num_experts * capacity).reshape(n * num_tokens, -1), jnp.float32)
    dense_loss = lambda t, g, w: (dense_layer(t, flat_ids, g, w, kept) * cotangent).sum()  # noqa: E731
    np.testing.assert_allclose(out, dense_layer(tokens, flat_ids, gates, expert_weights, kept), rtol=1e-5,
                               atol=1e-6)
    for grad, ref in zip(grads, jax.grad(dense_loss, argnums=(0, 1, 2))(tokens, gates, expert_weights)):
        np.testing.assert_allclose(grad, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("weights_in", WEIGHTS_IN)
def test_vmap_over_a_batch_axis(any_backend, weights_in):
    """Two routings per member under vmap give each routing's reference round trip."""
    n, batch = len(any_backend), 2
    ids = np.stack([routing("random", n, seed=s)[0] for s in range(batch)], axis=1)
    num_experts, capacity = 2 * n, 2
    tokens = random_array((n, batch, ids.shape[2], 8), jnp.float32)
    weights = random_array(ids.shape, jnp.float32, seed=5)
    mesh = line_mesh(any_backend)

    def round_trip(t, i, w):
        rows, _, handle = moe.dispatch(t, i, num_experts=num_experts, axis_name="x", capacity=capacity,
                                       weights=w if weights_in == "dispatch" else None, layout="masked")
        return moe.combine(rows, handle, None if weights_in == "dispatch" else w)

    f = jax.jit(jax.shard_map(lambda t, i, w: jax.vmap(round_trip)(t[0], i[0], w[0])[None], mesh=mesh,
                              in_specs=(P("x"),) * 3, out_specs=P("x")))
    out = np.asarray(f(tokens, ids, weights))
    for b in range(batch):
        expected = reference.moe_masked_dispatch(np.asarray(tokens[:, b]), ids[:, b], num_experts, capacity,
                                                 weights=np.asarray(weights[:, b]))
        ref = reference.moe_masked_combine(expected["expert_rows"], expected, ids.shape[2],
                                           None if weights_in == "dispatch" else np.asarray(weights[:, b]))
        np.testing.assert_allclose(out[:, b], ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("wire_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=lambda d: jnp.dtype(d).name)
def test_8bit_wire(any_backend, wire_dtype):
    """On an 8-bit wire the expert rows are the reference's rows quantized and dequantized with the packed
    layout's arithmetic; the handle arrays are unchanged."""
    n = len(any_backend)
    ids, num_experts, capacity = routing("tight", n)
    tokens = random_array((n, ids.shape[1], 256), jnp.bfloat16)
    weights = random_array(ids.shape, jnp.float32, seed=1)
    got, _ = run_masked(any_backend, tokens, ids, weights, num_experts=num_experts, capacity=capacity,
                        weights_in="dispatch", wire_dtype=wire_dtype)
    expected = reference.moe_masked_dispatch(np.asarray(tokens), ids, num_experts, capacity,
                                             weights=np.asarray(weights))
    from jax_ncclx._src.ops import moe_dispatch

    rows = expected["expert_rows"].reshape(-1, 256)
    wire = moe_dispatch._decode(moe_dispatch._encode(jnp.asarray(rows), wire_dtype), 256, wire_dtype, jnp.bfloat16)
    np.testing.assert_array_equal(got["expert_rows"].reshape(-1, 256).view(np.uint16),
                                  np.asarray(wire).view(np.uint16))
    for name in moe_masked.Masked._fields[1:]:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("weighted", [False, True], ids=["", "weights"])
@pytest.mark.parametrize("pattern", PATTERNS[:-1])
def test_kernels_give_the_chains_results(monkeypatch, pattern, weighted):
    """On one GPU the NVLink kernels (dispatch, and combine: moe.combine's kernel with the weights at dispatch,
    the masked one with them at combine) give the exchange chain's results bit for bit: every dispatch result
    and the combined tokens, for adversarial routings."""
    reason = gpu_skip_reason(minimum=1)
    if reason:
        pytest.skip(reason)
    mesh = line_mesh(gpu_devices()[:1])
    ids, num_experts, capacity = routing(pattern, 1, tokens=16, top_k=4, num_experts=8)
    tokens = random_array(ids.shape[:2] + (64,), jnp.bfloat16, seed=2)
    weights = random_array(ids.shape, jnp.float32, seed=3)

    def run(transport):
        monkeypatch.setenv("JAX_NCCLX_TRANSPORT", transport)

        def body(t, i, w):
            rows, sizes, handle = moe.dispatch(t[0], i[0], num_experts=num_experts, axis_name="x",
                                               capacity=capacity, weights=w[0] if weighted else None,
                                               layout="masked")
            out = moe.combine(rows * 3, handle, None if weighted else w[0])
            arrays = [rows, sizes] + [getattr(handle, f) for f in moe_masked._ARRAY_FIELDS
                                      if getattr(handle, f) is not None]
            return [a[None] for a in arrays] + [out[None]]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x")))
        return f.lower(tokens, ids, weights).as_text(), [np.asarray(o) for o in f(tokens, ids, weights)]

    fused_text, fused = run("auto")
    chain_text, chain = run("nccl")
    combine_target = "ncclx_moe_combine_nvlink" if weighted else "ncclx_moe_masked_combine_nvlink"
    for target in ("ncclx_moe_masked_dispatch_nvlink", combine_target):
        assert target in fused_text and target not in chain_text
    for index, (got, expected) in enumerate(zip(fused, chain)):
        assert got.shape == expected.shape and got.dtype == expected.dtype, index
        as_bits = (lambda a: a.view(np.uint16)) if got.dtype == jnp.bfloat16 else (lambda a: a)
        np.testing.assert_array_equal(as_bits(got), as_bits(expected), err_msg=str(index))


@pytest.mark.parametrize("call, error, message", [
    (dict(layout="ragged"), ValueError, "layout must be one of"),
    (dict(capacity=2**30, num_experts=16), ValueError, "num_experts \\* capacity"),
])
def test_misuse(call, error, message):
    mesh = line_mesh(jax.devices("cpu")[:2])
    kwargs = dict(num_experts=4, axis_name="x", capacity=2, layout="masked") | call

    def body(t, i):
        return moe.dispatch(t, i, **kwargs)[0]

    with pytest.raises(error, match=message):
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 2, out_specs=P("x")))(
            jnp.zeros((8, 4)), jnp.zeros((8, 2), jnp.int32))


@pytest.mark.parametrize("layout", ["packed", "masked"])
def test_warn_drops_names_the_member(monkeypatch, caplog, layout):
    """JAX_NCCLX_WARN_DROPS=1 logs one warning per member that drops, with its count per destination; none
    when nothing drops or when the variable is unset."""
    mesh = line_mesh(jax.devices("cpu")[:2])
    ids = jnp.zeros((2, 4, 2), jnp.int32).at[0, :, 1].set(1)  # member 0: 4 pairs to each of experts 0 and 1

    def run(drops):
        def body(t, i):
            return moe.dispatch(t[0], i[0], num_experts=2, axis_name="x", capacity=1 if drops else 8,
                                layout=layout)[0][None]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 2, out_specs=P("x")))
        jax.block_until_ready(f(jnp.ones((2, 4, 8)), ids))
        jax.effects_barrier()

    messages = drop_warnings(monkeypatch, caplog, run)
    assert messages == [
        f"jax_ncclx.moe.dispatch: member 0 dropped 6 (token, choice) pairs past capacity 1 ({layout} layout); per "
        "destination member: [3, 3]",
        f"jax_ncclx.moe.dispatch: member 1 dropped 7 (token, choice) pairs past capacity 1 ({layout} layout); per "
        "destination member: [7, 0]"]


def test_combine_checks_the_masked_shape():
    mesh = line_mesh(jax.devices("cpu")[:2])

    def body(t, i):
        rows, _, handle = moe.dispatch(t, i, num_experts=4, axis_name="x", capacity=2, layout="masked")
        return moe.combine(rows.reshape(-1, rows.shape[2]), handle, jnp.ones(i.shape))

    with pytest.raises(ValueError, match=r"with a MaskedHandle expert_out must be \[E_local, N \* capacity, H'\] = "
                                         r"\[2, 4, H'\] like dispatch's expert_rows, got shape \(8, 4\)"):
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 2, out_specs=P("x")))(
            jnp.zeros((8, 4)), jnp.zeros((8, 2), jnp.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_loopback_kernels_match_the_reference(ranks, pattern):
    """The NVLink kernels with 2, 4 and 8 logical ranks on one GPU (the test-only loopback module), two calls
    in a row: every dispatch result equals the reference's, and combine (weights at either side) is the
    reference combine's."""
    import nvlink_loopback

    ids, num_experts, capacity = routing(pattern, ranks, tokens=8, top_k=3, seed=ranks)
    rng = np.random.default_rng(ranks)
    tokens = rng.standard_normal((2, ranks, ids.shape[1], 64)).astype(np.float32)
    weights = rng.random((2, ranks) + ids.shape[1:]).astype(np.float32)
    ids2 = np.stack([ids, ids[::-1]])
    got, _ = nvlink_loopback.moe_masked_dispatch(tokens, ids2, weights, num_experts=num_experts, capacity=capacity)
    for call in range(2):
        expected = reference.moe_masked_dispatch(tokens[call], ids2[call], num_experts, capacity, weights=weights[call])
        for name in moe_masked.Masked._fields:
            np.testing.assert_array_equal(got[name][call], expected[name], err_msg=f"{name}, call {call}")
    # Weights at dispatch: moe.combine's kernel over the flattened rows and the token rows dispatch described.
    out, _ = nvlink_loopback.moe_combine(got["expert_rows"].reshape(2, ranks, -1, 64), got["choice_rows"],
                                         got["choice_weights"], got["recv_tokens"], got["return_row"])
    by_token, _ = nvlink_loopback.moe_masked_combine(got["expert_rows"], got["row_pair"], got["pair_slot"], weights,
                                                     num_tokens=ids.shape[1])
    for call in range(2):
        expected = reference.moe_masked_dispatch(tokens[call], ids2[call], num_experts, capacity, weights=weights[call])
        np.testing.assert_allclose(out[call], reference.moe_masked_combine(expected["expert_rows"], expected,
                                                                           ids.shape[1]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(by_token[call], reference.moe_masked_combine(
            expected["expert_rows"], expected, ids.shape[1], weights[call]), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, lines", [(8, True), (128, False)], ids=["lines", "flags"])
def test_loopback_decode_rows(tokens, lines):
    """DeepSeek-sized rows (7168 bfloat16) on 8 ranks, top-8: at 8 tokens (0.9 MiB of slot rows) the rows travel
    as LL128 lines with flagged counts and map entries, at 128 (16 MB) as rows and flags; two calls, every result the
    reference's."""
    import nvlink_loopback

    ranks, calls = 8, 2
    ids, num_experts, capacity = routing("at_capacity", ranks, tokens=tokens, top_k=8, num_experts=64, seed=tokens)
    x = random_array((calls, ranks, tokens, 7168), jnp.bfloat16, seed=tokens)
    ids2 = np.stack([ids, ids[::-1]])
    got, states = nvlink_loopback.moe_masked_dispatch(x, ids2, None, num_experts=num_experts, capacity=capacity)
    assert states[0]["lines"] == lines
    for call in range(calls):
        expected = reference.moe_masked_dispatch(x[call], ids2[call], num_experts, capacity)
        for name in moe_masked.Masked._fields:
            if name not in ("recv_weights", "choice_weights"):
                np.testing.assert_array_equal(got[name][call], expected[name], err_msg=f"{name}, call {call}")


@pytest.mark.gpu
@pytest.mark.parametrize("wire", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("hidden", [7168, 1536, 512], ids=["deepseek", "whole-steps", "one-step"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16], ids=["bf16", "f32", "f16"])
@pytest.mark.parametrize("ranks, tokens", [(1, 8), (2, 8), (8, 8), (2, 64)],
                         ids=["1-rank", "2-ranks", "8-ranks", "2-ranks-64"])
def test_loopback_8bit_wire(ranks, tokens, dtype, hidden, wire):
    """On an 8-bit wire at decode sizes the slot rows travel as LL128 lines, three quantized blocks and their
    scales a warp step (a partial last step at H = 7168 and 512, whole steps at 1536); 64 tokens on 2 ranks at
    H = 7168 (over 1 MiB of lines) take rows and flags. Over two calls the expert rows are the reference's rows
    through the wire and every other result is the reference's."""
    import nvlink_loopback

    ids, num_experts, capacity = routing("random", ranks, tokens=tokens, top_k=4, seed=ranks)
    x = wire_tokens((2, ranks, ids.shape[1], hidden), dtype, seed=ranks)
    weights = np.random.default_rng(ranks).random((2, ranks) + ids.shape[1:]).astype(np.float32)
    ids2 = np.stack([ids, ids[::-1]])
    got, states = nvlink_loopback.moe_masked_dispatch(x, ids2, weights, num_experts=num_experts, capacity=capacity,
                                                      wire=wire)
    assert states[0]["lines"] == wire_takes_lines(ranks * tokens, hidden)
    for state in states:
        assert state["fault"] == "healthy" and state["calls_finished"] == 2, state
    for call in range(2):
        expected = reference.moe_masked_dispatch(x[call], ids2[call], num_experts, capacity, weights=weights[call])
        assert_wire_rows(got["expert_rows"][call], expected["expert_rows"], wire)
        for name in moe_masked.Masked._fields[1:]:
            np.testing.assert_array_equal(got[name][call], expected[name], err_msg=f"{name}, call {call}")


# Row widths (float32 elements) whose slot rows, 4 ranks of 8 tokens, travel as lines and as rows and flags,
# and as lines on the 8-bit wire.
PATH_HIDDEN = {"lines": 64, "flags": 8192, "lines-fp8": 512}  # flags: 1.1 MiB of slot rows as lines
PATH_WIRE = {"lines-fp8": "float8_e4m3fn"}


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", [dict(calls=6), dict(calls=4, graph=True), dict(calls=4, late=2, late_us=200)],
                         ids=["streams", "graph", "late-rank"])
@pytest.mark.parametrize("path", PATH_HIDDEN)
def test_loopback_many_calls(path, schedule):
    """New routings and rows every call on one set of slots, so both parity halves are reused: call after call,
    as replays of one recorded call, and with rank 2 late to every call (its peers write its next parity half
    while it reads the last). Every result is the reference's, weights included."""
    import nvlink_loopback

    ranks, tokens, hidden = 4, 8, PATH_HIDDEN[path]
    calls = schedule["calls"]
    options = {key: value for key, value in schedule.items() if key != "calls"}
    per_call = [routing(("random", "at_capacity", "one_expert")[c % 3], ranks, tokens=tokens, seed=c)
                for c in range(calls)]
    num_experts, capacity = per_call[0][1], 4  # the same every call; the skewed patterns drop pairs
    ids = np.stack([i for i, _, _ in per_call])
    x = random_array((calls, ranks, tokens, hidden), np.float32, seed=11)
    weights = np.random.default_rng(11).random(ids.shape).astype(np.float32)
    wire = PATH_WIRE.get(path)
    got, states = nvlink_loopback.moe_masked_dispatch(x, ids, weights, num_experts=num_experts, capacity=capacity,
                                                      wire=wire, **options)
    assert states[0]["lines"] == path.startswith("lines")
    for state in states:
        assert state["fault"] == "healthy" and state["calls_finished"] == calls, state
    for call in range(calls):
        expected = reference.moe_masked_dispatch(x[call], ids[call], num_experts, capacity, weights=weights[call])
        for name in moe_masked.Masked._fields:
            if name == "expert_rows" and wire is not None:
                assert_wire_rows(got[name][call], expected[name], wire)
            else:
                np.testing.assert_array_equal(got[name][call], expected[name], err_msg=f"{name}, call {call}")


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATH_HIDDEN)
def test_loopback_missing_rank_is_named(path):
    """A rank that never launches is named by every other, whether they poll its counts (lines, of plain or
    8-bit rows) or wait for its flags; they still finish their calls."""
    import nvlink_loopback

    ranks, calls, tokens = 4, 2, 8
    ids, num_experts, capacity = routing("random", ranks, tokens=tokens, top_k=3, seed=7)
    x = np.ones((calls, ranks, tokens, PATH_HIDDEN[path]), np.float32)
    _, states = nvlink_loopback.moe_masked_dispatch(x, np.stack([ids, ids]), None, num_experts=num_experts,
                                                     capacity=capacity, wire=PATH_WIRE.get(path), absent=1,
                                                     timeout_ms=200)
    assert states[0]["lines"] == path.startswith("lines")
    nvlink_loopback.assert_absent_rank_named(states, absent=1, calls=calls)


@pytest.mark.gpu
def test_loopback_phase_clocks():
    """A profiled call (time_loopback_collectives.py --moe-phases) computes the same results, and every block of
    both kernels reads its clock at each phase, in order."""
    import nvlink_loopback

    ids, num_experts, capacity = routing("random", 2, tokens=8, top_k=3, seed=5)
    rng = np.random.default_rng(5)
    tokens = rng.standard_normal((1, 2, ids.shape[1], 64)).astype(np.float32)
    weights = rng.random((1, 2) + ids.shape[1:]).astype(np.float32)
    got, ranks = nvlink_loopback.moe_masked_dispatch(tokens, ids[None], weights, num_experts=num_experts,
                                                     capacity=capacity, phases=True)
    expected = reference.moe_masked_dispatch(tokens[0], ids, num_experts, capacity, weights=weights[0])
    for name in moe_masked.Masked._fields:
        np.testing.assert_array_equal(got[name][0], expected[name], err_msg=name)
    clocks = got["phase_clocks"]
    assert clocks.shape == (2, ranks[0]["blocks"], 7) and (clocks > 0).all() and (np.diff(clocks, axis=-1) >= 0).all()
    combined, ranks = nvlink_loopback.moe_masked_combine(got["expert_rows"], got["row_pair"], got["pair_slot"],
                                                         weights, num_tokens=ids.shape[1], phases=True)
    np.testing.assert_allclose(combined["out"][0], reference.moe_masked_combine(
        expected["expert_rows"], expected, ids.shape[1], weights[0]), rtol=1e-5, atol=1e-5)
    clocks = combined["phase_clocks"]
    assert clocks.shape == (2, ranks[0]["blocks"], 4) and (clocks > 0).all() and (np.diff(clocks, axis=-1) >= 0).all()
