"""Which transport a CUDA call site takes: an NVLink kernel of this package or NCCL.

Decided while the program is lowered, from the static shapes, the communicator and :mod:`config`:

* ``JAX_NCCLX_TRANSPORT=nccl`` always takes NCCL;
* otherwise an op with an NVLink kernel takes it when every rank of the communicator reaches every other
  through NVLink peer access (the answer of ``comm.connect_nvlink``, which lowering asks before routing; a
  communicator that cannot is logged once and uses NCCL, or raises with ``JAX_NCCLX_TRANSPORT=nvlink``);
* the small-message collectives (all_reduce, all_gather, all_to_all, reduce_scatter) take their NVLink kernels
  only up to
  ``nvlink_max_bytes`` per rank (by GPU count and op), and all_reduce switches from one-shot to two-shot above
  ``nvlink_oneshot_max_bytes`` (:func:`config.nvlink_thresholds`); small one-shot segments travel as LL words
  or LL128 lines (:func:`oneshot_protocol`). Above that, and for reductions of dtypes
  the kernels do not reduce, NCCL is the algorithm of choice, not a fallback: it is logged at debug level;
* with one process for every GPU, kernels write into the peers' outputs where that saves a copy
  (:func:`collective_direct`).
"""

import logging
from collections.abc import Callable

import jax
import numpy as np

from jax_ncclx._src import comm
from jax_ncclx._src import config
from jax_ncclx._src import contract
from jax_ncclx._src import lib
from jax_ncclx._src.lowering import CudaRoute

logger = logging.getLogger("jax_ncclx")

REDUCTIONS = ("all_reduce", "reduce_scatter")
# Ops whose one-shot call sends each peer one block of the input (nbytes / size), not all of it.
SENDS_BLOCKS = ("all_to_all", "reduce_scatter")


def usable(op: str, comm_id: int) -> bool:
    """Whether ``op`` may launch its NVLink kernel on ``comm_id``: the transport setting allows it and the
    communicator's NVLink step (``comm.connect_nvlink``, taken by lowering before it routes) found every rank
    reachable. Allocates nothing.

    Raises:
      RuntimeError: ``JAX_NCCLX_TRANSPORT=nvlink`` and the communicator cannot use NVLink (the reason is in
        the message).
    """
    settings = config.current()
    if settings.transport == "nccl":
        return False
    reason = comm.nvlink_reason(comm_id)
    if reason is None:  # a route asked before lowering connected the communicator
        raise RuntimeError(f"jax_ncclx.{op}: communicator {comm_id} was routed before its NVLink step "
                           "(comm.connect_nvlink)")
    if reason and settings.transport == "nvlink":
        raise RuntimeError(f"jax_ncclx.{op}: JAX_NCCLX_TRANSPORT=nvlink but this communicator cannot use NVLink: "
                           f"{reason}")
    return not reason


def writes_direct(settings: config.Config) -> bool:
    """Whether NVLink kernels write straight into the peers' outputs: ``nvlink_direct`` is on and one process
    drives every GPU (peers in other processes are reached through their symmetric memory only)."""
    return settings.nvlink_direct and jax.process_count() == 1


def collective_direct(op: str, algorithm: int, nbytes: int, size: int, settings: config.Config) -> bool:
    """The ``direct`` attribute of an all_reduce / all_gather / all_to_all call of ``nbytes`` per rank on ``size``
    GPUs (reduce_scatter takes none): whether it writes into the peers' outputs rather than their slots. The
    two-shot all_reduce's all-gather does whenever :func:`writes_direct` (its reduce-scatter flags bring the
    addresses); simple moves do from ``nvlink_direct_min_bytes`` copied out per receiver, since they must first
    wait for the peers to enter the call; the kernels ignore it where the data must sit in slots (one-shot
    all_reduce, LL, LL128)."""
    if not writes_direct(settings) or op == "reduce_scatter":  # it reduces what lands in its slots
        return False
    if op == "all_reduce":
        return algorithm == contract.TWO_SHOT
    segment = nbytes // size if op in SENDS_BLOCKS else nbytes
    return (size - 1) * segment >= settings.nvlink_direct_min_bytes


