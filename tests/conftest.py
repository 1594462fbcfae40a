"""Test setup: 8 virtual CPU devices for the CPU backend, and a ``backend`` fixture that runs each test on
CPU and, where GPUs and the CUDA build exist, on GPU (those params are marked ``gpu``); ``one_device`` does
the same with one device, for the local ops.

Which tests run where (the hooks at the end): where no GPU is, the GPU tests are not collected; and the slow
cases (marker ``slow``) run only with ``--slow``, as CI and tools/gpu_check.sh run them. Both are counted in
one line at the end of the run."""

import collections
import os
import subprocess
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
for _var in ("NCCL_NVLS_ENABLE", "NCCL_NVLINK_MULTICAST_ENABLE"):
    os.environ[_var] = "0"  # NVLink multicast stays off on the shared GPU machines

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

NUM_CPU_DEVICES = 8


def gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def gpu_skip_reason(minimum=2):
    import jax_ncclx

    if len(gpu_devices()) < minimum:
        return f"needs at least {minimum} GPU{'s' if minimum > 1 else ''}"
    info = jax_ncclx.build_info()
    return None if info["cuda"] else f"jax_ncclx CUDA build unavailable: {info['cuda_status']}"


# XLA_FLAGS that record custom calls into XLA's command buffers (CUDA graphs), even programs of one call.
CAPTURE_FLAGS = "--xla_gpu_enable_command_buffer=+CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"


def run_command_buffer_worker(script, *args, minimum=2, xla_flags=CAPTURE_FLAGS, **env):
    """Runs tests/<script> with ``args`` in its own process with custom calls captured into CUDA graphs
    (``xla_flags``: XLA reads them when JAX starts) and ``env`` set; fails unless it prints CAPTURE OK. Skips
    where fewer than ``minimum`` GPUs are."""
    reason = gpu_skip_reason(minimum)
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", **env, XLA_FLAGS=xla_flags)
    done = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), script), *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "CAPTURE OK" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def mesh_2d(devices):
    """A ("a", "b") mesh: 2 x n/2 (or 1 x n for fewer than 4 devices), Auto axis types."""
    n = len(devices)
    shape = (2, n // 2) if n >= 4 else (1, n)
    grid = np.asarray(devices[: shape[0] * shape[1]]).reshape(shape)
    return jax.sharding.Mesh(grid, ("a", "b"))


def skip_degenerate_tuple(mesh, axis):
    """Skips a case over a tuple of mesh axes when one of them has size 1 (mesh_2d of 2 or 3 GPUs): the tuple
    is then its other axis alone, a case that already runs, and says nothing of how the tuple orders members."""
    if isinstance(axis, tuple) and len(axis) > 1 and min(mesh.shape[name] for name in axis) == 1:
        pytest.skip(f"axes {axis} on a {dict(mesh.shape)} mesh are one axis: tuples of axes need a 2 x n mesh "
                    "(4 or more GPUs; the CPU runs have one)")


def backend_devices(request, minimum_gpus: int = 2):
    """The devices of the backend a fixture's param names: "cpu" (8 virtual devices) or "gpu" (all local
    GPUs, skipped with fewer than ``minimum_gpus``)."""
    if request.param == "gpu":
        reason = gpu_skip_reason(minimum=minimum_gpus)
        if reason:
            pytest.skip(reason)
        return gpu_devices()
    return jax.devices("cpu")


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def backend(request):
    """Devices of one backend: "cpu" (8 virtual devices) or "gpu" (all local GPUs, at least 2)."""
    return backend_devices(request)


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def any_backend(request):
    """As ``backend``, but one GPU is enough: an axis of one member still runs the op's kernels."""
    return backend_devices(request, minimum_gpus=1)


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def one_device(request):
    """One device of a backend, for the local ops (no communication): CPU, or the first GPU of any machine
    with one."""
    return backend_devices(request, minimum_gpus=1)[0]


@pytest.fixture
def mesh(backend):
    return mesh_2d(backend)


# ---- which tests run where -------------------------------------------------------------------------------------
#
# Slow cases are the tests marked slow by hand (end-to-end tools, 16 devices, JAX's own pmap-in-vmap suites)
# and the exhaustive part of every parametrized test of EXHAUSTIVE_FROM cases or more: by default such a test
# runs the cases that differ from its first case in at most one parameter, so that every value of every
# parameter runs once; the cases that combine two or more non-first values (every dtype with every op and
# axis, ...) are marked slow. The platform fixtures (backend, line, ...) are not parameters here: the gpu
# marker governs them.

EXHAUSTIVE_FROM = 4
_LEFT_OUT = pytest.StashKey[dict]()


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the slow cases (marker slow: the exhaustive parametrizations and end-to-end "
                          "tools, tests/conftest.py); CI does")


def _parameter_indices(item) -> tuple:
    """Which value of each of its @pytest.mark.parametrize a case takes (0: the first)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return ()
    indices = []
    for mark in item.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", "")
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if names and names[0] in callspec.indices:
            indices.append(callspec.indices[names[0]])
    return tuple(indices)


def _named_on_command_line(config) -> list[str]:
    """Node ids given on the command line (path::name...), relative to the root like item.nodeid: what they
    name runs even when slow."""
    named = []
    for arg in config.args:
        path, sep, rest = arg.partition("::")
        if sep:
            relative = os.path.relpath(os.path.abspath(path), str(config.rootpath)).replace(os.sep, "/")
            named.append(f"{relative}::{rest}")
    return named


@pytest.hookimpl(tryfirst=True)  # before -m filters, so that `-m slow` sees the markers added here
def pytest_collection_modifyitems(config, items):
    def family(item):
        return item.nodeid.split("[")[0]

    cases = collections.defaultdict(set)
    for item in items:
        cases[family(item)].add(_parameter_indices(item))
    for item in items:
        if len(cases[family(item)]) >= EXHAUSTIVE_FROM and sum(i != 0 for i in _parameter_indices(item)) > 1:
            item.add_marker(pytest.mark.slow)

    markexpr = config.getoption("markexpr") or ""
    run_slow = config.getoption("slow") or "slow" in markexpr
    drop_gpu = "gpu" not in markexpr and not gpu_devices()
    named = _named_on_command_line(config)
    kept, dropped, left_out = [], [], {"gpu": 0, "slow": 0}
    for item in items:
        reason = None
        if any(item.nodeid == n or item.nodeid.startswith((n + "[", n + "::")) for n in named):
            pass
        elif drop_gpu and item.get_closest_marker("gpu"):
            reason = "gpu"
        elif not run_slow and item.get_closest_marker("slow"):
            reason = "slow"
        if reason is None:
            kept.append(item)
        else:
            left_out[reason] += 1
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    config.stash[_LEFT_OUT] = left_out


def pytest_terminal_summary(terminalreporter, config):
    left_out = config.stash.get(_LEFT_OUT, {})
    parts = []
    if left_out.get("gpu"):
        parts.append(f"{left_out['gpu']} GPU tests (no GPU here)")
    if left_out.get("slow"):
        parts.append(f"{left_out['slow']} slow cases (run them with --slow, as CI does)")
    if parts:
        terminalreporter.write_line("jax_ncclx: not run: " + "; ".join(parts))
