"""Runs the NCCL path of all_reduce, all_gather, reduce_scatter, all_to_all and ppermute under
JAX_NCCLX_NCCL_COMMAND_BUFFERS=1 with custom calls captured into CUDA graphs (XLA command buffers).

Started by test_collectives.py with XLA_FLAGS=--xla_gpu_enable_command_buffer=+CUSTOM_CALL
--xla_gpu_graph_min_graph_size=1 (the flags must be set before JAX starts). One compiled program runs many
times with new inputs; every result must match NumPy, and fewer calls must have reached the host (the trace
records a call only when its handler runs outside a capture) than the program ran.
"""

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ["JAX_NCCLX_TRANSPORT"] = "nccl"
os.environ["JAX_NCCLX_NCCL_COMMAND_BUFFERS"] = "1"
os.environ["JAX_NCCLX_TRACE"] = "1"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ncclx as nx  # noqa: E402

devices = jax.devices("gpu")
n = len(devices)
mesh = jax.sharding.Mesh(np.asarray(devices), ("x",))
steps, width = 8, 33
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute")  # in body's order


def body(x):
    x = x[0] * 2.0  # [n, width]: work before the collectives, so the command buffer holds more than them
    summed = nx.all_reduce(x, "x")
    gathered = nx.all_gather(x[0], "x", tiled=True)
    scattered = nx.reduce_scatter(x, "x", tiled=True)
    exchanged = nx.all_to_all(x, "x", 0, 0, tiled=True)
    shifted = nx.ppermute(x, "x", perm=[(i, (i + 1) % n) for i in range(n)])
    return tuple(o[None] for o in (summed, gathered, scattered, exchanged, shifted))


f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
lowered = f.lower(jax.ShapeDtypeStruct((n, n, width), np.float32)).as_text()
for op in OPS:
    assert f"ncclx_{op}_cmdbuf" in lowered, f"{op} did not lower to its command-buffer handler"
nx.trace.reset()
rng = np.random.default_rng(0)
for step in range(steps):
    xs = rng.normal(size=(n, n, width)).astype(np.float32)
    summed, gathered, scattered, exchanged, shifted = (np.asarray(o) for o in f(xs))
    x2 = xs * 2.0
    for member in range(n):
        where = f"step {step} member {member}"
        np.testing.assert_allclose(summed[member], x2.sum(0), rtol=1e-5, atol=1e-5, err_msg=where)
        np.testing.assert_array_equal(gathered[member], x2[:, 0].reshape(-1), err_msg=where)
        np.testing.assert_allclose(scattered[member], x2.sum(0)[member:member + 1], rtol=1e-5, atol=1e-5,
                                   err_msg=where)
        np.testing.assert_array_equal(exchanged[member], x2[:, member], err_msg=where)
        np.testing.assert_array_equal(shifted[member], x2[(member - 1) % n], err_msg=where)
host_calls = len(nx.trace.records())
print(f"{steps} executions x {n} devices x {len(OPS)} ops: {host_calls} calls reached the host", flush=True)
assert host_calls < steps * n * len(OPS), "every call ran its handler: nothing was replayed from a CUDA graph"
assert host_calls >= n * len(OPS), "some op never ran its handler (recording included): is tracing on?"
print("CAPTURE OK", flush=True)
