"""Runs the NVLink kernels (all_to_allv_dynamic, and all_reduce one-shot and two-shot, all_gather, all_to_all,
small and, written into the peers' outputs, large, and reduce_scatter) with custom calls captured into CUDA
graphs (XLA command buffers).

Started by test_all_to_allv.py with XLA_FLAGS=--xla_gpu_enable_command_buffer=+CUSTOM_CALL
--xla_gpu_graph_min_graph_size=1 (the flags must be set before JAX starts). One compiled program runs many
times with new inputs; every result must match the NumPy reference, and the handlers must have been recorded
into a graph at least once and replayed without being called (fewer host launches than kernel executions).
Without the flags it is a small plain run, which is what compute-sanitizer checks. WORKER_STACKS_AFTER_S=S prints
every thread's Python stack after S seconds and every S seconds after (tools/gpu_check.sh sets it under
compute-sanitizer, whose rare hangs should at least say where they stopped).
"""

import faulthandler
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ["JAX_NCCLX_NVLINK_ONESHOT_MAX_BYTES"] = "256"  # x's first row (132 B): one-shot; all of x: two-shot
os.environ["JAX_NCCLX_NVLINK_DIRECT_MIN_BYTES"] = "0"  # simple moves (segments above 64 KiB) into the outputs
sys.path.insert(0, os.path.dirname(__file__))
if "WORKER_STACKS_AFTER_S" in os.environ:
    faulthandler.dump_traceback_later(float(os.environ["WORKER_STACKS_AFTER_S"]), repeat=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ncclx as nx  # noqa: E402
import reference  # noqa: E402
from jax_ncclx._src import lib  # noqa: E402

devices = jax.devices("gpu")
n = len(devices)
mesh = jax.sharding.Mesh(np.asarray(devices), ("x",))
rows, capacity, steps = 40, 16, 12
TILES = 128  # the large moves send x tiled this many times: 660 KiB, beyond the 64 KiB of LL / LL128 segments


def body(x, c):
    # Work before and after the collectives, so the command buffer holds more than the custom calls.
    x = x[0] * 2.0
    y, recv, dropped = nx.all_to_allv_dynamic(x, c[0], "x", max_recv_per_peer=capacity, layout="packed")
    small = nx.all_reduce(x[0], "x")                                  # one-shot
    large = nx.all_reduce(x, "x")                                     # two-shot
    gathered = nx.all_gather(x[1], "x", tiled=True)
    exchanged = nx.all_to_all(x[2:2 + n], "x", 0, 0, tiled=True)
    tiled = jnp.tile(x, (TILES, 1))                                   # 660 KiB
    big_gathered = nx.all_gather(tiled, "x", tiled=True)
    big_exchanged = nx.all_to_all(tiled, "x", 0, 0, tiled=True)       # 660 / n KiB per peer
    scattered = nx.reduce_scatter(x, "x", tiled=True)                 # rows / n rows of the sum
    return tuple(o[None] for o in (y + 1.0, recv, dropped, small, large, gathered, exchanged, big_gathered,
                                   big_exchanged, scattered))


nvlink_calls_per_step = 8
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
rng = np.random.default_rng(0)
start = lib.cuda_module().nvlink_launch_counts()
for step in range(steps):
    counts = rng.integers(-2, 2 * capacity // 3, size=(n, n, 2)).astype(np.int32)
    xs = rng.normal(size=(n, rows, 33)).astype(np.float32)
    y, recv, dropped, small, large, gathered, exchanged, big_gathered, big_exchanged, scattered = (
        np.asarray(o) for o in f(jnp.asarray(xs), jnp.asarray(counts)))
    x2 = xs * 2.0
    tiled = np.tile(x2, (1, TILES, 1))  # [n, TILES * rows, 33]
    block = TILES * rows // n
    expected = reference.all_to_allv(list(x2), list(counts), capacity, "packed")
    for member, (ry, rrecv, rdropped) in enumerate(expected):
        where = f"step {step} member {member}"
        np.testing.assert_allclose(y[member], ry + 1.0, rtol=1e-6, err_msg=where)
        np.testing.assert_array_equal(recv[member], rrecv)
        np.testing.assert_array_equal(dropped[member], rdropped)
        np.testing.assert_allclose(small[member], x2[:, 0].sum(0), rtol=1e-5, atol=1e-5, err_msg=where)
        np.testing.assert_allclose(large[member], x2.sum(0), rtol=1e-5, atol=1e-5, err_msg=where)
        np.testing.assert_array_equal(gathered[member], x2[:, 1].reshape(-1), err_msg=where)
        np.testing.assert_array_equal(exchanged[member], x2[:, 2 + member], err_msg=where)
        np.testing.assert_array_equal(big_gathered[member], tiled.reshape(-1, 33), err_msg=where)
        np.testing.assert_array_equal(big_exchanged[member],
                                      tiled[:, member * block:(member + 1) * block].reshape(-1, 33), err_msg=where)
        share = rows // n
        np.testing.assert_allclose(scattered[member], x2.sum(0)[member * share:(member + 1) * share], rtol=1e-5,
                                   atol=1e-5, err_msg=where)
    print(f"step {step} matches", flush=True)
launches, captured = (end - begin for end, begin in zip(lib.cuda_module().nvlink_launch_counts(), start))
print(f"{steps} executions x {n} devices: {launches} host launches, {captured} recorded into graphs", flush=True)
if "+CUSTOM_CALL" in os.environ.get("XLA_FLAGS", ""):  # without the flags this is a plain correctness run
    assert captured > 0, "the handler was never recorded into a CUDA graph"
    assert launches < steps * n * nvlink_calls_per_step, "every execution called the handlers: no graph replayed"
print("CAPTURE OK", flush=True)
