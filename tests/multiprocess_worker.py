"""One process of the one-process-per-GPU test:
python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT VISIBILITY.

Each process drives one GPU; the communicators bootstrap through JAX's distributed key-value store. VISIBILITY
"one" means the launcher hid the other GPUs (CUDA_VISIBLE_DEVICES), so all_to_allv_dynamic cannot map its
peers and must fall back to NCCL; "all" means every GPU is visible and JAX uses only GPU PROCESS_ID
(local_device_ids), so the NVLink kernels run over CUDA IPC. Checks every op against jax.lax / the NumPy
reference (all_to_allv_dynamic also with pieces sent in rounds), and the transport all_to_allv_dynamic and
all_reduce lowered to, then the NCCL path under JAX_NCCLX_NCCL_COMMAND_BUFFERS=1, and prints WORKER OK. The
launcher may set XLA_FLAGS to capture custom calls into command buffers; the NCCL part then checks that XLA
replayed them (fewer traced calls than executions).
"""

import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402

process_id, num_processes, port = (int(a) for a in sys.argv[1:4])
visibility = sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id,
                           local_device_ids=[process_id] if visibility == "all" else None)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ncclx as nx  # noqa: E402
import reference  # noqa: E402

n = jax.device_count()
mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("x",))


def global_array(value):
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, P("x")), lambda index: value[index])


def run(fn, *values, n_out=1):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * len(values), out_specs=P("x")))
    out = f(*(global_array(v) for v in values))
    return [np.asarray(multihost_utils.process_allgather(o, tiled=True)) for o in jax.tree.leaves(out)]


rng = np.random.default_rng(0)
x = rng.normal(size=(n * 2, 8 * n, 3)).astype(np.float32)
ring = [(i, (i + 1) % n) for i in range(n)]
pairs = {
    "all_reduce": (lambda v: nx.all_reduce(v, "x"), lambda v: jax.lax.psum(v, "x")),
    "all_gather": (lambda v: nx.all_gather(v, "x", axis=1, tiled=True),
                   lambda v: jax.lax.all_gather(v, "x", axis=1, tiled=True)),
    "reduce_scatter": (lambda v: nx.reduce_scatter(v, "x", scatter_dimension=1, tiled=True),
                       lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=1, tiled=True)),
    "all_to_all": (lambda v: nx.all_to_all(v, "x", 1, 0, tiled=True),
                   lambda v: jax.lax.all_to_all(v, "x", 1, 0, tiled=True)),
    "ppermute": (lambda v: nx.ppermute(v, "x", ring), lambda v: jax.lax.ppermute(v, "x", ring)),
}
for name, (ours, ref) in pairs.items():
    np.testing.assert_allclose(run(ours, x)[0], run(ref, x)[0], rtol=1e-5, atol=1e-5, err_msg=name)
    print(f"[{process_id}] {name} ok", flush=True)
# The same small calls in LL128 lines over CUDA IPC (on 2 GPUs auto takes LL words at these sizes); read at
# lowering.
os.environ["JAX_NCCLX_NVLINK_PROTOCOL"] = "ll128"
jax.clear_caches()
for name in ("all_reduce", "all_gather", "all_to_all"):
    ours, ref = pairs[name]
    np.testing.assert_allclose(run(ours, x)[0], run(ref, x)[0], rtol=1e-5, atol=1e-5, err_msg=f"{name} ll128")
    print(f"[{process_id}] {name} in LL128 lines ok", flush=True)
os.environ.pop("JAX_NCCLX_NVLINK_PROTOCOL")
jax.clear_caches()


def check_all_to_allv(xs, counts, capacity, label):
    for layout in ("padded", "packed"):
        def body(v, c):
            return tuple(o[None] for o in nx.all_to_allv_dynamic(v[0], c[0], "x", max_recv_per_peer=capacity,
                                                                  layout=layout))
        y, recv, dropped = run(body, xs, counts)
        expected = reference.all_to_allv(list(xs), list(counts), capacity, layout)
        for member, (ry, rrecv, rdropped) in enumerate(expected):
            np.testing.assert_array_equal(y[member], ry)
            np.testing.assert_array_equal(recv[member], rrecv)
            np.testing.assert_array_equal(dropped[member], rdropped)
        print(f"[{process_id}] all_to_allv_dynamic {layout}{label} ok", flush=True)


rows, capacity = 12, 4
xs = rng.normal(size=(n, rows, 5)).astype(np.float32)
counts = rng.integers(-1, rows, size=(n, n, 2)).astype(np.int32)
check_all_to_allv(xs, counts, capacity, "")
# Pieces large enough to go in rounds, staged through the peers' slots over CUDA IPC: two blocks per peer make
# two pieces of 1.125 MiB per 2.25 MiB peer slot, each sent and copied out in four rounds (read at lowering).
# Some counts run past the capacity and past the end of x.
os.environ["JAX_NCCLX_NVLINK_BLOCKS"] = str(2 * n)
jax.clear_caches()
check_all_to_allv(rng.normal(size=(n, 1500, 512)).astype(np.float32),
                  rng.integers(0, 700, size=(n, n, 2)).astype(np.int32), 1152, " in rounds")
os.environ.pop("JAX_NCCLX_NVLINK_BLOCKS")
jax.clear_caches()

