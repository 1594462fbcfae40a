"""Fault injection (``JAX_NCCLX_FAULT``): hands the parsed faults (:class:`config.Fault`) to the extension module
that runs the program being lowered. The handlers apply them by rank and call number
(``xla_ffi/common/monitor.h``); with none set, a handler pays one relaxed atomic load.
"""

import logging

from jax_ncclx._src import config
from jax_ncclx._src import contract

logger = logging.getLogger("jax_ncclx")

_installed: dict[int, tuple] = {}  # id(module) -> faults it holds
_warned_ranks: set[tuple[int, int]] = set()  # (rank, size) pairs already reported


def install(module, faults: tuple[config.Fault, ...]):
    """Makes ``module`` inject exactly ``faults`` from now on (no call when they are already installed)."""
    if _installed.get(id(module), ()) == faults:
        return
    module.set_faults([(contract.FAULT_KINDS.index(f.kind), f.rank, f.seq, f.ms) for f in faults])
    _installed[id(module)] = faults
    if faults:
        logger.warning("jax_ncclx: injecting faults (JAX_NCCLX_FAULT): %s", config.describe_faults(faults))


def warn_past_ranks(faults: tuple[config.Fault, ...], size: int, op: str):
    """Logs a warning, once per rank and size, for a fault whose rank no member of an ``op`` call of ``size``
    ranks has: it can never apply to that call."""
    for rank in sorted({f.rank for f in faults if f.rank >= size and (f.rank, size) not in _warned_ranks}):
        _warned_ranks.add((rank, size))
        logger.warning("jax_ncclx: JAX_NCCLX_FAULT names rank %d, but %s's communicator has ranks 0 to %d: the "
                       "fault never applies to it", rank, op, size - 1)
