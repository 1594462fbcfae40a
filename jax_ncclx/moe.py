"""MoE dispatch and combine over an expert-parallel mesh axis, for use inside ``jax.shard_map``.

``dispatch`` sends each token's top-k rows to the members that own the chosen experts, grouped by local
expert for ``jax.lax.ragged_dot``. ``combine`` sends the expert outputs back and sums them with the router
weights. Each is one exchange, its counts kept on the device: one NVLink kernel where it can run, otherwise one
``all_to_allv_dynamic`` call between routing kernels. Each is the other's backward pass.
"""

from jax_ncclx._src.ops.moe import DispatchHandle as DispatchHandle
from jax_ncclx._src.ops.moe import combine as combine
from jax_ncclx._src.ops.moe import dispatch as dispatch
from jax_ncclx._src.ops.moe_masked import MaskedHandle as MaskedHandle

__all__ = ["DispatchHandle", "MaskedHandle", "combine", "dispatch"]