lowered = jax.jit(jax.shard_map(lambda v, c: nx.all_to_allv_dynamic(v[0], c[0], "x", max_recv_per_peer=2)[0][None],
                                mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"))).lower(
    global_array(xs), global_array(counts[..., 0])).as_text()
on_nvlink = "ncclx_all_to_allv_dynamic_nvlink" in lowered
assert on_nvlink == (visibility == "all"), f"visibility {visibility}: NVLink kernel chosen: {on_nvlink}"
print(f"[{process_id}] all_to_allv_dynamic transport {'nvlink' if on_nvlink else 'nccl'} ok", flush=True)

# The small-message collectives: NVLink kernels over CUDA IPC when every GPU is visible, NCCL otherwise; one-shot
# and two-shot all_reduce (the thresholds are read when a program is lowered), exact in rank order.
big = rng.normal(size=(n, 70001)).astype(np.float32)
for oneshot_max in ("1073741824", "0"):
    os.environ["JAX_NCCLX_NVLINK_ONESHOT_MAX_BYTES"] = oneshot_max
    jax.clear_caches()
    summed = run(lambda v: nx.all_reduce(v, "x"), big)[0]
    expected = big[0].copy()
    for part in big[1:]:
        expected = expected + part
    if visibility == "all":  # the NVLink kernels sum in rank order: exact
        np.testing.assert_array_equal(summed, np.broadcast_to(expected, big.shape))
    else:  # NCCL's order is its own
        np.testing.assert_allclose(summed, np.broadcast_to(expected, big.shape), rtol=1e-5, atol=1e-5)
    text = jax.jit(jax.shard_map(lambda v: nx.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"),
                                 out_specs=P("x"))).lower(global_array(big)).as_text()
    assert ("ncclx_all_reduce_nvlink" in text) == (visibility == "all"), text[-2000:]
    print(f"[{process_id}] all_reduce with one-shot max {oneshot_max} ok", flush=True)
os.environ.pop("JAX_NCCLX_NVLINK_ONESHOT_MAX_BYTES")

# The NCCL path's command-buffer handlers: one program of all five ops, run a few times with new inputs
# (recorded once and then replayed, when custom calls are captured).
os.environ.update(JAX_NCCLX_TRANSPORT="nccl", JAX_NCCLX_NCCL_COMMAND_BUFFERS="1", JAX_NCCLX_TRACE="1")
jax.clear_caches()


def five_ops(v):
    v = v * 2.0  # work before the collectives, as in a real program
    return tuple(ours(v) for ours, _ in pairs.values())


def five_references(v):
    return tuple(ref(v * 2.0) for _, ref in pairs.values())


f = jax.jit(jax.shard_map(five_ops, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
lowered = f.lower(global_array(x)).as_text()
assert all(f"ncclx_{name}_cmdbuf" in lowered for name in pairs), "an op did not lower to its _cmdbuf handler"
nx.trace.reset()
executions = 6
inputs = [rng.normal(size=x.shape).astype(np.float32) for _ in range(executions)]
# Back to back, checked afterwards: building any program (run() makes a new jax.jit) evicts XLA's command
# buffers, and every execution then ran the handlers from the host again.
outputs = [jax.block_until_ready(f(global_array(v))) for v in inputs]
host_calls = len(nx.trace.records())
for step, (v, out) in enumerate(zip(inputs, outputs)):
    got = [np.asarray(multihost_utils.process_allgather(o, tiled=True)) for o in out]
    for name, ours, want in zip(pairs, got, run(five_references, v)):
        np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5, err_msg=f"{name} cmdbuf step {step}")
if "+CUSTOM_CALL" in os.environ.get("XLA_FLAGS", ""):  # else XLA's defaults decide (long programs get graphs)
    assert host_calls < executions * len(pairs), f"all {host_calls} calls ran their handler: no graph was replayed"
assert host_calls >= len(pairs), f"{host_calls} calls traced: some op never ran its handler (recording included)"
print(f"[{process_id}] the five ops through NCCL in command buffers ok ({host_calls} of {executions * len(pairs)} "
      "calls reached the host)", flush=True)
for key in ("JAX_NCCLX_TRANSPORT", "JAX_NCCLX_NCCL_COMMAND_BUFFERS", "JAX_NCCLX_TRACE"):
    os.environ.pop(key)
jax.clear_caches()

grad = jax.jit(jax.grad(lambda v: jax.shard_map(lambda u: jnp.sin(nx.all_reduce(u, "x")).sum()[None], mesh=mesh,
                                                in_specs=P("x"), out_specs=P("x"))(v).sum()))(global_array(x))
expected = jax.jit(jax.grad(lambda v: jax.shard_map(lambda u: jnp.sin(jax.lax.psum(u, "x")).sum()[None], mesh=mesh,
                                                    in_specs=P("x"), out_specs=P("x"))(v).sum()))(global_array(x))
np.testing.assert_allclose(multihost_utils.process_allgather(grad, tiled=True),
                           multihost_utils.process_allgather(expected, tiled=True), rtol=1e-5, atol=1e-5)
print(f"[{process_id}] grad ok\nWORKER OK", flush=True)
jax.distributed.shutdown()
