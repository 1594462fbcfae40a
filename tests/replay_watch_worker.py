"""Hangs in calls replayed from CUDA graphs: python replay_watch_worker.py MODE.

JAX_NCCLX_WATCH_REPLAYS=1: NCCL calls are watched, NVLink kernels time out on the device and their handlers refuse
a failed communicator before each execution. Started by test_reliability.py with custom calls captured into XLA's
command buffers (conftest.CAPTURE_FLAGS) and JAX_NCCLX_TIMEOUT_S=1. The program is one all_reduce over every local
GPU (one will do), through NCCL except in mode nvlink. XLA runs its first execution op by op (each rank's call
number 0) and captures the second, so the first call that a graph holds is each rank's call number 1; every later
one a re-capture (XLA captures again when buffer addresses change).

  healthy: rank 0's stream stalls 0.3 s before the call in every replay (JAX_NCCLX_FAULT stall) and 12
           executions are queued at once, so the calls' events stay NotReady for ~4 s, past the timeout, while
           the replays get through: nothing may be reported, every result must be right.
  stall:   rank 0 stalls 4 s, past the timeout, in the captured call: check_errors must name the replayed
           call, and the next execution must fail before it runs (the handlers' prepare stage).
  skip:    (2+ GPUs) the last rank leaves the call out of its graph: rank 0 hangs in it, and the error must
           name the last rank as the one that never reached it.
  eager:   as stall on one GPU, but the call is not captured (JAX_NCCLX_NCCL_COMMAND_BUFFERS=0): the eager
           watchdog names the second call. One GPU: the eager watchdog aborts the communicator, which a peer's
           NCCL kernel still queued behind a stall must not meet.
  nvlink:  (2+ GPUs) the NVLink kernel instead of NCCL; the last rank stalls 4 s in the captured call, so rank 0's
           kernel gives up waiting for it: check_errors must name the last rank, and the next execution must
           fail before it runs (the NVLink handlers' prepare stage), not replay on the aborted communicator.
Prints CAPTURE OK when every check passed.
"""

import os
import sys
import time

mode = sys.argv[1]
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.update(JAX_NCCLX_TRANSPORT="nvlink" if mode == "nvlink" else "nccl", JAX_NCCLX_WATCH_REPLAYS="1",
                  JAX_NCCLX_TIMEOUT_S="1", JAX_NCCLX_TRACE="1",
                  JAX_NCCLX_NCCL_COMMAND_BUFFERS="0" if mode == "eager" else "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

devices = jax.devices("gpu")[: 1 if mode == "eager" else None]
n = len(devices)
stall_ms = {"healthy": 300, "stall": 4000, "eager": 4000}.get(mode)
if stall_ms is not None:
    os.environ["JAX_NCCLX_FAULT"] = f"stall:rank=0,seq=1-63,ms={stall_ms}"
elif mode == "nvlink":
    os.environ["JAX_NCCLX_FAULT"] = f"stall:rank={n - 1},seq=1-63,ms=4000"
else:
    os.environ["JAX_NCCLX_FAULT"] = f"skip:rank={n - 1},seq=1-63"

import jax_ncclx as nx  # noqa: E402

mesh = jax.sharding.Mesh(np.asarray(devices), ("x",))
f = jax.jit(jax.shard_map(lambda v: nx.all_reduce(v * 2.0, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
x = jax.device_put(np.arange(n * 64, dtype=np.float32).reshape(n, 64), NamedSharding(mesh, P("x")))
expected = np.tile((np.arange(n * 64, dtype=np.float32).reshape(n, 64) * 2.0).sum(0), (n, 1))


def expect_error(where, *needles):
    try:
        nx.check_errors()
    except nx.CollectiveError as e:
        message = str(e)
        print(f"{where}: {message}", flush=True)
        assert all(needle in message for needle in needles), f"{where}: expected {needles} in {message!r}"
        return message
    raise AssertionError(f"{where}: no error was reported")


np.testing.assert_allclose(np.asarray(f(x)), expected)  # runs op by op (XLA's warm-up), or eagerly
if mode == "healthy":
    started = time.monotonic()
    outputs = [f(x) for _ in range(12)]  # queued at once: the host runs ahead of the replays
    for out in outputs:
        np.testing.assert_allclose(np.asarray(out), expected)
    took = time.monotonic() - started
    print(f"12 executions in {took:.2f} s", flush=True)
    assert took > 2.0, f"the stalls did not hold the replays back ({took:.2f} s): the test tested nothing"
    nx.check_errors()
    calls = len(nx.trace.records())
    assert calls < 13 * n, f"{calls} calls ran their handler: nothing was replayed from a CUDA graph"
    assert calls >= n, f"{calls} calls traced: a device never ran the handler (recording included)"
elif mode in ("stall", "eager", "nvlink"):
    assert mode != "nvlink" or n >= 2, "nvlink needs two GPUs"
    jax.block_until_ready(f(x))  # stalls 4 s; the watchdog (NCCL) or rank 0's kernel (NVLink) gives up after 1
    if mode == "nvlink":
        message = expect_error(mode, "NVLink call", "all_reduce", f"rank(s) {n - 1} of {n} did not arrive")
    else:
        where = "replayed from a CUDA graph" if mode == "stall" else "has not finished"
        message = expect_error(mode, "all_reduce", where,
                               f"of {n} (JAX_NCCLX_TIMEOUT_S, or JAX_NCCLX_TIMEOUT_S_<OP> for one op)")
        assert (mode == "stall") == ("replayed" in message), message
    try:
        jax.block_until_ready(f(x))
    except Exception as e:  # XLA's runtime error, carrying the handler's
        assert "is unusable" in str(e), str(e)
        print(f"next execution: {type(e).__name__}: {str(e)[:300]}", flush=True)
    else:
        raise AssertionError("the execution after the hang ran")
else:
    assert n >= 2, "skip needs two GPUs"
    jax.block_until_ready(f(x))  # rank 0 waits in the call until the watchdog revokes the communicator
    expect_error("skip", "replayed from a CUDA graph", f"rank(s) {n - 1} never reached it")
print("CAPTURE OK", flush=True)
