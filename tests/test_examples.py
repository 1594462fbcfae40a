"""The examples run end to end on the CPU backend (8 virtual devices) with small sizes, and check themselves."""

import os
import socket
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


@pytest.mark.parametrize("script, args, expect", [
    ("moe_step.py", ["--tokens", "16", "--hidden", "8", "--experts", "16", "--top-k", "2"], "matches"),
    ("tp_decode.py", ["--layers", "2", "--hidden", "64", "--vocab", "128", "--steps", "5"], "decoded tokens agree"),
])
def test_example_runs(script, args, expect):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert expect in done.stdout, done.stdout[-2000:]


def test_moe_step_in_two_processes():
    """The step as a multi-host program: two processes of two CPU devices each, started as its docstring says,
    on a ("dp", "ep") mesh whose "ep" groups stay inside a process; each checks the whole result."""
    with socket.socket() as probe:  # a free port for the coordinator
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    command = [sys.executable, os.path.join(EXAMPLES, "moe_step.py"), "--tokens", "16", "--hidden", "8",
               "--experts", "16", "--cpu-devices", "2", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    processes = [subprocess.Popen([*command, "--process-id", str(i)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in processes]
    finally:
        for p in processes:
            p.kill()
    for i, (p, output) in enumerate(zip(processes, outputs)):
        assert p.returncode == 0, output[-3000:]
        assert "mesh dp=2 x ep=2" in output and f"process {i} of 2: OK: matches" in output, output[-3000:]
