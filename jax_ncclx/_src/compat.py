"""Every use of JAX internals (``jax._src``) lives here, so that a JAX upgrade touches one file.

Tested with jax/jaxlib 0.11.2 (pyproject.toml takes 0.11.x; the GPU machines have 0.11.2).
"""

import logging
import sys

import jax

from jax._src import config as _config
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import distributed as _distributed
from jax._src import mesh as _mesh
from jax._src import pjit as _pjit
from jax._src.interpreters import pxla as _pxla
from jax._src.lax.control_flow import conditionals as _conditionals
from jax._src.lax.control_flow import loops as _loops
from jax._src.lib.mlir.dialects import hlo as _hlo
from jax._src.sharding_impls import SPMDAxisContext

NamedAxisEffect = _core.NamedAxisEffect


def register_ffi_type_now(name: str, registration: dict, platform: str = "cpu") -> None:
    """Registers an FFI state type with XLA at once. ``jax.ffi.register_ffi_type`` defers it to the CPU
    client's creation, which registers the deferred handlers first, and XLA refuses a type registered after
    the handlers that use it (jaxlib 0.11.2's ``make_cpu_client``)."""
    from jaxlib import xla_client

    if platform != "cpu":
        raise ValueError(f"register_ffi_type_now: platform {platform!r} (only 'cpu' is needed)")
    xla_client._xla.register_custom_type(name, registration)


def apply_primitive(prim, *args, **params):
    """Evaluates ``prim`` eagerly (compiled on its own), as ``jax.lax`` primitives do outside ``jit``."""
    return _dispatch.apply_primitive(prim, *args, **params)


def axis_is_bound(axis_name) -> bool:
    """Whether ``axis_name`` is a manual axis of an enclosing ``shard_map`` (or a vmap axis)."""
    return _core.get_axis_env().axis_exists(axis_name)


def check_vma_enabled() -> bool:
    """Whether the enclosing ``shard_map`` tracks varying manual axes (``check_vma=True``)."""
    return bool(_config._check_vma.value)


def varying_axes(aval) -> frozenset:
    return frozenset(aval.mat.varying)


def with_varying_axes(aval, varying):
    return aval.update(manual_axis_type=aval.mat.update(varying=frozenset(varying)))


def replica_groups(axis_context, axes: tuple) -> tuple[tuple[int, ...], ...]:
    """Partition ids of every group along the mesh axes ``axes``, each group in axis-index order (over several
    axes the first is major, as ``jax.lax.axis_index`` of the tuple)."""
    groups = _pxla.axis_groups(axis_context, axes)
    return tuple(tuple(int(p) for p in group) for group in groups)


def is_spmd_axis_context(axis_context) -> bool:
    return isinstance(axis_context, SPMDAxisContext)


def automatic_axes(axis_context) -> tuple:
    """The axes of size > 1 of an SPMD axis context's mesh that its jax.shard_map left to the compiler
    (``axis_names`` naming only some)."""
    mesh = axis_context.mesh
    return tuple(name for name in mesh.axis_names if name not in axis_context.manual_axes and mesh.shape[name] > 1)


def partition_id():
    """MLIR value of this device's partition id (a ``tensor<ui32>``), for use inside a lowering rule."""
    return _hlo.partition_id()


def distributed_client():
    """JAX's coordination-service client (key-value store), or None without ``jax.distributed``."""
    return _distributed.global_state.client


def concrete_context_mesh():
    """The concrete mesh set by ``jax.set_mesh`` (empty when none is)."""
    return _mesh.get_concrete_mesh()


# The lowering rules of lax.while_loop (fori_loop and scan lower through it) and lax.cond / lax.switch, and the
# lowering of a nested jitted function's body into a function of its own. A JAX that renamed them gets the
# conservative answer below, logged once: tests/test_loops.py (test_control_flow_is_seen_from_lowering_rules)
# fails on such a JAX, and on one that lowers loops through other functions.
try:
    _CONTROL_FLOW_CODE = frozenset({_loops._while_lowering.__code__, _conditionals._cond_lowering.__code__,
                                    _pjit._pjit_lower_jaxpr_to_fun.__code__})
except AttributeError as _missing:
    _CONTROL_FLOW_CODE = None
    logging.getLogger("jax_ncclx").warning(
        "jax_ncclx: this JAX (%s) lacks the control-flow lowering rules jax_ncclx looks for (%s), so every NCCL "
        "call site is treated as if inside a loop: none is recorded into XLA's command buffers", jax.__version__,
        _missing)


def lowering_may_be_inside_control_flow() -> bool:
    """Whether the call whose lowering rule calls this may run inside the body of a loop or a branch of a
    conditional: one of JAX's control-flow lowering rules is on the Python stack (their bodies lower inline),
    or the lowering of a nested jitted function's body, which JAX lowers once per module, where it first meets
    the function, and then calls from every place that uses it, loop bodies included. True on a JAX without
    those rules (see above)."""
    if _CONTROL_FLOW_CODE is None:
        return True
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _CONTROL_FLOW_CODE:
            return True
        frame = frame.f_back
    return False
