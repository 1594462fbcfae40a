"""A small mixture-of-experts step with jax_ncclx.moe, checked against a dense reference.

Every device holds T tokens and E/N experts. Each token picks its top-k experts. ``moe.dispatch`` sends the
(token, choice) rows to the devices that own those experts (the counts never leave the device), with the
router weights, and groups them by expert; ``jax.lax.ragged_dot`` runs the experts; ``moe.combine`` sums each
token's weighted outputs on the expert side and sends them back. Runs on every GPU there is (one GPU: an
axis of one member, every row sent to itself), otherwise on 8 virtual CPU devices. The dense reference runs
on the same platform, every matmul at the highest precision (no TF32), so the two agree to float32 rounding:

    python examples/moe_step.py [--tokens 64] [--hidden 32] [--experts 16] [--top-k 2]
"""

import argparse
import os
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)  # used only where there is no GPU

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ncclx as nx  # noqa: E402
from jax_ncclx import moe  # noqa: E402

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
    parser.add_argument("--experts", type=int, default=16, help="total experts (a multiple of the devices)")
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()

    devices = jax.devices()
    if devices[0].platform != "gpu":  # no GPU: simulate 8 devices on the CPU
        devices = jax.devices("cpu")
    n = len(devices)
    if args.experts % n:
        parser.error(f"--experts must be a multiple of the {n} devices")
    mesh = jax.sharding.Mesh(np.asarray(devices), ("ep",))
    capacity = args.tokens * args.top_k  # enough that nothing is dropped
    rng = np.random.default_rng(0)
    tokens = rng.normal(size=(n * args.tokens, args.hidden)).astype(np.float32)
    router = rng.normal(size=(args.hidden, args.experts)).astype(np.float32)
    expert_weights = (rng.normal(size=(args.experts, args.hidden, args.hidden)) / np.sqrt(args.hidden)).astype(
        np.float32)

    step = jax.jit(jax.shard_map(
        lambda t, r, w: moe_layer(t, r, w, num_experts=args.experts, top_k=args.top_k, capacity=capacity),
        mesh=mesh, in_specs=(P("ep"), P(), P("ep")), out_specs=(P("ep"), P("ep"))))
    shard = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    inputs = (shard(tokens, P("ep")), shard(router, P()), shard(expert_weights, P("ep")))

    out, dropped = jax.block_until_ready(step(*inputs))
    start = time.perf_counter()
    out, dropped = jax.block_until_ready(step(*inputs))
    elapsed = time.perf_counter() - start

    with jax.default_device(devices[0]):  # the platform of the MoE step, not the process's default
        expected = dense_reference(jnp.asarray(tokens), jnp.asarray(router), jnp.asarray(expert_weights), args.top_k)
    error = float(jnp.max(jnp.abs(out - expected)))
    print(f"jax_ncclx MoE step on {n} {devices[0].platform.upper()} devices ({devices[0].device_kind}); "
          f"CUDA build: {nx.build_info()['cuda']}")
    print(f"  {args.tokens} tokens/device x top-{args.top_k} over {args.experts} experts, hidden {args.hidden}, "
          f"capacity {capacity} rows/peer")
    print(f"  dispatch -> experts -> combine in {elapsed * 1e3:.2f} ms; rows dropped: {int(np.sum(dropped))}")
    print(f"  max |moe - dense reference| = {error:.2e}")
    if error > 1e-4:
        raise SystemExit("FAILED: the MoE step does not match the dense reference")
    print("OK: matches the dense reference")


if __name__ == "__main__":
    with jax.default_matmul_precision("highest"):  # the router's matmul too, in the step and the reference
        main()
