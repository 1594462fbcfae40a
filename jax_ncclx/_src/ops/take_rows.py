"""take_rows: rows of a matrix picked by a device index, with an optional suffix appended to each row.

The row copies of ``jax_ncclx.moe.dispatch`` (tokens into send rows with their tags; received rows into the
expert-major layout) as one local custom call: a CUDA kernel that copies 16 bytes per lane where the rows
allow it (``xla_ffi/ops/take_rows/take_rows_kernels.cu``), a loop on CPU. XLA's gather of the same rows moves one
element at a time and took about twice as long for bf16 rows of 14 KiB. Given index's inverse (``sources``),
the copy walks the rows of x instead (``ncclx_expand_rows``) and reads each once: the expansion into the
expert-major layout reads each received row k times otherwise, more than the L2 holds at prefill sizes.
``encode_rows`` (``ncclx_encode_rows``) quantizes token rows onto moe.dispatch's 8-bit wire in one pass, where
XLA runs ``_encode`` as a reduction, then a pass that writes values and scales.

The primitives are batched: x ``[B, X, F]``, index ``[B, M]``, the suffix ``[B, M, G]`` and sources
``[B, X, k]`` lead with a batch dimension B, which is how ``vmap`` stays one call. Both are linear in x (and
take_rows in the suffix): the transpose adds the cotangent rows back into the rows they were taken from.
Sharding model: per device, like any elementwise op inside ``shard_map``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad
from jax.interpreters import batching

from jax_ncclx._src import contract
from jax_ncclx._src import lowering
from jax_ncclx._src import primitive


def take_rows(x, index, *, width: int | None = None, suffix=None, sources=None, wire_dtype=None, dtype=None):
    """``out[i] = concat(x[index[i], :width], suffix[i])``, with zeros for x's part where the index is outside
    ``[0, X)`` (a negative index does not wrap).

    Args:
      x: ``[X, F]`` any fixed-width dtype.
      index: integer ``[M]`` (converted to int32).
      width: W, the leading columns of each row of x to take, ``0 <= W <= F`` (static; default F).
      suffix: None, or ``[M, G]`` with x's dtype: row i is appended to output row i whatever ``index[i]`` is.
      sources: None, or integer ``[X, k]`` (converted to int32), index's inverse: row s lists every i with
        ``index[i] == s`` (any order), its other entries outside ``[0, M)``. The copy then walks x's rows and
        reads each once, where it would read row s once per output row that takes it (moe.dispatch's
        expansion: k times). Not with a suffix. The inverse must match index exactly: a row with an index in
        range that sources does not list is left unwritten, and one it lists twice is written twice, in no set
        order on GPU. moe's ``row_pairs`` is ``expand_rows``' inverse by construction (each tag places one pair).
      wire_dtype: None, or ``float8_e4m3fn`` / ``float8_e5m2``: x's rows are on moe.dispatch's 8-bit wire
        (uint8: W values of wire_dtype, then W / 128 float32 scales, then anything), and each is decoded to
        ``dtype`` as it is copied, with ``_decode``'s arithmetic. Needs sources, W a multiple of 128 and
        rows of x of a multiple of 8 bytes.
      dtype: with wire_dtype, the dtype of the result: float32, bfloat16 or float16.

    Returns:
      ``[M, W + G]`` with x's dtype; with wire_dtype, ``[M, W]`` with dtype.

    Raises:
      TypeError / ValueError: a bad argument (the message names it).
    """
    x_shape, index_shape = jnp.shape(x), jnp.shape(index)
    if len(x_shape) != 2:
        raise ValueError(f"jax_ncclx take_rows: x must be [rows, columns], got shape {x_shape}")
    if len(index_shape) != 1 or not jnp.issubdtype(jax.typeof(index).dtype, jnp.integer):
        raise TypeError(f"jax_ncclx take_rows: index must be a 1-D integer array, got "
                        f"{jax.typeof(index).dtype}{list(index_shape)}")
    width = x_shape[1] if width is None else width
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or not 0 <= width <= x_shape[1]:
        raise ValueError(f"jax_ncclx take_rows: width must be a static int in [0, {x_shape[1]}] (x's columns), "
                         f"got {width!r}")
    operands = [jnp.asarray(x)[None], jnp.asarray(index, jnp.int32)[None]]
    if suffix is not None:
        suffix_shape, suffix_dtype = jnp.shape(suffix), jax.typeof(suffix).dtype
        if len(suffix_shape) != 2 or suffix_shape[0] != index_shape[0] or suffix_dtype != jax.typeof(x).dtype:
            raise ValueError(f"jax_ncclx take_rows: suffix must be [{index_shape[0]}, columns] (index's rows) with "
                             f"x's dtype {jax.typeof(x).dtype}, got {suffix_dtype}{list(suffix_shape)}")
        operands.append(jnp.asarray(suffix)[None])
    if sources is not None:
        sources_shape = jnp.shape(sources)
        if suffix is not None:
            raise ValueError("jax_ncclx take_rows: sources and suffix do not go together")
        if (len(sources_shape) != 2 or sources_shape[0] != x_shape[0] or sources_shape[1] < 1
                or not jnp.issubdtype(jax.typeof(sources).dtype, jnp.integer)):
            raise ValueError(f"jax_ncclx take_rows: sources must be integer [{x_shape[0]}, k] (x's rows, k >= 1), "
                             f"got {jax.typeof(sources).dtype}{list(sources_shape)}")
        operands.append(jnp.asarray(sources, jnp.int32)[None])
        wire = "none" if wire_dtype is None else _wire_of(x, width, wire_dtype, dtype)
        return expand_rows_p.bind(*operands, width=int(width), wire=wire,
                                  dtype=None if wire_dtype is None else np.dtype(dtype))[0]
    if wire_dtype is not None:
        raise ValueError("jax_ncclx take_rows: rows on the 8-bit wire (wire_dtype) are decoded with sources only")
    return take_rows_p.bind(*operands, width=int(width))[0]


def encode_rows(x, wire_dtype):
    """Token rows quantized onto moe.dispatch's 8-bit wire, with ``moe_dispatch._encode``'s arithmetic.

    Args:
      x: ``[X, H]`` float32, bfloat16 or float16, H a multiple of 128.
      wire_dtype: ``float8_e4m3fn`` or ``float8_e5m2``.

    Returns:
      uint8 ``[X, H + 4 * H / 128]``: row i is x[i]'s H values of wire_dtype, each divided by its block's scale,
      then the float32 scale of each block of 128 values (its largest magnitude over wire_dtype's largest
      finite value; 0 for a block of zeros, NaN for one with a NaN). Not differentiable (uint8 rows).

    Raises:
      ValueError: a bad argument (the message names it).
    """
    x_shape = jnp.shape(x)
    name = np.dtype(wire_dtype).name
    if name not in contract.MOE_WIRES or name == "none":
        raise ValueError(f"jax_ncclx encode_rows: wire_dtype must be float8_e4m3fn or float8_e5m2, got {name}")
    if len(x_shape) != 2:
        raise ValueError(f"jax_ncclx encode_rows: x must be [rows, H], got shape {x_shape}")
    misfit = encode_misfit(jax.typeof(x).dtype, x_shape[1])
    if misfit is not None:
        raise ValueError(f"jax_ncclx encode_rows: {misfit}")
    return encode_rows_p.bind(jnp.asarray(x)[None], wire=name)[0]


def encode_misfit(dtype, hidden: int) -> str | None:
    """Why encode_rows cannot quantize rows of ``hidden`` values of ``dtype`` (a message), or None where it can."""
    if np.dtype(dtype).name not in contract.FLOAT_TYPES:
        return f"rows on the 8-bit wire are encoded from float32, bfloat16 or float16, got {np.dtype(dtype).name}"
    if hidden % contract.MOE_WIRE_BLOCK:
        return (f"rows on the 8-bit wire are encoded from H a multiple of {contract.MOE_WIRE_BLOCK} values, "
                f"got H = {hidden}")
    return None


def wire_misfit(row_bytes: int, width: int, dtype) -> str | None:
    """Why expand_rows cannot decode rows of ``row_bytes`` on the 8-bit wire into ``width`` values of ``dtype``
    (a message), or None where it can."""
    block = contract.MOE_WIRE_BLOCK
    if dtype is None or np.dtype(dtype).name not in contract.FLOAT_TYPES:
        return f"rows on the 8-bit wire decode to float32, bfloat16 or float16, got dtype {dtype}"
    if width % block or row_bytes % 8 or width + 4 * (width // block) > row_bytes:
        return (f"rows on the 8-bit wire must be a multiple of 8 bytes holding width values and their scales, "
                f"width a multiple of {block}; got rows of {row_bytes} bytes and width {width}")
    return None


def _wire_of(x, width, wire_dtype, dtype):
    """expand_rows' wire param (a name of ``contract.MOE_WIRES``) for a call that decodes x's rows, or a
    ValueError naming what does not fit."""
    name = np.dtype(wire_dtype).name
    if name not in contract.MOE_WIRES or name == "none":
        raise ValueError(f"jax_ncclx take_rows: wire_dtype must be float8_e4m3fn or float8_e5m2, got {name}")
    if jax.typeof(x).dtype != np.uint8:
        raise ValueError(f"jax_ncclx take_rows: rows on the 8-bit wire are uint8, got x {jax.typeof(x).dtype}")
    misfit = wire_misfit(jnp.shape(x)[1], width, dtype)
    if misfit is not None:
        raise ValueError(f"jax_ncclx take_rows: {misfit}")
    return name


def outside_to_end(index, num_rows):
    """``index`` with every entry outside ``[0, num_rows)`` moved to num_rows: jnp's gathers and scatters would
    wrap a negative index, where take_rows (and all_to_allv_dynamic's send_rows) reads a zero row."""
    return jnp.where((index >= 0) & (index < num_rows), index, num_rows)


def add_rows(shape, index, rows):
    """zeros(shape) (``[B, X, ...]``) with ``rows[b, i]`` (``[B, M, ...]``, at most as wide) added into the
    leading part of row ``index[b, i]``, dropped where the index is outside ``[0, X)``: the transpose of
    reading rows by an index."""
    batch, num_rows = shape[:2]
    where = (jnp.arange(batch)[:, None], outside_to_end(index, num_rows), *(slice(0, n) for n in rows.shape[2:]))
    return jnp.zeros(shape, rows.dtype).at[where].add(rows, mode="drop")


take_rows_p = primitive.make_local("take_rows")


def _take_rows_abstract_eval(x, index, *suffix, width):
    columns = width + (suffix[0].shape[2] if suffix else 0)
    return primitive.output_aval(x, None, index, *suffix, shape=(*index.shape, columns))


def _take_rows_jvp(primals, tangents, *, width):
    out = take_rows_p.bind(*primals, width=width)
    linear = (tangents[0], *tangents[2:])
    if all(type(t) is ad.Zero for t in linear):  # e.g. integer rows, whose tangents are float0
        return out, ad.Zero(jax.typeof(out).to_tangent_aval())
    linear = [ad.instantiate_zeros(t) for t in linear]
    return out, take_rows_p.bind(linear[0], primals[1], *linear[1:], width=width)


def _take_rows_transpose(ct, x, index, *suffix, width):
    """Adds each cotangent row's first W columns into the row of x it was taken from (none for an index
    outside x); the rest of the row is the suffix's cotangent."""
    ct = ad.instantiate_zeros(ct)
    ct_x = add_rows(x.aval.shape, index, ct[:, :, :width]) if ad.is_undefined_primal(x) else None
    ct_suffix = [ct[:, :, width:] if ad.is_undefined_primal(s) else None for s in suffix]
    return [ct_x, None, *ct_suffix]


# take_rows with index's inverse: x [B, X, F], index [B, M], sources [B, X, k] -> [B, M, W] (x's dtype, or dtype
# decoded from the 8-bit wire `wire`). Linear in x alone; x on the wire is uint8, whose tangents are float0.
expand_rows_p = primitive.make_local("expand_rows")


def _expand_rows_abstract_eval(x, index, sources, *, width, wire, dtype):
    return primitive.output_aval(x, None, index, sources, shape=(*index.shape, width), dtype=dtype)


def _expand_rows_jvp(primals, tangents, **params):
    out = expand_rows_p.bind(*primals, **params)
    if type(tangents[0]) is ad.Zero:
        return out, ad.Zero(jax.typeof(out).to_tangent_aval())
    return out, expand_rows_p.bind(tangents[0], *primals[1:], **params)


def _expand_rows_transpose(ct, x, index, sources, **params):
    ct = ad.instantiate_zeros(ct)
    return [add_rows(x.aval.shape, index, ct) if ad.is_undefined_primal(x) else None, None, None]


# Token rows onto the 8-bit wire `wire`: x [B, X, H] -> uint8 [B, X, H + 4 * H / 128]. Its result is integer, so
# its tangent is a float0 zero, as for XLA's _encode.
encode_rows_p = primitive.make_local("encode_rows")


def _encode_rows_abstract_eval(x, *, wire):
    batch, num_rows, hidden = x.shape
    return primitive.output_aval(x, None, shape=(batch, num_rows, hidden + 4 * (hidden // contract.MOE_WIRE_BLOCK)),
                                 dtype=np.uint8)


def _encode_rows_jvp(primals, tangents, *, wire):
    out = encode_rows_p.bind(*primals, wire=wire)
    return out, ad.Zero(jax.typeof(out).to_tangent_aval())


take_rows_p.def_abstract_eval(_take_rows_abstract_eval)
lowering.register_local_lowerings(take_rows_p, "ncclx_take_rows", lambda *, width: {})
batching.fancy_primitive_batchers[take_rows_p] = functools.partial(primitive.fold_vmap_into_batch, take_rows_p)
ad.primitive_jvps[take_rows_p] = _take_rows_jvp
ad.primitive_transposes[take_rows_p] = _take_rows_transpose
expand_rows_p.def_abstract_eval(_expand_rows_abstract_eval)
lowering.register_local_lowerings(expand_rows_p, "ncclx_expand_rows",  # enum attributes travel as int32
                                  lambda *, width, wire, dtype: {"wire": np.int32(contract.MOE_WIRES[wire])})
batching.fancy_primitive_batchers[expand_rows_p] = functools.partial(primitive.fold_vmap_into_batch, expand_rows_p)
ad.primitive_jvps[expand_rows_p] = _expand_rows_jvp
ad.primitive_transposes[expand_rows_p] = _expand_rows_transpose
encode_rows_p.def_abstract_eval(_encode_rows_abstract_eval)
lowering.register_local_lowerings(encode_rows_p, "ncclx_encode_rows",  # enum attributes travel as int32
                                  lambda *, wire: {"wire": np.int32(contract.MOE_WIRES[wire])})
batching.fancy_primitive_batchers[encode_rows_p] = functools.partial(primitive.fold_vmap_into_batch, encode_rows_p)
ad.primitive_jvps[encode_rows_p] = _encode_rows_jvp
