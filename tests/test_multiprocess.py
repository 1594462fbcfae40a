"""One process per GPU: every op through communicators bootstrapped over jax.distributed (GPU machines only)."""

import os
import re
import socket
import subprocess
import sys

import pytest

from conftest import CAPTURE_FLAGS, gpu_devices, gpu_skip_reason

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]

WORKER = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("visibility,captured", [("one", False), ("all", False), ("all", True)])
def test_one_process_per_gpu(visibility, captured):
    """visibility "one": each process sees only its GPU (NVLink kernels fall back to NCCL); "all": every GPU is
    visible, JAX uses one per process, and all_to_allv_dynamic's NVLink kernel maps its peers via CUDA IPC.
    captured: XLA records the custom calls into command buffers (CUDA graphs), NVLink and NCCL handlers alike."""
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
        if captured:
            env["XLA_FLAGS"] = CAPTURE_FLAGS
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


FAULT_WORKER = os.path.join(os.path.dirname(__file__), "fault_worker.py")


@pytest.mark.parametrize("transport", ["nvlink", "nccl"])
@pytest.mark.parametrize("scenario", ["skip", "kill"])
def test_fault_in_one_process_is_reported_by_the_others(scenario, transport):
    """The last rank skips an all_reduce, or its process dies before it: every other process gets an error
    within seconds (timeout 3 s) and exits, with an error naming the missing rank: the NVLink kernels know it
    on the device; for NCCL, nx.check_errors asks the other processes through JAX's key-value store."""
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    n, port = len(gpu_devices()), free_port()
    procs = [subprocess.Popen([sys.executable, FAULT_WORKER, str(pid), str(n), str(port), scenario, transport],
                              env=dict(os.environ, NCCL_NVLS_ENABLE="0", JAX_PLATFORMS="cuda"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in range(n)]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            outputs.append(proc.communicate()[0] + "\nTIMED OUT")
    expected = (rf"rank\(s\) {n - 1}\b" if transport == "nvlink" else
                rf"in other processes: rank\(s\) {n - 1} (did not report their progress|never reached it)")
    wrong = []
    for pid, (proc, out) in enumerate(zip(procs, outputs)):
        if pid == n - 1:
            ok = ("SKIPPED" if scenario == "skip" else "KILLED") in out
        else:
            ok = proc.returncode == 0 and "FAULT REPORTED" in out and re.search(expected, out)
        if not ok:
            wrong.append(pid)
    assert not wrong, f"process(es) {wrong} wrong; every output:\n" + "\n".join(
        f"--- process {pid} (exit {proc.returncode}):\n{out[-3000:]}"
        for pid, (proc, out) in enumerate(zip(procs, outputs)))
