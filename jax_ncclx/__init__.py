"""jax_ncclx: NCCLX-style collectives for JAX, as primitives that run inside ``jax.shard_map``.

Every op mirrors its ``jax.lax`` counterpart and works under ``jax.jit``, ``jax.vmap`` and ``jax.grad``, on the
CPU backend (N virtual devices) and on NVIDIA GPUs, through NVLink kernels or NCCL.
"""

from jax_ncclx import moe as moe
from jax_ncclx import trace as trace
from jax_ncclx._src.comm import init as init
from jax_ncclx._src.comm import memory_stats as memory_stats
from jax_ncclx._src.comm import shutdown as shutdown
from jax_ncclx._src.health import CollectiveError as CollectiveError
from jax_ncclx._src.health import check_errors as check_errors
from jax_ncclx._src.lib import build_info as build_info
from jax_ncclx._src.ops.all_gather import all_gather as all_gather
from jax_ncclx._src.ops.all_reduce import all_reduce as all_reduce
from jax_ncclx._src.ops.all_to_all import all_to_all as all_to_all
from jax_ncclx._src.ops.all_to_allv_dynamic import all_to_allv_dynamic as all_to_allv_dynamic
from jax_ncclx._src.ops.ppermute import ppermute as ppermute
from jax_ncclx._src.ops.reduce_scatter import reduce_scatter as reduce_scatter
from jax_ncclx._src.ops.ragged_all_to_all import ragged_all_to_all as ragged_all_to_all
from jax_ncclx._src.route_lax import route_lax as route_lax

__version__ = "0.1.0"

__all__ = ["CollectiveError", "all_gather", "all_reduce", "all_to_all", "all_to_allv_dynamic", "build_info",
           "check_errors", "init", "memory_stats", "moe", "ppermute", "ragged_all_to_all", "reduce_scatter",
           "route_lax", "shutdown", "trace"]
