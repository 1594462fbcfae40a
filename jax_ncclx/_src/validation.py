"""Argument checks every jax_ncclx op shares: axis names, static ints, dtypes, and the dtype policy of
reductions (int32 indices, widened 16-bit integers, float32 accumulation of 16-bit floats). Errors name the op
and the argument.
"""

from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np

from jax_ncclx._src import compat


def check_axis_name(axis_name, op: str) -> Hashable:
    """The mesh axis or axes ``axis_name`` names, as the primitives take them: one name (given alone or as a
    1-tuple), or a tuple of two or more distinct names. Over several axes an op runs as over one axis whose
    members are every device that shares the other axes' coordinates, ordered as ``jax.lax.axis_index`` of the
    tuple orders them (the first axis major), as ``jax.lax``'s collectives do."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not names:
        raise ValueError(f"jax_ncclx.{op}: axis_name must name at least one mesh axis, got {axis_name!r}")
    for name in names:
        try:
            hash(name)
        except TypeError:
            raise TypeError(f"jax_ncclx.{op}: axis_name must be a hashable mesh axis name or a tuple of them, got "
                            f"{axis_name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"jax_ncclx.{op}: axis_name names an axis twice: {axis_name!r}")
    return names[0] if len(names) == 1 else names


def axes_of(axis_name) -> tuple:
    """The mesh axes of a checked ``axis_name`` (see :func:`check_axis_name`), as a tuple."""
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def check_static_int(value, name: str, op: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int: a static Python (or NumPy) int, within ``[minimum, maximum]`` where given, not a bool
    or a tracer, since it sizes arrays or picks a dimension. ``op`` as the message names it, e.g.
    ``"moe.dispatch"``."""
    if isinstance(value, (jax.core.Tracer, bool)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"jax_ncclx.{op}: {name} must be a static Python int, got {value!r}; mark it static in "
                        "jax.jit (static_argnums/static_argnames)")
    if minimum is not None and value < minimum:
        raise ValueError(f"jax_ncclx.{op}: {name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"jax_ncclx.{op}: {name} must be <= {maximum}, got {value}")
    return int(value)


def check_dtype(x, op: str, *, reduce_op: str | None = None):
    """Rejects dtypes the op cannot take: anything that is not a number or a boolean (e.g. PRNG key arrays),
    complex numbers in ``max`` / ``min`` (they have no order), 8-bit floats in reductions (they are moved,
    not reduced). ``reduce_op``: the reduction, or None for ops that only move data."""
    dtype = jax.typeof(x).dtype
    if dtype != jnp.bool_ and not jnp.issubdtype(dtype, jnp.number):
        raise TypeError(f"jax_ncclx.{op}: unsupported dtype {dtype}; use a number or boolean dtype")
    check_whole_bytes(dtype, op)
    if reduce_op in ("max", "min") and jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(f"jax_ncclx.{op}: cannot take the {reduce_op} of complex dtype {dtype}: complex numbers "
                        "have no order (jax.lax.pmax / pmin refuse them too)")
    if reduce_op is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:
        raise TypeError(f"jax_ncclx.{op}: cannot reduce 8-bit float dtype {dtype}; upcast first")


def check_whole_bytes(dtype, op: str):
    """Rejects dtypes of under 8 bits (int4, float4_e2m1fn, ...): XLA packs several into a byte, which the
    handlers, sizing buffers from the element count, would overrun."""
    if jnp.issubdtype(dtype, jnp.integer):
        bits = jnp.iinfo(dtype).bits
    elif jnp.issubdtype(dtype, jnp.floating):
        bits = jnp.finfo(dtype).bits
    else:
        return
    if bits < 8:
        raise TypeError(
            f"jax_ncclx.{op}: cannot take dtype {dtype} ({bits} bits): values of under a byte are not supported; "
            f"cast to an 8-bit dtype, or pack {8 // bits} values into each byte with "
            f"jax.lax.bitcast_convert_type(x.reshape(..., {8 // bits}), jnp.uint8) and unpack the result")


def check_arrays(op: str, **arrays):
    """A TypeError naming the op and the argument where one of ``arrays`` (name -> value) is no array to JAX: a
    Python list or tuple is a pytree there, and JAX's own error names neither."""
    for name, value in arrays.items():
        try:
            jax.typeof(value)
        except TypeError:
            raise TypeError(f"jax_ncclx.{op}: {name} must be an array (a jax.Array, a NumPy array or a scalar; "
                            f"jnp.asarray makes one of a list), got a {type(value).__name__}") from None


def as_int32(x):
    """Integer array ``x`` (counts, row indices, expert ids) as int32, values beyond int32's range saturated to
    its ends rather than wrapped: under ``jax_enable_x64`` a count of 2**32 + 1 must stay a count too large
    (clamped, and reported where the op reports drops), not become 1."""
    x = jnp.asarray(x)
    info, limits = jnp.iinfo(x.dtype), jnp.iinfo(jnp.int32)
    if info.max > limits.max:
        x = jnp.minimum(x, np.asarray(limits.max, x.dtype))
    if info.min < limits.min:
        x = jnp.maximum(x, np.asarray(limits.min, x.dtype))
    return x.astype(jnp.int32)


# 16-bit integers reduce in 32 bits (NCCL has no 16-bit integer type); a sum wraps to the same 16 bits.
_WIDENED = {np.dtype(np.int16): np.int32, np.dtype(np.uint16): np.uint32}


def reduction_operand(x, op: str, reduce_op: str):
    """``(operand, restore)``: ``x`` as the reduction ``reduce_op`` takes it, and what turns the result back:
    booleans to sum are counted in int32, the dtype ``jax.lax.psum`` gives them (``restore`` keeps it);
    16-bit integers reduce in 32 bits and go back; every other dtype passes as it is (the handlers sum complex
    numbers as pairs of their real dtype and take the max / min of booleans as bytes, without a copy).
    Raises the TypeError of :func:`check_dtype` for what the op cannot take."""
    check_dtype(x, op, reduce_op=reduce_op)
    dtype = np.dtype(jax.typeof(x).dtype)
    if reduce_op == "sum" and dtype == np.bool_:
        return x.astype(jnp.int32), lambda y: y
    if dtype in _WIDENED:
        return x.astype(_WIDENED[dtype]), lambda y: y.astype(dtype)
    return x, lambda y: y


def accumulation_dtype(dtype):
    """The dtype a sum of ``dtype`` accumulates in here: float32 for 16-bit floats (rounded once at the end, as
    the CPU handlers and the NVLink kernels do), ``dtype`` itself otherwise."""
    return jnp.float32 if dtype in (jnp.bfloat16, jnp.float16) else dtype


def is_bound(axis_name) -> bool:
    return all(compat.axis_is_bound(name) for name in axes_of(axis_name))


def check_bound_in_backward(axis_name, op: str):
    """Raises the NameError of a custom VJP's backward pass traced where ``axis_name`` is unbound: JAX 0.11
    leaves a vmapped axis unbound there under ``jax.grad(jax.vmap(..., axis_name=...))``."""
    if not is_bound(axis_name):
        raise NameError(f"jax_ncclx.{op}: axis {axis_name!r} is unbound in the backward pass; under "
                        f"jax.grad(jax.vmap(..., axis_name={axis_name!r})) JAX leaves a vmapped axis unbound there: "
                        f"write jax.vmap(jax.grad(...), axis_name={axis_name!r}) instead")
