"""The plumbing every jax_ncclx collective shares, written once.

A collective is a ``jax.extend.core.Primitive`` whose eager ``impl`` refuses to run outside ``shard_map``,
whose abstract eval keeps the varying-manual-axes type (so ``check_vma=True`` works), and whose lowering
emits this package's own FFI custom call:

* CPU: the target gets this device's partition id as its first operand, plus the replica groups (partition
  ids), a call-site id and the timeout as attributes; the handlers meet in-process (``xla_ffi/common``).
* CUDA: the target gets the ``comm_id`` of an NCCL communicator made for exactly these groups (``comm.py``).
  An op may route its CUDA lowering (:class:`CudaRoute`): pick another target (e.g. its NVLink kernel),
  add attributes, and ask for a workspace result that XLA allocates and the lowering drops.

Public functions call :func:`global_view` when their axis is not bound by a ``shard_map``: the op then runs
per shard through an internal ``shard_map`` over the mesh that the arrays are sharded on.

Local ops (no communication, e.g. moe's routing) are made by :func:`make_local` and use
:func:`register_local_lowerings`: the same FFI target on both platforms, no groups and no communicator.
"""

import dataclasses
import functools
import itertools
import logging
import os
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching
from jax.interpreters import mlir
from jax.sharding import NamedSharding

from jax_ncclx._src import comm
from jax_ncclx._src import compat
from jax_ncclx._src import config
from jax_ncclx._src import faults
from jax_ncclx._src import lib
from jax_ncclx._src import trace

logger = logging.getLogger("jax_ncclx")

_call_site_ids = itertools.count(1)


# ---- argument checks ---------------------------------------------------------------------------------------

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


# ---- primitives and avals ----------------------------------------------------------------------------------

def make_collective(name: str, *, multiple_results: bool = False) -> Primitive:
    """A primitive ``ncclx_<name>`` that fails clearly when evaluated outside a mapped context."""
    prim = Primitive(f"ncclx_{name}")
    prim.multiple_results = multiple_results

    def outside_shard_map(*args, **params):
        raise RuntimeError(
            f"jax_ncclx.{name} must run inside jax.shard_map (or under jax.jit on arrays sharded over the "
            "named mesh axis)"
        )

    prim.def_impl(outside_shard_map)
    return prim


def make_local(name: str, *, multiple_results: bool = False) -> Primitive:
    """A primitive ``ncclx_<name>`` for a local op (no communication): evaluated eagerly by compiling it."""
    prim = Primitive(f"ncclx_{name}")
    prim.multiple_results = multiple_results
    prim.def_impl(lambda *args, **params: compat.apply_primitive(prim, *args, **params))
    return prim


def fold_vmap_into_batch(prim: Primitive, axis_data, args, dims, **params):
    """The batching rule of a primitive whose operands and results all lead with a batch dimension B: the
    vmapped dimension is folded into B, so that ``vmap`` stays one call. With no operand batched (a
    ``vmap`` over a ``shard_map`` that maps none of them), the call is left as it is."""
    if all(d is None for d in dims):
        outs = prim.bind(*args, **params)
        return outs, ([None] * len(outs) if prim.multiple_results else None)
    args = [batching.bdim_at_front(a, d, axis_data.size) for a, d in zip(args, dims)]
    vmapped, batch = args[0].shape[:2]
    outs = prim.bind(*(a.reshape(vmapped * batch, *a.shape[2:]) for a in args), **params)

    def unfold(out):
        return out.reshape(vmapped, batch, *out.shape[1:])

    if not prim.multiple_results:
        return unfold(outs), 0
    return [unfold(out) for out in outs], [0] * len(outs)


def manual_axes_of(axis_name) -> tuple:
    """The axes of ``axis_name`` that are manual axes of the enclosing ``shard_map``: those that varying types
    track (a vmapped axis is not one)."""
    manual = jax.sharding.get_abstract_mesh().manual_axes
    return tuple(name for name in axes_of(axis_name) if name in manual)


