"""Independent collectives in one program: no deadlock, whatever order each device enters them in.

XLA:CPU runs a program's independent operations concurrently, and each virtual device may start them in a
different order; a participant that blocked its thread while waiting for peers stalled its device, and the
program timed out (tests/ordering_worker.py says how each case is built). These run each program many
times in a row under a short timeout, on the 8 virtual devices of the conftest, on 16 in a process of their
own, and on one GPU, where the same program must give the same result.
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import ordering_worker  # noqa: E402

RUNS = 10


@pytest.fixture
def devices(any_backend):
    return any_backend


@pytest.mark.parametrize("case", ordering_worker.CASES)
def test_independent_collectives_complete_every_time(devices, case, monkeypatch):
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", "20")  # a stall fails fast (600 s by default)
    failures = ordering_worker.run(devices, case, RUNS)
    assert not failures, f"{len(failures)} of {RUNS} executions failed; first: {failures[0]}"


@pytest.mark.slow  # its own process with 16 devices
def test_sixteen_virtual_devices():
    env = dict(os.environ, JAX_NCCLX_TIMEOUT_S="20", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, ordering_worker.__file__, "16", str(RUNS)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ORDERING OK" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def test_a_late_peer_still_times_out(monkeypatch):
    """A waiting participant holds no thread, yet its peers' absence still ends the call at the timeout."""
    import jax.numpy as jnp
    import jax_ncclx as nx
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:4]), ("x",))
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", "1")
    monkeypatch.setenv("JAX_NCCLX_FAULT", "skip:rank=3,seq=0")
    nx.shutdown()  # call numbers restart, so the fault hits this program's first call
    f = jax.jit(jax.shard_map(lambda v: nx.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    # XLA reports one device's error: the one whose timeout expired, or a peer it abandoned.
    expected = r"rank\(s\) 3 did not arrive within 1 s|timed out after 1 s waiting for rank\(s\) 3 "
    with pytest.raises(Exception, match=expected):
        jax.block_until_ready(f(jnp.ones((4, 8))))
    nx.shutdown()