def oneshot_protocol(op: str, nbytes: int, size: int, settings: config.Config) -> int:
    """The protocol attribute of a one-shot call of ``nbytes`` per rank on ``size`` GPUs (0 LL128, 1 LL,
    2 simple): the one ``nvlink_protocol`` names, or with "auto" LL below :func:`config.ll128_min_bytes` per
    segment and LL128 from there. The kernel takes simple anyway for segments it cannot send as words or
    lines."""
    protocol = settings.nvlink_protocol
    if protocol == "auto":
        segment = nbytes // size if op in SENDS_BLOCKS else nbytes
        protocol = "ll128" if segment >= config.ll128_min_bytes(size, op, settings) else "ll"
    return contract.NVLINK_PROTOCOLS.index(protocol)


def kernel_route(op: str, comm_id: int, misfit: str | None, slot_bytes: int, *, label: str | None = None,
                 most_slot_bytes: int | None = None, operands: tuple[int, ...] | None = None) -> CudaRoute | None:
    """The route of ``op``'s one-kernel path (the MoE kernels), or None, which lowers the exchange chain: where
    ``misfit`` says why the kernel cannot take the call, where its ``slot_bytes`` per call parity pass
    ``most_slot_bytes``, where the transport is NCCL or where :func:`usable` says no. A misfit is logged at
    debug level, naming ``label`` (default ``op``). The handler takes ``blocks`` (``nvlink_blocks``) and
    ``operands`` (default: every operand)."""
    settings = config.current()
    if settings.transport == "nccl":
        return None
    if misfit is None and most_slot_bytes is not None and slot_bytes > most_slot_bytes:
        misfit = f"slots of {slot_bytes} bytes (more than the kernel's {most_slot_bytes})"
    if misfit is not None:
        logger.debug("jax_ncclx: %s takes the exchange chain: %s", label or op, misfit)
        return None
    if not usable(op, comm_id):
        return None
    return CudaRoute("nvlink", dict(blocks=np.int64(settings.nvlink_blocks)), slot_bytes=slot_bytes,
                     operands=operands)


def route_of(op: str) -> Callable[..., CudaRoute]:
    """The ``cuda_route`` of :func:`lowering.register_lowerings` for the dense op ``op``: its route does not
    depend on the primitive's params (an all_reduce's reduction included)."""
    return lambda ctx, comm_id, size, **params: collective_route(op, ctx, comm_id, size)


def collective_route(op: str, ctx, comm_id: int, size: int) -> CudaRoute:
    """The route of one all_reduce / all_gather / all_to_all / reduce_scatter call site: ``ctx`` is its lowering
    context, ``size`` its communicator's size. The NVLink handlers take the op's own attributes plus
    ``protocol``, ``blocks``, and ``direct`` (not reduce_scatter) and ``algorithm`` (all_reduce)."""
    x = ctx.avals_in[0]
    nbytes = int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    settings = config.current()
    oneshot_max, nvlink_max = config.nvlink_thresholds(size, op, settings)
    nccl = CudaRoute()
    if settings.transport == "nccl" or nbytes == 0 or nbytes > nvlink_max:
        return nccl
    element = np.dtype(x.dtype)  # what the kernel handles one by one: a complex number's parts in reductions
    if op in REDUCTIONS and np.issubdtype(element, np.complexfloating):
        element = np.finfo(element).dtype
    if op in REDUCTIONS and element.name not in contract.REDUCE_TYPES:  # complex numbers reduce as pairs
        logger.debug("jax_ncclx: %s of %s takes NCCL: the NVLink kernels reduce %s (and complex numbers of them)",
                     op, x.dtype, ", ".join(contract.REDUCE_TYPES))
        return nccl
    algorithm = contract.ONE_SHOT if op != "all_reduce" or nbytes <= oneshot_max else contract.TWO_SHOT
    protocol = oneshot_protocol(op, nbytes, size, settings)
    direct = collective_direct(op, algorithm, nbytes, size, settings)
    slots = lib.cuda_module().nvlink_collective_bytes(op, algorithm, protocol, nbytes, size, element.itemsize,
                                                      direct)
    if not usable(op, comm_id):
        return nccl
    # The enums (protocol, algorithm) travel as int32, as the handlers decode them (common/contract_attrs.h).
    route_attrs = dict(protocol=np.int32(protocol), blocks=np.int64(settings.nvlink_blocks))
    if op != "reduce_scatter":
        route_attrs["direct"] = np.bool_(direct)
    if op == "all_reduce":
        route_attrs["algorithm"] = np.int32(algorithm)
    return CudaRoute("nvlink", route_attrs, slot_bytes=slots)

