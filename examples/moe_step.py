"""A small mixture-of-experts step with jax_ncclx.moe, checked against a dense reference.

Every device holds T tokens and E/M experts. Each token picks its top-k experts. ``moe.dispatch`` sends the
(token, choice) rows to the devices that own those experts (the counts never leave the device), with the
router weights, and groups them by expert; ``jax.lax.ragged_dot`` runs the experts; ``moe.combine`` sums each
token's weighted outputs on the expert side and sends them back. Runs on every GPU there is (one GPU: an
axis of one member, every row sent to itself), otherwise on 8 virtual CPU devices. The dense reference runs
on the same platform, every matmul at the highest precision (no TF32), so the two agree to float32 rounding:

    python examples/moe_step.py [--tokens 64] [--hidden 32] [--experts 16] [--top-k 2]

Several processes (one per GPU, or one per host) run the same step, each started with its id:

    python examples/moe_step.py --coordinator HOST:PORT --num-processes P --process-id I [--ep M]

The devices form a ("dp", "ep") mesh. The experts are spread over each group of M devices along "ep" (default:
every GPU; on CPU each process's own devices, since there a collective's devices must be in one process), and
each "dp" row of the mesh has its own tokens and a copy of the experts. Every process checks the whole result.
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ncclx as nx
from jax_ncclx import moe

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def route(tokens, router, top_k):
    """Top-k experts and softmax weights per token: [T, k] int32, [T, k] float32."""
    logits = tokens @ router
    weights, experts = jax.lax.top_k(logits, top_k)
    return experts.astype(jnp.int32), jax.nn.softmax(weights, axis=-1)


def moe_layer(tokens, router, expert_weights, *, num_experts, top_k, capacity):
    """Per device: tokens [T, H], router [H, E] (replicated), expert_weights [E/N, H, H] (this device's)."""
    experts, gates = route(tokens, router, top_k)
    rows, group_sizes, handle = moe.dispatch(tokens, experts, num_experts=num_experts, axis_name="ep",
                                             capacity=capacity, weights=gates)
    # HIGHEST: float32 without TF32 on GPUs, so the comparison with the dense reference stays tight.
    outputs = jnp.tanh(jax.lax.ragged_dot(rows, expert_weights, group_sizes, precision=jax.lax.Precision.HIGHEST))
    return moe.combine(outputs, handle), handle.dropped


def dense_reference(tokens, router, expert_weights, top_k):
    experts, gates = route(tokens, router, top_k)
    chosen = expert_weights[experts]  # [T, k, H, H]
    y = jnp.tanh(jnp.einsum("th,tkhd->tkd", tokens, chosen, precision=jax.lax.Precision.HIGHEST))
    return (y * gates[..., None]).sum(axis=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per device")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--experts", type=int, default=16, help="total experts (a multiple of --ep)")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--ep", type=int, help="devices the experts are spread over (default: see above)")
    parser.add_argument("--cpu-devices", type=int, default=8, help="virtual CPU devices per process, without a GPU")
    parser.add_argument("--coordinator", help="HOST:PORT of process 0, for several processes")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    args = parser.parse_args()

    jax.config.update("jax_num_cpu_devices", args.cpu_devices)  # used only where there is no GPU
    if args.coordinator:  # before any other JAX call
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    platform = "gpu" if jax.devices()[0].platform == "gpu" else "cpu"
    devices = sorted(jax.devices(platform), key=lambda d: (d.process_index, d.id))  # each process's together
    n = len(devices)
    ep = args.ep or (n if platform == "gpu" else len(jax.local_devices(backend=platform)))
    if n % ep or args.experts % ep:
        parser.error(f"--ep {ep} must divide the {n} devices and --experts {args.experts}")
    mesh = jax.sharding.Mesh(np.asarray(devices).reshape(n // ep, ep), ("dp", "ep"))
    capacity = args.tokens * args.top_k  # enough that nothing is dropped
    rng = np.random.default_rng(0)  # the same inputs in every process
    tokens = rng.normal(size=(n * args.tokens, args.hidden)).astype(np.float32)
    router = rng.normal(size=(args.hidden, args.experts)).astype(np.float32)
    expert_weights = (rng.normal(size=(args.experts, args.hidden, args.hidden)) / np.sqrt(args.hidden)).astype(
        np.float32)

    rows = P(("dp", "ep"))  # every device its own tokens
    step = jax.jit(jax.shard_map(
        lambda t, r, w: moe_layer(t, r, w, num_experts=args.experts, top_k=args.top_k, capacity=capacity),
        mesh=mesh, in_specs=(rows, P(), P("ep")), out_specs=(rows, rows)))
    # Each process makes its own devices' shards: what a multi-host program does with data it cannot send around.
    shard = lambda a, spec: jax.make_array_from_callback(  # noqa: E731
        a.shape, NamedSharding(mesh, spec), lambda index: a[index])
    inputs = (shard(tokens, rows), shard(router, P()), shard(expert_weights, P("ep")))

    out, dropped = jax.block_until_ready(step(*inputs))
    start = time.perf_counter()
    out, dropped = jax.block_until_ready(step(*inputs))
    elapsed = time.perf_counter() - start
    out, dropped = (multihost_utils.process_allgather(a, tiled=True) for a in (out, dropped))

    with jax.default_device(jax.local_devices(backend=platform)[0]):  # the step's platform, not the default
        expected = dense_reference(jnp.asarray(tokens), jnp.asarray(router), jnp.asarray(expert_weights), args.top_k)
    error = float(np.max(np.abs(out - np.asarray(expected))))
    who = f"process {jax.process_index()} of {jax.process_count()}: " if jax.process_count() > 1 else ""
    print(f"{who}jax_ncclx MoE step on {n} {platform.upper()} devices ({devices[0].device_kind}), mesh "
          f"dp={n // ep} x ep={ep}; CUDA build: {nx.build_info()['cuda']}")
    print(f"  {args.tokens} tokens/device x top-{args.top_k} over {args.experts} experts, hidden {args.hidden}, "
          f"capacity {capacity} rows/peer")
    print(f"  dispatch -> experts -> combine in {elapsed * 1e3:.2f} ms; rows dropped: {int(np.sum(dropped))}")
    print(f"  max |moe - dense reference| = {error:.2e}")
    if error > 1e-4:
        raise SystemExit("FAILED: the MoE step does not match the dense reference")
    print(f"{who}OK: matches the dense reference")


if __name__ == "__main__":
    with jax.default_matmul_precision("highest"):  # the router's matmul too, in the step and the reference
        main()
