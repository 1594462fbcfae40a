"""Fault injection (``JAX_NCCLX_FAULT``): hands the parsed faults (:class:`config.Fault`) to the extension module
that runs the program being lowered. The handlers apply them by rank and call number
(``xla_ffi/common/monitor.h``); with none set, a handler pays one relaxed atomic load.
"""

import logging

from jax_ncclx._src import config
from jax_ncclx._src import contract

logger = logging.getLogger("jax_ncclx")

_installed: dict[int, tuple] = {}  # id(module) -> faults it holds


def install(module, faults: tuple[config.Fault, ...]):
    """Makes ``module`` inject exactly ``faults`` from now on (no call when they are already installed)."""
    if _installed.get(id(module), ()) == faults:
        return
    module.set_faults([(contract.FAULT_KINDS.index(f.kind), f.rank, f.seq, f.ms) for f in faults])
    _installed[id(module)] = faults
    if faults:
        logger.warning("jax_ncclx: injecting faults (JAX_NCCLX_FAULT): %s", config.describe_faults(faults))
