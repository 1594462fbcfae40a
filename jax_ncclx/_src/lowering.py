"""How a jax_ncclx op lowers to this package's FFI custom calls, written once.

* CPU: the target gets this device's partition id as its first operand, plus the replica groups (partition
  ids), a call-site id and the timeout as attributes; the handlers meet in-process (``xla_ffi/common``).
* CUDA: the target gets the ``comm_id`` of an NCCL communicator made for exactly these groups (``comm.py``).
  An op may route its CUDA lowering (:class:`CudaRoute`): pick another target (e.g. its NVLink kernel),
  add attributes, and ask for a workspace result that XLA allocates and the lowering drops; or, for a fused
  op, lower to the same computation in other ops (``fallback``) where its kernel cannot run. Routes only
  decide; the communicator's set-up steps happen here, in the open: its NVLink connection before routing an
  op that has an NVLink kernel (``comm.connect_nvlink``), its symmetric memory grown to an NVLink route's
  sizes after (``comm.grow_symmetric``), its NCCL communicators made for an NCCL route (``comm.ensure_nccl``).

Local ops (no communication) use :func:`register_local_lowerings`: the same FFI target on both platforms, no
groups and no communicator.
"""

import dataclasses
import functools
import itertools
import logging
import os
from collections.abc import Callable

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jax_ncclx._src import comm
from jax_ncclx._src import compat
from jax_ncclx._src import config
from jax_ncclx._src import contract
from jax_ncclx._src import faults
from jax_ncclx._src import lib
from jax_ncclx._src import trace
from jax_ncclx._src import validation

logger = logging.getLogger("jax_ncclx")

