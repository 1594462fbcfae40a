"""Shared test helpers: running a per-shard function under jit(shard_map) and comparing with jax.lax."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

FLOAT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
INT_DTYPES = [jnp.int32, jnp.int8]
MOVE_ONLY_DTYPES = [jnp.float8_e4m3fn]
# Reduced unlike their own dtype: as bytes (bool max / min), in int32 (bool sum), as pairs of floats (complex),
# in 32 bits (16-bit integers: NCCL has no type for them).
SPECIAL_DTYPES = [jnp.bool_, jnp.complex64, jnp.uint16]


def spec(mesh):
    return P(*mesh.axis_names)


def smap(fn, mesh, *, n_in=1, jit=True, check_vma=True, out_specs=None):
    """``fn`` per shard over both mesh axes; arrays are [a*..., b*..., ...] sharded on their first two dims."""
    s = spec(mesh)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(s,) * n_in, out_specs=s if out_specs is None else out_specs,
                           check_vma=check_vma)
    return jax.jit(mapped) if jit else mapped


def random_array(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if dtype == jnp.bool_:
        values = rng.normal(size=shape) > 0
    elif jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        values = rng.integers(max(info.min, -8), min(info.max, 8), size=shape)  # sums stay in range
    elif jnp.issubdtype(dtype, jnp.complexfloating):
        values = rng.normal(size=shape) + 1j * rng.normal(size=shape)
    else:
        values = rng.normal(size=shape)
    return np.asarray(values).astype(dtype)


def random_bits(shape, dtype, seed=0):
    """Uniformly random bytes as ``dtype`` (NaN payloads and every integer included): input for the ops that
    move data, which must keep every bit. Small random values would leave 8-bit integers mostly zero."""
    dtype = np.dtype(dtype)
    data = np.random.default_rng(seed).integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8)
    return data.view(dtype).reshape(shape)


def put(array, mesh):
    return jax.device_put(array, NamedSharding(mesh, spec(mesh)))


def assert_same(actual, expected, dtype, *, reduced):
    """Moved data (``reduced`` False) must keep every bit. Reductions equal too, but for 16-bit floats, which
    jax_ncclx sums in float32 and rounds once, where jax.lax may round after every step."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if not reduced:
        assert_bits_equal(actual, expected)
    elif jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize <= 2:
        np.testing.assert_allclose(actual.astype(np.float32), expected.astype(np.float32), rtol=2e-2, atol=2e-2)
    else:
        np.testing.assert_array_equal(actual, expected)


def assert_bits_equal(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    as_int = {1: np.uint8, 2: np.uint16, 4: np.uint32}.get(actual.dtype.itemsize, np.uint64)
    per_element = max(1, actual.dtype.itemsize // np.dtype(as_int).itemsize)  # 16-byte elements: two words
    words = lambda a: np.ascontiguousarray(a).reshape(-1).view(as_int).reshape(a.size, per_element)  # noqa: E731
    mismatch = np.flatnonzero((words(actual) != words(expected)).any(axis=1))
    assert mismatch.size == 0, (f"{mismatch.size} of {actual.size} elements differ, first at flat index "
                                f"{mismatch[0]}: got {actual.flat[mismatch[0]]}, expected {expected.flat[mismatch[0]]}")


def drop_warnings(monkeypatch, caplog, run):
    """The warnings JAX_NCCLX_WARN_DROPS=1 logs, sorted: ``run(True)`` (a call that drops) with the variable
    unset and ``run(False)`` (one that drops nothing) with it set must log none; then ``run(True)`` with it set."""
    with caplog.at_level(logging.WARNING, logger="jax_ncclx"):
        run(True)  # unset: no warning
        monkeypatch.setenv("JAX_NCCLX_WARN_DROPS", "1")
        run(False)  # nothing drops
        assert not [r for r in caplog.records if "dropped" in r.getMessage()]
        run(True)
    return sorted(r.getMessage() for r in caplog.records if "dropped" in r.getMessage())


def assert_wire_rows(actual, rows, wire_dtype):
    """``actual`` [..., H] (H a multiple of 128) is ``rows`` through moe.dispatch's 8-bit wire as the chain
    quantizes and dequantizes it (``_encode``, ``_decode``, in XLA on the default device): within one step of
    each block's largest magnitude, and equal for at least 99 % of the nonzero values (a kernel and XLA may
    round a quotient differently; a misplaced value or scale breaks both)."""
    from jax_ncclx._src.ops import moe_dispatch

    rows = np.asarray(rows)
    hidden = rows.shape[-1]
    flat = rows.reshape(-1, hidden)
    expected = np.asarray(moe_dispatch._decode(moe_dispatch._encode(jnp.asarray(flat), wire_dtype), hidden,
                                               wire_dtype, flat.dtype)).astype(np.float32)
    got = np.asarray(actual).reshape(flat.shape).astype(np.float32)
    largest = np.abs(flat.astype(np.float32)).reshape(len(flat), -1, 128).max(axis=2)
    mantissa_bits = 3 if jnp.dtype(wire_dtype) == jnp.float8_e4m3fn else 2
    step = np.repeat(largest, 128, axis=1) * 2.0 ** -mantissa_bits
    off = np.abs(got - expected) > step
    assert not off.any(), (f"{off.sum()} values off by more than a step, first at {np.argwhere(off)[0]}: "
                           f"{got[off][:4]} against {expected[off][:4]}")
    nonzero = expected != 0
    assert np.mean(got[nonzero] == expected[nonzero]) >= 0.99, "fewer than 99 % of the values equal the chain's"


def wire_takes_lines(rows, hidden):
    """Whether `rows` slot rows of H values on the 8-bit wire take lines: a 512-byte warp step per three blocks of
    128 values, up to the kernels' MOE_LINES_MAX_BYTES."""
    from jax_ncclx._src import lib

    return rows * -(-hidden // 384) * 512 <= lib.cuda_module().MOE_LINES_MAX_BYTES


def wire_tokens(shape, dtype, seed):
    """Random tokens whose blocks of 128 values differ in magnitude by up to 2^6 (a scale taken from the wrong
    block is then off by far more than a step), the first block all zeros (scale 0, decoded as zeros)."""
    x = random_array(shape, np.float32, seed=seed) * 2.0 ** (np.arange(shape[-1]) // 128 % 7 - 3)
    x[(0,) * (len(shape) - 1) + (slice(0, 128),)] = 0
    return x.astype(dtype)
