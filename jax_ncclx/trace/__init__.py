"""Collective tracing: ``JAX_NCCLX_TRACE=1`` records every jax_ncclx call (see :mod:`jax_ncclx._src.trace`).

* :func:`records` — the calls traced in this process;
* :func:`dump` — Chrome-trace / Perfetto JSON of them, one file per process;
* :func:`summary` — latency percentiles per op;
* :func:`merge` / ``python -m jax_ncclx.trace merge DUMP...`` — per collective, the slowest rank and any
  rank that never started;
* :func:`device_timeline` — the NVLink kernels' own GPU timelines.
"""

from jax_ncclx._src.trace import device_timeline as device_timeline
from jax_ncclx._src.trace import dump as dump
from jax_ncclx._src.trace import merge as merge
from jax_ncclx._src.trace import records as records
from jax_ncclx._src.trace import reset as reset
from jax_ncclx._src.trace import summary as summary

__all__ = ["device_timeline", "dump", "merge", "records", "reset", "summary"]
