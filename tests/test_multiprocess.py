"""One process per GPU: every op through communicators bootstrapped over jax.distributed (GPU machines only)."""

import os
import socket
import subprocess
import sys

import pytest

from conftest import gpu_devices, gpu_skip_reason

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]

WORKER = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("visibility", ["one", "all"])
def test_one_process_per_gpu(visibility):
    """visibility "one": each process sees only its GPU (NVLink kernels fall back to NCCL); "all": every GPU is
    visible, JAX uses one per process, and all_to_allv_dynamic's NVLink kernel maps its peers via CUDA IPC."""
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    n, port = len(gpu_devices()), free_port()
    procs = []
    for pid in range(n):
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", JAX_PLATFORMS="cuda")
        env.pop("JAX_NCCLX_TRANSPORT", None)
        if visibility == "one":
            env["CUDA_VISIBLE_DEVICES"] = str(pid)
        procs.append(subprocess.Popen([sys.executable, WORKER, str(pid), str(n), str(port), visibility], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            outputs.append(proc.communicate()[0] + "\nTIMED OUT")
    for pid, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0 and "WORKER OK" in out, f"process {pid}:\n{out[-4000:]}"
