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


def test_one_process_per_gpu():
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    n, port = len(gpu_devices()), free_port()
    procs = []
    for pid in range(n):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(pid), NCCL_NVLS_ENABLE="0", JAX_PLATFORMS="cuda")
        procs.append(subprocess.Popen([sys.executable, WORKER, str(pid), str(n), str(port)], env=env,
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
