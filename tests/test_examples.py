"""The examples run end to end on the CPU backend (8 virtual devices) with small sizes, and check themselves."""

import os
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