def ensure_varying(x, axis_name):
    """Marks ``x`` as varying over the mesh axes of ``axis_name`` it does not vary over yet (as ``jax.lax``
    collectives do). A vmapped axis has no such type and is left out."""
    if not compat.check_vma_enabled():
        return x
    varying = compat.varying_axes(jax.typeof(x))
    missing = tuple(name for name in manual_axes_of(axis_name) if name not in varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def output_aval(aval, axis_name, *inputs, shape=None, dtype=None, invariant: bool = False):
    """The aval of a collective's result: ``aval`` with a new shape/dtype, varying over the union of the
    inputs' varying axes, minus those of ``axis_name`` when the result is the same on every member
    (``invariant``)."""
    varying = frozenset().union(*(compat.varying_axes(a) for a in (aval, *inputs)))
    if invariant:
        varying -= set(axes_of(axis_name))
    out = aval.update(shape=aval.shape if shape is None else tuple(shape),
                      dtype=aval.dtype if dtype is None else dtype)
    return compat.with_varying_axes(out, varying)


def effects(axis_name):
    return {compat.NamedAxisEffect(name) for name in axes_of(axis_name)}


def batches_own_axis(axis_data, axis_name, op: str) -> bool:
    """Whether a batching rule runs for ``jax.vmap(..., axis_name=...)`` over the collective's own axis. The
    axis's members are then the entries of the batch dimension, all on this device, so the op is local array
    work on :func:`members_first`. A tuple that takes the vmapped axis together with other axes is refused
    here, as ``jax.lax`` refuses it for all but its reductions and all_to_all (``all_reduce`` and
    ``all_to_all`` handle that case themselves)."""
    axes = axes_of(axis_name)
    if axis_data.name not in axes:
        return False
    if len(axes) > 1:
        raise NotImplementedError(
            f"jax_ncclx.{op}: axis_name {axis_name!r} takes the vmapped axis {axis_data.name!r} together with "
            "other axes; only all_reduce and all_to_all support that (as in jax.lax)")
    return True


def members_first(axis_data, x, d):
    """``x`` with the vmapped axis's members along dimension 0: its batch dimension ``d`` moved there, or (``d``
    None: every member holds ``x``) ``x`` broadcast to them."""
    if d is None:
        return jnp.broadcast_to(x, (axis_data.size, *jnp.shape(x)))
    return jnp.moveaxis(x, d, 0)


# ---- lowering ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CudaRoute:
    """How one CUDA call site lowers: the FFI target, extra attributes, the byte size of a workspace
    result (None: the handler takes none), and the operands the target takes, by index (None: all)."""

    target: str
    attrs: dict = dataclasses.field(default_factory=dict)
    workspace_bytes: int | None = None
    operands: tuple[int, ...] | None = None


COLLECTIVE_OPS: set[str] = set()  # the ops that communicate, as JAX_NCCLX_TIMEOUT_S_<OP> names them


def register_lowerings(prim: Primitive, target: str, attrs: Callable[..., dict] = lambda **params: {},
                       cuda_route: Callable[..., CudaRoute | None] | None = None,
                       aliases: dict[int, int] | None = None, fallback: Callable | None = None,
                       timeout_op: str | None = None):
    """Registers CPU and CUDA lowerings of ``prim`` to the FFI target ``target``.

    Args:
      attrs: maps the primitive's params (without axis_name) to the op's own FFI attributes.
      cuda_route: maps (ctx, comm_id, size, **params) to the :class:`CudaRoute` of a CUDA call site, where
        ``size`` is the communicator's; by default every call site lowers to ``target`` without workspace.
        None (with ``fallback``): the call site lowers to ``fallback``.
      aliases: {operand index: result index} of operands whose buffer the result takes over (XLA's
        input/output aliasing), so that the handler writes into the operand's values.
      fallback: for a fused op, the same computation in other jax_ncclx ops, as a function of the operands
        and (axis_name, **params): what the CPU lowers and what CUDA call sites lower where the fused kernel
        cannot run.
      timeout_op: the op whose timeout (``JAX_NCCLX_TIMEOUT_S_<OP>``) governs the call; default: its own.
    """
    timeout_op = timeout_op or target.removeprefix("ncclx_")
    COLLECTIVE_OPS.add(timeout_op)
    for platform in ("cpu", "cuda"):
        # Not cached: JAX would reuse one lowering for equal calls, but each call site gets its own id, and
        # whether a call sits in a loop body changes its target (_lower).
        mlir.register_lowering(
            prim,
            functools.partial(_lower, target=target, attrs=attrs, platform=platform, cuda_route=cuda_route,
                              aliases=aliases or {}, fallback=fallback, timeout_op=timeout_op),
            platform=platform, cacheable=False,
        )


def _lower_fallback(ctx, operands, fallback, axis_name, params):
    lowered = mlir.lower_fun(functools.partial(fallback, axis_name=axis_name, **params),
                             multiple_results=len(ctx.avals_out) > 1)
    return lowered(ctx, *operands)


def _lower(ctx, *operands, axis_name, target, attrs, platform, cuda_route, aliases, fallback, timeout_op,
           **params):
    axis_context = ctx.module_context.axis_context
    if not compat.is_spmd_axis_context(axis_context):
        raise NotImplementedError(f"{target}: jax_ncclx collectives lower only inside jax.shard_map (not pmap)")
    op = target.removeprefix("ncclx_")
    automatic = compat.automatic_axes(axis_context)
    if automatic:  # XLA would have to partition the custom call over them (on CPU it refuses the partition id)
        raise NotImplementedError(
            f"jax_ncclx.{op}: jax.shard_map must make every mesh axis of size > 1 manual; its axis_names leave "
            f"{', '.join(map(repr, automatic))} to the compiler. Leave out axis_names (or name those axes too) and "
            "give their dimensions in in_specs / out_specs.")
    if platform == "cpu" and fallback is not None:
        return _lower_fallback(ctx, operands, fallback, axis_name, params)
    groups = compat.replica_groups(axis_context, axes_of(axis_name))
    for aval in ctx.avals_in:  # also for primitives bound directly, past the public functions' checks
        check_whole_bytes(aval.dtype, op)
    settings = config.current()
    site = next(_call_site_ids)
    op_attrs = attrs(**params)
    # Every handler takes these (xla_ffi/common/monitor.h, CallAttrs).
    op_attrs.update(site=np.int64(site), timeout_ms=np.int64(settings.timeout_ms_for(timeout_op)),
                    warn_ms=np.int64(settings.warn_ms), trace=np.int64(settings.trace_attr))
    avals_in, avals_out = list(ctx.avals_in), list(ctx.avals_out)
    site_info = dict(op=op, axis=str(axis_name), platform=platform, bytes=_nbytes(ctx.avals_in[0]),
                     dtype=str(ctx.avals_in[0].dtype))
    if platform == "cpu":
        module = lib.cpu_module()
        op_attrs.update(groups=np.asarray(groups, np.int64).reshape(-1), group_size=np.int64(len(groups[0])))
        # First, ahead of the op's operands, so that a handler's trailing operands may be optional.
        operands = (compat.partition_id(), *operands)
        avals_in.insert(0, jax.core.ShapedArray((), np.uint32))
        aliases = {operand + 1: result for operand, result in aliases.items()}
        site_info.update(groups=[list(g) for g in groups], transport="cpu", algorithm="rendezvous")
    else:
        module = lib.cuda_module()
        mesh = _concrete_mesh(axis_context.mesh, target)
        mesh_devices = list(mesh.devices.flat)
        comm_id = comm.communicator_for(mesh, axis_name)
        route = cuda_route(ctx, comm_id, len(groups[0]), **params) if cuda_route is not None else CudaRoute(target)
        if route is None:
            return _lower_fallback(ctx, operands, fallback, axis_name, params)
        target = route.target
        if route.operands is not None:
            operands = tuple(operands[i] for i in route.operands)
            avals_in = [avals_in[i] for i in route.operands]
        op_attrs.update(route.attrs, comm_id=np.int64(comm_id))
        if route.workspace_bytes is not None:
            avals_out.append(jax.core.ShapedArray((route.workspace_bytes,), np.uint8))
        nvlink = target.endswith("_nvlink")
        if not nvlink:
            comm.ensure_nccl(comm_id)
            # The NCCL handlers registered twice, the second "<target>_cmdbuf" marked command-buffer compatible
            # (xla_ffi/ops/collectives_cuda.cc; all_to_allv_dynamic's is not among them).
            if settings.nccl_command_buffers and f"{target}_cmdbuf" in lib.cuda_target_names():
                if config.xla_records_loops() and compat.lowering_may_be_inside_control_flow():
                    # NCCL's graph-mixing nodes make XLA's loop and conditional graphs fail to instantiate
                    # (docs/sharp_bits.md): this call stays out of graphs, the rest of the body stays in.
                    logger.info("jax_ncclx: %s call site %d sits in a loop or conditional that XLA records into "
                                "a command buffer, or in a jitted function that one may call: it runs from the "
                                "host, not from the graph", op, site)
                else:
                    target += "_cmdbuf"
                    module.set_watch_replays(settings.watch_replays)  # read when XLA captures the call
        # Targets XLA may record into CUDA graphs also come "_watched": with a prepare stage that refuses an
        # execution on a failed communicator (xla_ffi/ops/cuda_collective.h), at a host cost in every execution.
        if settings.watch_replays and f"{target}_watched" in lib.cuda_target_names():
            target += "_watched"
        algorithm = {1: "one_shot", 2: "two_shot"}.get(int(route.attrs.get("algorithm", 1))) if nvlink else "nccl"
        site_info.update(groups=[[mesh_devices[p].id for p in g] for g in groups], comm_id=comm_id,
                         transport="nvlink" if nvlink else "nccl", algorithm=algorithm)
    _check_results_fit(op, avals_out, platform, None if platform == "cpu" else mesh_devices[0])
    trace.register_call_site(module, site, site_info)
    faults.install(module, settings.faults)
    lowered = jax.ffi.ffi_lowering(target, operand_output_aliases=aliases or None)(
        ctx.replace(avals_in=avals_in, avals_out=avals_out), *operands, **op_attrs)
    return lowered[: len(ctx.avals_out)]


LOCAL_TARGETS: set[str] = set()  # the FFI targets of local ops (no communication), for tools that read HLO


def register_local_lowerings(prim: Primitive, target: str, attrs: Callable[..., dict],
                            cuda_scratch_bytes: Callable[..., int] | None = None):
    """Registers CPU and CUDA lowerings of a local op (no communication: no groups, no communicator, nothing
    traced) to the FFI target ``target`` on both platforms.

    Args:
      attrs: maps the primitive's params to its FFI attributes.
      cuda_scratch_bytes: maps (avals_in, **params) to the bytes of a scratch result that the CUDA handler
        takes last (XLA allocates it; the lowering drops it). None: no scratch.
    """
    def lower(ctx, *operands, platform, **params):
        for aval in ctx.avals_in:
            check_whole_bytes(aval.dtype, target.removeprefix("ncclx_"))
        avals_out = list(ctx.avals_out)
        if platform == "cuda":
            lib.cuda_module()  # registers the CUDA targets, or says why it cannot
            if cuda_scratch_bytes is not None:
                avals_out.append(jax.core.ShapedArray((cuda_scratch_bytes(ctx.avals_in, **params),), np.uint8))
        lowered = jax.ffi.ffi_lowering(target)(ctx.replace(avals_out=avals_out), *operands, **attrs(**params))
        return lowered[: len(ctx.avals_out)]

    for platform in ("cpu", "cuda"):
        mlir.register_lowering(prim, functools.partial(lower, platform=platform), platform=platform)
    LOCAL_TARGETS.add(target)


# Where a result's size comes from, for the error of one too large for the device.
_SIZED_BY = {"all_to_allv_dynamic": " y is [N, C, ...] rows with C = max_recv_per_peer (moe.dispatch: capacity): "
                                    "lower it.",
             "ragged_all_to_all": " Its last result is the workspace of twice [N, C, ...] rows, C = max_recv_per_peer "
                                  "(by default output's rows): lower it."}


def _check_results_fit(op: str, avals_out, platform: str, device) -> None:
    """Refuses, when it is lowered, a call whose result alone is larger than the device's memory (the host's
    on CPU), which XLA would otherwise report as a bare RESOURCE_EXHAUSTED when it runs."""
    if platform == "cpu":
        limit, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host's memory"
    else:
        stats = device.memory_stats() or {}
        limit, where = stats.get("bytes_limit"), f"the memory of {device.device_kind} {device.id}"
    for index, aval in enumerate(avals_out):
        if limit and _nbytes(aval) > limit:
            raise ValueError(f"jax_ncclx.{op}: result {index} ({aval.dtype}{list(aval.shape)}) needs "
                             f"{_nbytes(aval)} bytes, more than {where} ({limit} bytes).{_SIZED_BY.get(op, '')}")


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _concrete_mesh(mesh, target) -> jax.sharding.Mesh:
    """The mesh being lowered, with its devices; an abstract mesh takes them from ``jax.set_mesh``."""
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    context = compat.concrete_context_mesh()
    if not context.empty and context.axis_names == mesh.axis_names and context.axis_sizes == mesh.axis_sizes:
        return context
    raise RuntimeError(
        f"{target}: on GPU the mesh's devices must be known when compiling; pass a concrete jax.sharding.Mesh "
        "to jax.shard_map, or compile under jax.set_mesh(mesh)")


# ---- global view (outside shard_map) -----------------------------------------------------------------------

def global_view(op_fn: Callable, args: tuple, axis_name, op: str, in_specs, out_specs):
    """Runs ``op_fn`` per shard when called on global arrays outside ``shard_map``.

    The mesh is the one in context (``jax.set_mesh``) or the one the arrays are sharded on; the leading
    dimension of every array is split over ``axis_name`` (``in_specs`` / ``out_specs``), so each device works
    on its own shard and nothing is gathered onto one device.
    """
    mesh = _mesh_with_axis(args, axis_name)
    if mesh is None:
        raise NameError(
            f"jax_ncclx.{op}: unbound axis name {axis_name!r}. Call it inside jax.shard_map over a mesh with "
            f"that axis, or on arrays sharded over a mesh axis named {axis_name!r} (e.g. under jax.set_mesh)"
        )
    _check_global_arguments(args, mesh, axis_name, op, in_specs)
    return jax.shard_map(op_fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)


def _check_global_arguments(args, mesh, axis_name, op: str, in_specs):
    """Refuses, by argument, what ``shard_map`` would refuse with an error about ``in_specs`` that the caller
    never wrote: an array whose leading dimension does not split into one block per member, and, on a mesh
    whose axes are explicit (``jax.make_mesh``'s default), where ``shard_map`` does not reshard its inputs, an
    array sharded otherwise than ``in_specs``."""
    specs = in_specs if isinstance(in_specs, tuple) else (in_specs,) * len(args)
    members = int(np.prod([mesh.shape[name] for name in axes_of(axis_name)]))
    for position, (arg, spec) in enumerate(zip(args, specs)):
        for leaf in jax.tree.leaves(arg):
            aval = jax.typeof(leaf)
            if set(axes_of(axis_name)) <= _explicit_axes(aval):
                have, want = _padded_spec(aval.sharding.spec, aval.ndim), _padded_spec(spec, aval.ndim)
                if have != want:
                    raise ValueError(
                        f"jax_ncclx.{op}: outside shard_map it runs per shard of arrays whose leading dimension is "
                        f"sharded over {axis_name!r}, and nothing else; argument {position} is sharded "
                        f"{_spec_text(have)}. Reshard it first (jax.reshard(arg, {_spec_text(want)})) or call {op} "
                        "inside jax.shard_map")
            if aval.ndim == 0 or aval.shape[0] % members:
                raise ValueError(
                    f"jax_ncclx.{op}: outside shard_map every argument's leading dimension holds the {members} "
                    f"members' blocks of {axis_name!r}, so it must be a multiple of {members}; argument {position} "
                    f"has shape {tuple(aval.shape)}")


def _explicit_axes(aval) -> set:
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is None:
        return set()
    return {name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == jax.sharding.AxisType.Explicit}


def _spec_text(entries: tuple) -> str:
    while entries and entries[-1] is None:
        entries = entries[:-1]
    return f"P({', '.join(map(repr, entries))})"


def _padded_spec(spec, ndim: int) -> tuple:
    entries = [entry[0] if isinstance(entry, tuple) and len(entry) == 1 else entry for entry in spec]
    return tuple(entries) + (None,) * (ndim - len(entries))


def _mesh_with_axis(args, axis_name):
    def has_axes(mesh):
        return mesh is not None and not mesh.empty and set(axes_of(axis_name)) <= set(mesh.axis_names)

    concrete = compat.concrete_context_mesh()
    if has_axes(concrete):
        return concrete
    context = jax.sharding.get_abstract_mesh()
    if has_axes(context):
        return context
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and has_axes(sharding.mesh):
            return sharding.mesh
        mesh = getattr(jax.typeof(leaf).sharding, "mesh", None)
        if has_axes(mesh):
            return mesh
    return None