_call_site_ids = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class CudaRoute:
    """How one CUDA call site lowers: the transport whose handler it takes ("nccl" or "nvlink"; the target
    comes from the CUDA module's handler table, :func:`lib.cuda_target`), extra attributes, the byte size of a
    workspace result (None: the handler takes none), the operands the target takes, by index (None: all),
    and, for an NVLink kernel, the symmetric memory it needs (``staging_bytes`` of all_to_allv staging,
    ``slot_bytes`` of low-latency slots per call parity), which lowering grows the communicator's to.

    A route only decides: the op's ``cuda_route`` reads the communicator's NVLink answer
    (:func:`nvlink.usable`) and sizes, and allocates nothing."""

    transport: str = "nccl"
    attrs: dict = dataclasses.field(default_factory=dict)
    workspace_bytes: int | None = None
    operands: tuple[int, ...] | None = None
    staging_bytes: int = 0
    slot_bytes: int = 0


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
    groups = compat.replica_groups(axis_context, validation.axes_of(axis_name))
    for aval in ctx.avals_in:  # also for primitives bound directly, past the public functions' checks
        validation.check_whole_bytes(aval.dtype, op)
    settings = config.current()
    site = next(_call_site_ids)
    op_attrs = attrs(**params)
    # Every handler takes this dictionary (xla_ffi/common/monitor.h, RawCallAttrs).
    op_attrs["call"] = dict(site=np.int64(site), timeout_ms=np.int64(settings.timeout_ms_for(timeout_op)),
                            warn_ms=np.int64(settings.warn_ms), trace=np.int64(settings.trace_attr))
    avals_in, avals_out = list(ctx.avals_in), list(ctx.avals_out)
    site_info = dict(op=op, axis=str(axis_name), platform=platform, bytes=_nbytes(ctx.avals_in[0]),
                     dtype=str(ctx.avals_in[0].dtype))
    if platform == "cpu":
        _check_one_process(op, axis_context.mesh, groups)
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
        if settings.transport != "nccl" and lib.cuda_target(op, "nvlink"):
            comm.connect_nvlink(comm_id)  # once per communicator: what its routes read
        route = cuda_route(ctx, comm_id, len(groups[0]), **params) if cuda_route is not None else CudaRoute()
        if route is None:
            return _lower_fallback(ctx, operands, fallback, axis_name, params)
        if route.operands is not None:
            operands = tuple(operands[i] for i in route.operands)
            avals_in = [avals_in[i] for i in route.operands]
        op_attrs.update(route.attrs, comm_id=np.int64(comm_id))
        if route.workspace_bytes is not None:
            avals_out.append(jax.core.ShapedArray((route.workspace_bytes,), np.uint8))
        nvlink = route.transport == "nvlink"
        cmdbuf = False
        if nvlink:
            comm.grow_symmetric(comm_id, staging_bytes=route.staging_bytes, slot_bytes=route.slot_bytes)
        else:
            comm.ensure_nccl(comm_id)
            # The dense ops' NCCL handlers come twice, once marked command-buffer compatible
            # (xla_ffi/ops/collectives/collectives_cuda.cc; all_to_allv_dynamic's is not among them).
            if settings.nccl_command_buffers and lib.cuda_target(op, "nccl", cmdbuf=True):
                if config.xla_records_loops() and compat.lowering_may_be_inside_control_flow():
                    # NCCL's graph-mixing nodes make XLA's loop and conditional graphs fail to instantiate
                    # (docs/sharp_bits.md): this call stays out of graphs, the rest of the body stays in.
                    logger.info("jax_ncclx: %s call site %d sits in a loop or conditional that XLA records into "
                                "a command buffer, or in a jitted function that one may call: it runs from the "
                                "host, not from the graph", op, site)
                else:
                    cmdbuf = True
                    module.set_watch_replays(settings.watch_replays)  # read when XLA captures the call
        # Handlers XLA may record into CUDA graphs also come watched: with a prepare stage that refuses an
        # execution on a failed communicator (xla_ffi/common/cuda_collective.h), at a host cost in every execution.
        watched = settings.watch_replays and lib.cuda_target(op, route.transport, cmdbuf=cmdbuf, watched=True)
        target = lib.cuda_target(op, route.transport, cmdbuf=cmdbuf, watched=bool(watched))
        if target is None:
            raise NotImplementedError(f"jax_ncclx.{op}: this build has no CUDA handler for it on {route.transport}")
        names = {contract.ONE_SHOT: "one_shot", contract.TWO_SHOT: "two_shot"}
        algorithm = names.get(int(route.attrs.get("algorithm", contract.ONE_SHOT))) if nvlink else "nccl"
        site_info.update(groups=[[mesh_devices[p].id for p in g] for g in groups], comm_id=comm_id,
                         transport="nvlink" if nvlink else "nccl", algorithm=algorithm)
    _check_results_fit(op, avals_out, platform, None if platform == "cpu" else mesh_devices[0])
    trace.register_call_site(module, site, site_info)
    faults.install(module, settings.faults)
    faults.warn_past_ranks(settings.faults, len(groups[0]), op)
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
            validation.check_whole_bytes(aval.dtype, target.removeprefix("ncclx_"))
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
            raise ValueError(f"jax_ncclx.{op}: result {index} per device ({aval.dtype}{list(aval.shape)}) needs "
                             f"{_nbytes(aval)} bytes, more than {where} ({limit} bytes).{_SIZED_BY.get(op, '')}")


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _check_one_process(op: str, mesh, groups):
    """The CPU backend meets its participants in one process: a group of devices in several processes would
    wait for peers that never come to this process, so it is refused when the program is compiled."""
    if jax.process_count() == 1:
        return
    devices = list(mesh.devices.flat) if isinstance(mesh, jax.sharding.Mesh) else None
    spans = devices is None or any(len({devices[p].process_index for p in g}) > 1 for g in groups)
    if spans:
        raise NotImplementedError(
            f"jax_ncclx.{op}: on CPU the collectives run within one process, and this call's devices are in "
            f"{jax.process_count()} processes; use jax.lax's collectives there (nx.route_lax leaves them on "
            "jax.lax), or GPUs")


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
