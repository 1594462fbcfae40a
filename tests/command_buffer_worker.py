"""Runs all_to_allv_dynamic's NVLink kernel with custom calls captured into CUDA graphs (XLA command buffers).

Started by test_all_to_allv.py with XLA_FLAGS=--xla_gpu_enable_command_buffer=+CUSTOM_CALL
--xla_gpu_graph_min_graph_size=1 (the flags must be set before JAX starts). One compiled program runs many
times with new counts; every result must match the NumPy reference, and the handler must have been recorded
into a graph at least once and replayed without being called (fewer host launches than executions).
Without the flags it is a small plain run, which is what compute-sanitizer checks.
"""

import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
sys.path.insert(0, os.path.dirname(__file__))

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


def body(x, c):
    # Work before and after the collective, so the command buffer holds more than the custom call.
    y, recv, dropped = nx.all_to_allv_dynamic(x[0] * 2.0, c[0], "x", max_recv_per_peer=capacity, layout="packed")
    return (y + 1.0)[None], recv[None], dropped[None]


f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
rng = np.random.default_rng(0)
xs = rng.normal(size=(n, rows, 33)).astype(np.float32)
start = lib.cuda_module().nvlink_launch_counts()
for step in range(steps):
    counts = rng.integers(-2, 2 * capacity // 3, size=(n, n, 2)).astype(np.int32)
    y, recv, dropped = (np.asarray(o) for o in f(jnp.asarray(xs), jnp.asarray(counts)))
    expected = reference.all_to_allv(list(xs * 2.0), list(counts), capacity, "packed")
    for member, (ry, rrecv, rdropped) in enumerate(expected):
        np.testing.assert_allclose(y[member], ry + 1.0, rtol=1e-6, err_msg=f"step {step} member {member}")
        np.testing.assert_array_equal(recv[member], rrecv)
        np.testing.assert_array_equal(dropped[member], rdropped)
launches, captured = (end - begin for end, begin in zip(lib.cuda_module().nvlink_launch_counts(), start))
print(f"{steps} executions x {n} devices: {launches} host launches, {captured} recorded into graphs", flush=True)
if "+CUSTOM_CALL" in os.environ.get("XLA_FLAGS", ""):  # without the flags this is a plain correctness run
    assert captured > 0, "the handler was never recorded into a CUDA graph"
    assert launches < steps * n, "every execution called the handler: the graph was not replayed"
print("CAPTURE OK", flush=True)
