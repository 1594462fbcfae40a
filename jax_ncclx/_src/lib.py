"""Loads the compiled extension modules and registers their FFI targets with XLA, exactly once.

``_ncclx_cpu`` is always built and registered at import. ``_ncclx_cuda`` exists only in a CUDA build; it is
imported the first time a collective is lowered for a GPU (after JAX's CUDA plugin has loaded the CUDA runtime
and NCCL that the module links against), or when ``build_info()`` is asked.
"""

import atexit
import functools
import logging

import jax

import os

try:
    from jax_ncclx import _build_config
    from jax_ncclx import _ncclx_cpu
except ImportError as e:  # the source tree has no built modules: say so rather than a circular-import riddle
    _here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise ImportError(
        f"jax_ncclx: imported from {_here}, a source tree without the built modules. Run Python from another "
        "directory to use the installed package, or build into this tree with `pip install -e .` (tools/dev.sh "
        "does)") from e  # the cause, chained, says which module is missing

from jax_ncclx._src import compat  # noqa: E402 - after the check above

logger = logging.getLogger("jax_ncclx")

for _name, _registration in _ncclx_cpu.types().items():
    compat.register_ffi_type_now(_name, _registration)
for _name, _capsule in _ncclx_cpu.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")


@functools.cache
def _load_cuda():
    """Returns (module, None) or (None, reason it is unavailable)."""
    if _build_config.CUDA_STATUS != "built":
        return None, f"this jax_ncclx was built without CUDA: {_build_config.CUDA_STATUS}"
    try:
        jax.devices()  # initialise JAX's backends first: the CUDA plugin loads libcudart and libnccl
        from jax_ncclx import _ncclx_cuda
    except ImportError as e:
        hint = (" (NCCL's runtime, needed on GPU machines only: pip install nvidia-nccl-cu13, or install "
                "jax_ncclx[cuda]; on a machine without a GPU, JAX_NCCLX_CUDA=OFF builds without CUDA)"
                if "nccl" in str(e) else "")
        return None, f"the CUDA module failed to load: {e}{hint}"
    for name, capsule in _ncclx_cuda.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    atexit.register(_ncclx_cuda.stop_watchdog)  # before the CUDA runtime goes away
    logger.debug("jax_ncclx CUDA handlers registered (NCCL %s)", _ncclx_cuda.nccl_version())
    return _ncclx_cuda, None


def cpu_module():
    """The CPU extension module (always built)."""
    return _ncclx_cpu


def cuda_module():
    """The CUDA extension module; raises RuntimeError saying why when this build or machine lacks it."""
    module, reason = _load_cuda()
    if module is None:
        raise RuntimeError(
            f"jax_ncclx cannot run collectives on GPU: {reason}. Rebuild on a machine with nvcc and the "
            "nvidia-nccl-cu13 wheel (pip install --no-build-isolation -e . ; JAX_NCCLX_CUDA=ON makes a "
            "missing CUDA toolchain a build error)."
        )
    return module


def cuda_module_if_available():
    """The CUDA extension module, or None when this build or machine lacks it."""
    return _load_cuda()[0]


@functools.cache
def _cuda_handlers() -> dict:
    module = cuda_module_if_available()
    if module is None:
        return {}
    return {(op, transport, cmdbuf, watched): target for op, transport, cmdbuf, watched, target in
            module.handler_table()}


def cuda_target(op: str, transport: str, *, cmdbuf: bool = False, watched: bool = False) -> str | None:
    """The FFI target of ``op``'s CUDA handler on ``transport`` ("nccl", "nvlink" or "local"), in the variant
    asked for (``cmdbuf``: the NCCL handler marked command-buffer compatible; ``watched``: with the prepare
    stage that refuses an execution on a failed communicator), from the CUDA module's handler table; None
    where there is no such handler (or no CUDA module)."""
    return _cuda_handlers().get((op, transport, cmdbuf, watched))


# How to build what only the tests and benchmarks use (CMakeLists.txt), for their messages when it is absent.
TESTING_BUILD_HINT = ("rebuild with the test-only modules: JAX_NCCLX_TESTING=ON pip install --no-build-isolation "
                      "--no-deps -e .  (tools/dev.sh and tools/gpu_check.sh set it)")


def testing_built() -> bool:
    """Whether this build has the test-only modules (JAX_NCCLX_TESTING=ON with the CUDA handlers)."""
    return getattr(_build_config, "TESTING_STATUS", "") == "built"


def build_info() -> dict:
    """What this installation of jax_ncclx can do.

    Returns:
      A dict with ``cpu`` (always True), ``cuda`` (True when the CUDA/NCCL handlers are built and their
      module loads, which needs the CUDA runtime and NCCL libraries, not a GPU: a machine without one reports
      True and skips the GPU tests),
      ``cuda_status`` (why not, otherwise "built"), ``testing`` (True when the test-only modules were built too:
      ``_ncclx_loopback`` and the launch probe, with ``JAX_NCCLX_TESTING=ON``), ``nccl_version`` /
      ``nccl_build_version`` (ints like 22809, or None), ``ffi_api_version`` of the XLA headers compiled
      against, and ``jax_version``.
    """
    module, reason = _load_cuda()
    return {
        "cpu": True,
        "cuda": module is not None,
        "cuda_status": "built" if module is not None else reason,
        "testing": testing_built(),
        "nccl_version": module.nccl_version() if module else None,
        "nccl_build_version": module.nccl_build_version() if module else None,
        "ffi_api_version": tuple(_ncclx_cpu.ffi_api_version()),
        "jax_version": jax.__version__,
    }
