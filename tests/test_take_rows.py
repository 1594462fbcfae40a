"""take_rows, the row copies of moe.dispatch, against NumPy on CPU and one GPU: every copy unit the CUDA kernel
picks (16, 4 and 1 bytes), indices outside x, a width below x's, a suffix, a batch under vmap, and its
gradient; the same with index's inverse given (``sources``: the walk over x's rows); encode_rows, the 8-bit
wire's quantization, against XLA's ``_encode`` on the same backend."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ncclx._src.ops import moe_dispatch
from jax_ncclx._src.ops.take_rows import encode_rows
from jax_ncclx._src.ops.take_rows import take_rows


def expected_rows(x, index, width, suffix):
    taken = np.zeros((len(index), width), x.dtype)
    inside = (index >= 0) & (index < len(x))
    taken[inside] = x[index[inside], :width]
    return taken if suffix is None else np.concatenate([taken, suffix], axis=1)


def random_array(rng, shape, dtype):
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 250, size=shape).astype(dtype)
    return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype))


def put(device, *arrays):
    return [jax.device_put(a, device) for a in arrays]


# (name, dtype, x columns, width, suffix columns): 16-byte rows, 4-byte rows, and odd bytes.
CASES = [
    ("bf16_wide", jnp.bfloat16, 7184, 7168, 16),
    ("bf16_no_suffix", jnp.bfloat16, 256, 256, 0),
    ("f32_unit4", np.float32, 37, 35, 3),
    ("uint8_odd", np.uint8, 133, 130, 5),
    ("int32_zero_width", np.int32, 8, 0, 4),
]


@pytest.mark.parametrize("name, dtype, columns, width, suffix_columns", CASES, ids=[c[0] for c in CASES])
def test_matches_numpy(one_device, name, dtype, columns, width, suffix_columns):
    rng = np.random.default_rng(0)
    x = random_array(rng, (50, columns), dtype)
    index = rng.integers(-5, 60, size=300).astype(np.int32)  # about one in six outside [0, 50)
    index[:4] = [-1, 50, 2**31 - 1, -(2**31)]
    suffix = random_array(rng, (300, suffix_columns), dtype) if suffix_columns else None
    fn = jax.jit(functools.partial(take_rows, width=width))
    args = put(one_device, x, index) + ([] if suffix is None else put(one_device, suffix))
    actual = fn(*args[:2], suffix=args[2] if suffix is not None else None)
    np.testing.assert_array_equal(np.asarray(actual), expected_rows(x, index, width, suffix))


def inverse_of(index, num_rows, top_k, rng):
    """[num_rows, top_k] int32: row s lists the i with index[i] == s in a random order and slots, the rest filled
    with out-of-range entries (-1, len(index), or larger)."""
    sources = rng.choice(np.array([-1, len(index), 2**31 - 1], np.int32), size=(num_rows, top_k))
    for s in range(num_rows):
        takers = rng.permutation(np.flatnonzero(index == s))
        sources[s, rng.choice(top_k, size=len(takers), replace=False)] = takers
    return sources


@pytest.mark.parametrize("name, dtype, columns, width, suffix_columns", CASES, ids=[c[0] for c in CASES])
def test_sources_walk_matches_numpy(one_device, name, dtype, columns, width, suffix_columns):
    """Given index's inverse, the same rows: zeros where the index is outside x, each taken row wherever the
    inverse lists it (a row taken by none, by one, and by up to 40 > 32 outputs: more than a warp's lanes)."""
    rng = np.random.default_rng(3)
    x = random_array(rng, (50, columns), dtype)
    index = rng.integers(-5, 60, size=300).astype(np.int32)
    index[:40] = 7  # one row taken 40 times
    index[index == 11] = 12  # and one taken by none
    top_k = int(np.bincount(index[(index >= 0) & (index < 50)], minlength=50).max()) + 2
    sources = inverse_of(index, 50, top_k, rng)
    fn = jax.jit(functools.partial(take_rows, width=width))
    hlo = fn.lower(x, index, sources=sources).as_text()
    assert "ncclx_expand_rows" in hlo and "ncclx_take_rows" not in hlo
    actual = fn(*put(one_device, x, index), sources=put(one_device, sources)[0])
    np.testing.assert_array_equal(np.asarray(actual), expected_rows(x, index, width, None))


def test_sources_walk_zeros_rows_left_from_before(one_device):
    """Rows whose index is outside x are zeroed, not left as they were: in a loop the copy writes into the same
    buffer each iteration (XLA assigns a loop body's buffers once), so rows the first iteration filled must be
    cleared by the second, whose index sends them nowhere."""
    rng = np.random.default_rng(5)
    x = random_array(rng, (20, 64), np.float32) + 1.0  # no zero rows
    index = np.stack([rng.permutation(24) % 20, np.where(np.arange(24) % 3 == 0, -1, np.arange(24) % 20)])
    index = index.astype(np.int32)
    sources = np.stack([inverse_of(index[i], 20, 4, rng) for i in range(2)])

    def body(i, out):
        return take_rows(x_d, index_d[i], sources=sources_d[i]) + 0 * out

    x_d, index_d, sources_d = put(one_device, x, index, sources)
    actual = jax.jit(lambda: jax.lax.fori_loop(0, 2, body, jnp.zeros((24, 64), jnp.float32)))()
    np.testing.assert_array_equal(np.asarray(actual), expected_rows(x, index[1], 64, None))


def test_sources_walk_under_vmap_and_grad(one_device):
    """The walk under vmap is one call, and its VJP and JVP are take_rows' (linear in x alone)."""
    rng = np.random.default_rng(4)
    x = random_array(rng, (3, 20, 64), np.float32)
    index = rng.integers(-2, 22, size=(3, 40)).astype(np.int32)
    sources = np.stack([inverse_of(index[b], 20, 8, rng) for b in range(3)])
    fn = jax.vmap(lambda x, index, sources: take_rows(x, index, width=60, sources=sources))
    assert jax.jit(fn).lower(x, index, sources).as_text().count("ncclx_expand_rows") == 1
    actual = jax.jit(fn)(*put(one_device, x, index, sources))
    for b in range(3):
        np.testing.assert_array_equal(np.asarray(actual[b]), expected_rows(x[b], index[b], 60, None))
    weights = rng.standard_normal((40, 60)).astype(np.float32)
    x0, index0, sources0, weights0 = put(one_device, x[0], index[0], sources[0], weights)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(take_rows(x, index0, width=60, sources=sources0) * weights0)))(x0)
    expected = np.zeros_like(x[0])
    for i, row in enumerate(index[0]):
        if 0 <= row < 20:
            expected[row, :60] += weights[i]
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6)
    tangent = jax.jvp(lambda x: take_rows(x, index0, width=60, sources=sources0), (x0,), (x0,))[1]
    np.testing.assert_array_equal(np.asarray(tangent), expected_rows(x[0], index[0], 60, None))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("wire_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=lambda d: np.dtype(d).name)
def test_sources_walk_decodes_the_8bit_wire(one_device, wire_dtype, dtype):
    """Rows on moe.dispatch's 8-bit wire, dequantized as they are expanded, are bit for bit the rows that
    moe_dispatch._decode gives before a plain expansion: blocks of ordinary values, 10^-4 smaller ones, one of
    zeros (scale 0), one of values near float16's largest, and a suffix after the scales that is not read."""
    rng = np.random.default_rng(6)
    hidden, num_rows, top_k = 512, 24, 3
    tokens = rng.standard_normal((num_rows, hidden)).astype(np.float32)
    tokens[:, :128] *= 1e-4
    tokens[0, 128:256] = 0.0
    tokens[1, 256:384] *= 60000.0 / np.abs(tokens[1, 256:384]).max()
    tokens = jnp.asarray(tokens, dtype)
    wire = moe_dispatch._encode(tokens, wire_dtype)
    wire = jnp.concatenate([wire, jnp.full((num_rows, 16), 0xee, jnp.uint8)], axis=1)  # a suffix of 16 bytes
    index = rng.integers(-3, num_rows + 3, size=50).astype(np.int32)
    sources = inverse_of(index, num_rows, top_k + int(np.bincount(index[(index >= 0) & (index < num_rows)]).max()),
                         rng)
    decode = jax.jit(lambda w, i, s: take_rows(w, i, width=hidden, sources=s, wire_dtype=wire_dtype, dtype=dtype))
    hlo = decode.lower(wire, index, sources).as_text()
    assert "ncclx_expand_rows" in hlo and "multiply" not in hlo  # no decode pass of XLA's
    actual = decode(*put(one_device, wire, index, sources))
    decoded = moe_dispatch._decode(wire[:, :hidden + 4 * hidden // 128], hidden, wire_dtype, dtype)
    expected = jax.jit(lambda d, i, s: take_rows(d, i, sources=s))(*put(one_device, decoded, index, sources))
    assert actual.dtype == np.dtype(dtype) and actual.shape == (50, hidden)
    np.testing.assert_array_equal(np.asarray(actual).view(np.uint8), np.asarray(expected).view(np.uint8))


def wire_test_tokens(rng, num_rows, hidden, dtype):
    """Token rows whose blocks of 128 cover the 8-bit wire's cases: ordinary values, 10^-4 smaller ones, a block
    of zeros (scale 0), one near float16's largest, one of float32 subnormal size, infinities, and a row whose
    values span 2^-20 to 2^20 (the wire's subnormals and its largest values in one block)."""
    tokens = rng.standard_normal((num_rows, hidden)).astype(np.float32)
    tokens[:, :128] *= 1e-4
    tokens[0, 128:256] = 0.0
    tokens[1, 256:384] *= 60000.0 / np.abs(tokens[1, 256:384]).max()
    tokens[2, 384:512] *= 1e-30
    tokens[3, 200], tokens[4, 300] = np.inf, -np.inf
    tokens[5] = rng.standard_normal(hidden) * np.exp2(rng.integers(-20, 20, hidden))
    with np.errstate(over="ignore"):  # float16 saturates 60000-ish values to infinity, as it should
        return np.array(jnp.asarray(tokens, dtype))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("wire_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=lambda d: np.dtype(d).name)
def test_encode_rows_gives_xlas_encoding(one_device, wire_dtype, dtype):
    """encode_rows' rows are bit for bit those of moe_dispatch._encode run by XLA on the same backend (its
    division as that backend divides), in one custom call and no pass of XLA's."""
    tokens = wire_test_tokens(np.random.default_rng(7), 40, 640, dtype)
    encode = jax.jit(lambda t: encode_rows(t, wire_dtype))
    hlo = encode.lower(tokens).as_text()
    assert "ncclx_encode_rows" in hlo and "reduce" not in hlo and "divide" not in hlo
    (tokens_d,) = put(one_device, tokens)
    actual = encode(tokens_d)
    expected = jax.jit(lambda t: moe_dispatch._encode(t, wire_dtype))(tokens_d)
    assert actual.dtype == np.uint8 and actual.shape == (40, 640 + 4 * 5)
    np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected))


def test_encode_rows_nan_block_and_vmap(one_device):
    """A block with a NaN gets scale NaN and leaves the other blocks of its row alone; vmap is one call."""
    tokens = wire_test_tokens(np.random.default_rng(8), 12, 512, np.float32).reshape(3, 4, 512)
    tokens[1, 2, 5] = np.nan
    encode = jax.jit(jax.vmap(lambda t: encode_rows(t, jnp.float8_e4m3fn)))
    assert encode.lower(tokens).as_text().count("ncclx_encode_rows") == 1
    actual = np.asarray(encode(*put(one_device, tokens)))
    scales = actual[..., 512:].copy().view(np.float32)  # [3, 4, 4]
    assert np.isnan(scales[1, 2, 0]) and np.isnan(scales).sum() == 1
    reference = jax.jit(lambda t: moe_dispatch._encode(t, jnp.float8_e4m3fn))
    for b in range(3):
        expected = np.asarray(reference(*put(one_device, tokens[b])))
        keep = np.ones(expected.shape, bool)
        if b == 1:
            keep[2, :128] = False  # the NaN block's values are not specified
        np.testing.assert_array_equal(actual[b][keep], expected[keep])


@pytest.mark.parametrize("x, wire_dtype, message", [
    (np.zeros((4, 256), np.float32), np.int8, "wire_dtype must be"),
    (np.zeros((4, 256), np.float32), jnp.float8_e4m3fnuz, "wire_dtype must be"),
    (np.zeros((256,), np.float32), jnp.float8_e4m3fn, r"x must be \[rows, H\]"),
    (np.zeros((4, 192), np.float32), jnp.float8_e4m3fn, "multiple of 128"),
    (np.zeros((4, 256), np.int32), jnp.float8_e4m3fn, "float32, bfloat16 or float16, got int32"),
])
def test_encode_rows_refuses_bad_arguments(x, wire_dtype, message):
    with pytest.raises(ValueError, match=message):
        encode_rows(x, wire_dtype)


def test_vmap_is_one_call(one_device):
    rng = np.random.default_rng(1)
    x = random_array(rng, (3, 20, 64), jnp.bfloat16)
    index = rng.integers(-2, 22, size=(3, 40)).astype(np.int32)
    suffix = random_array(rng, (3, 40, 8), jnp.bfloat16)
    fn = jax.vmap(lambda x, index, suffix: take_rows(x, index, width=60, suffix=suffix))
    assert jax.jit(fn).lower(x, index, suffix).as_text().count("ncclx_take_rows") == 1
    actual = jax.jit(fn)(*put(one_device, x, index, suffix))
    for b in range(3):
        np.testing.assert_array_equal(np.asarray(actual[b]), expected_rows(x[b], index[b], 60, suffix[b]))


def test_gradient_adds_rows_back(one_device):
    """The VJP adds each output row's cotangent into the row it came from; the suffix gets its own columns."""
    rng = np.random.default_rng(2)
    x, suffix = rng.standard_normal((10, 6)).astype(np.float32), rng.standard_normal((7, 2)).astype(np.float32)
    index = np.array([3, 3, -1, 9, 10, 0, 3], np.int32)
    weights = rng.standard_normal((7, 6)).astype(np.float32)
    x_d, index_d, suffix_d, weights_d = put(one_device, x, index, suffix, weights)

    def loss(x, suffix):
        return jnp.sum(take_rows(x, index_d, width=4, suffix=suffix) * weights_d)

    grad_x, grad_suffix = jax.jit(jax.grad(loss, argnums=(0, 1)))(x_d, suffix_d)
    expected = np.zeros_like(x)
    for i, row in enumerate(index):
        if 0 <= row < 10:
            expected[row, :4] += weights[i, :4]
    np.testing.assert_allclose(np.asarray(grad_x), expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad_suffix), weights[:, 4:], rtol=1e-6)
    tangent = jax.jvp(lambda x: take_rows(x, index_d, width=4), (x_d,), (x_d,))[1]
    np.testing.assert_array_equal(np.asarray(tangent), expected_rows(x, index, 4, None))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(x=np.zeros((4,)), index=np.zeros(2, np.int32)), ValueError, "x must be"),
    (dict(x=np.zeros((4, 3)), index=np.zeros(2, np.float32)), TypeError, "index must be"),
    (dict(x=np.zeros((4, 3)), index=np.zeros(2, np.int32), width=4), ValueError, "width must be"),
    (dict(x=np.zeros((4, 3), np.float32), index=np.zeros(2, np.int32), suffix=np.zeros((3, 1), np.float32)),
     ValueError, "suffix must be"),
    (dict(x=np.zeros((4, 3), np.float32), index=np.zeros(2, np.int32), suffix=np.zeros((2, 1), np.int32)),
     ValueError, "suffix must be"),
    (dict(x=np.zeros((4, 3)), index=np.zeros(2, np.int32), sources=np.zeros((3, 2), np.int32)),
     ValueError, "sources must be"),
    (dict(x=np.zeros((4, 3)), index=np.zeros(2, np.int32), sources=np.zeros((4, 2), np.float32)),
     ValueError, "sources must be"),
    (dict(x=np.zeros((4, 3), np.float32), index=np.zeros(2, np.int32), suffix=np.zeros((2, 1), np.float32),
          sources=np.zeros((4, 2), np.int32)), ValueError, "do not go together"),
    (dict(x=np.zeros((4, 272), np.uint8), index=np.zeros(2, np.int32), width=256, wire_dtype=jnp.float8_e4m3fn,
          dtype=np.float32), ValueError, "with sources only"),
    (dict(x=np.zeros((4, 272), np.uint8), index=np.zeros(2, np.int32), width=256, sources=np.zeros((4, 2), np.int32),
          wire_dtype=np.int8, dtype=np.float32), ValueError, "wire_dtype must be"),
    (dict(x=np.zeros((4, 272), np.uint8), index=np.zeros(2, np.int32), width=256, sources=np.zeros((4, 2), np.int32),
          wire_dtype=jnp.float8_e4m3fn, dtype=np.int32), ValueError, "decode to float32"),
    (dict(x=np.zeros((4, 268), np.uint8), index=np.zeros(2, np.int32), width=256, sources=np.zeros((4, 2), np.int32),
          wire_dtype=jnp.float8_e4m3fn, dtype=np.float32), ValueError, "multiple of 8 bytes"),
    (dict(x=np.zeros((4, 272), np.uint8), index=np.zeros(2, np.int32), width=192, sources=np.zeros((4, 2), np.int32),
          wire_dtype=jnp.float8_e4m3fn, dtype=np.float32), ValueError, "multiple of 128"),
])
def test_bad_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        take_rows(**kwargs)
