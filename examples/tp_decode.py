"""Tensor-parallel greedy decoding: a few transformer-like layers, one all_reduce per layer, timed per step with
jax_ncclx.all_reduce and with jax.lax.psum.

Every device holds a 1/N slice of each layer's MLP (the first matrix split by columns, the second by rows), so
each layer ends with an all_reduce of the [batch, hidden] activations: the small message of inference. Each
decode step embeds the current tokens, runs the layers, and picks the next tokens greedily; steps are
dispatched back to back, the next step's tokens never leaving the devices. Runs on all GPUs when there are at
least two, otherwise on 8 virtual CPU devices, one step at a time (XLA:CPU's collectives can stall with many
steps in flight on a host of few cores, jax.lax.psum's as well):

    python examples/tp_decode.py [--layers 8] [--batch 8] [--hidden 1024] [--steps 200] [--dtype bf16]

Prints µs per decode step for both and checks that both decode the same tokens from the same logits (float32
by default: the two reduce in different orders, so bf16 logits may differ in their last bits).
"""

import argparse
import os
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)  # used only when there are fewer than two GPUs

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ncclx as nx  # noqa: E402

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def init(key, *, vocab, hidden, ffn, layers, n, dtype):
    """Weights: embedding [V, H] and unembedding [H, V] replicated; per layer w_in [H, F] and w_out [F, H],
    stored as [N, H, F/N] / [N, F/N, H] so that device i holds slice i."""
    keys = jax.random.split(key, 4)
    scale = hidden ** -0.5
    return dict(
        embed=(jax.random.normal(keys[0], (vocab, hidden)) * 0.5).astype(dtype),
        unembed=(jax.random.normal(keys[1], (hidden, vocab)) * scale).astype(dtype),
        w_in=(jax.random.normal(keys[2], (layers, n, hidden, ffn // n)) * scale).astype(dtype),
        w_out=(jax.random.normal(keys[3], (layers, n, ffn // n, hidden)) * (ffn ** -0.5)).astype(dtype),
    )


def decode_step(params, tokens, *, reduce):
    """One greedy step on one device: tokens [B] int32 -> (next tokens [B], logits [B, V] float32)."""
    h = params["embed"][tokens]
    for layer in range(params["w_in"].shape[0]):
        partial = jax.nn.gelu(h @ params["w_in"][layer, 0]) @ params["w_out"][layer, 0]  # this device's share
        h = h + reduce(partial)
        h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True) + 1e-6).astype(h.dtype)
    logits = (h @ params["unembed"]).astype(jnp.float32)
    return jnp.argmax(logits, -1).astype(jnp.int32), logits


def compiled_step(mesh, params, reduce):
    specs = dict(embed=P(), unembed=P(), w_in=P(None, "tp"), w_out=P(None, "tp"))
    step = jax.shard_map(lambda p, t: decode_step(p, t, reduce=reduce), mesh=mesh, in_specs=(specs, P()),
                         out_specs=(P(), P()))
    return jax.jit(step)


def timed_decode(step, params, tokens, steps, *, in_flight):
    """Runs ``steps`` greedy steps (after a warm-up) and returns (µs per step, tokens of every step [S, B]).
    ``in_flight``: dispatch the steps back to back (else wait for each before the next)."""
    jax.block_until_ready(step(params, tokens))
    outputs = []
    start = time.perf_counter()
    for _ in range(steps):
        tokens, _ = step(params, tokens)
        if not in_flight:
            jax.block_until_ready(tokens)
        outputs.append(tokens)
    jax.block_until_ready(tokens)
    elapsed = time.perf_counter() - start
    return elapsed / steps * 1e6, np.stack([np.asarray(t) for t in outputs])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    args = parser.parse_args()

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    devices = gpus if len(gpus) >= 2 else jax.devices("cpu")
    n = len(devices)
    mesh = jax.sharding.Mesh(np.asarray(devices), ("tp",))
    dtype = DTYPES[args.dtype]
    params = init(jax.random.key(0), vocab=args.vocab, hidden=args.hidden, ffn=4 * args.hidden,
                  layers=args.layers, n=n, dtype=dtype)
    params = jax.device_put(params, dict(embed=NamedSharding(mesh, P()), unembed=NamedSharding(mesh, P()),
                                         w_in=NamedSharding(mesh, P(None, "tp")),
                                         w_out=NamedSharding(mesh, P(None, "tp"))))
    tokens = jax.device_put(jnp.arange(args.batch, dtype=jnp.int32) % args.vocab, NamedSharding(mesh, P()))
    message = args.batch * args.hidden * np.dtype(dtype).itemsize
    print(f"{n} x {devices[0].device_kind}: {args.layers} layers, batch {args.batch}, hidden {args.hidden}, "
          f"{args.dtype}; one all_reduce of {message} bytes per layer")

    steps = {"jax_ncclx.all_reduce": compiled_step(mesh, params, lambda v: nx.all_reduce(v, "tp")),
             "jax.lax.psum": compiled_step(mesh, params, lambda v: jax.lax.psum(v, "tp"))}
    first_logits = {name: np.asarray(step(params, tokens)[1]) for name, step in steps.items()}
    np.testing.assert_allclose(*first_logits.values(), rtol=2e-2 if dtype == jnp.bfloat16 else 1e-4, atol=1e-3)
    # On CPU every step waits for the last: XLA:CPU runs the virtual devices' collectives on the host's few
    # threads, and with many steps in flight its rendezvous can stall until it times out (jax.lax.psum's too).
    in_flight = devices[0].platform == "gpu"
    results = {name: timed_decode(step, params, tokens, args.steps, in_flight=in_flight)
               for name, step in steps.items()}
    for name, (us, _) in results.items():
        print(f"{name:>22}: {us:8.1f} µs per decode step ({us / args.layers:6.1f} µs per layer)")
    (ours, our_tokens), (theirs, their_tokens) = results.values()
    same = float(np.mean(our_tokens == their_tokens))
    speed = "CPU times say little about GPUs" if jax.default_backend() == "cpu" else "above 1: jax_ncclx is faster"
    print(f"speedup over jax.lax per step: {theirs / ours:.2f}x ({speed}); {same:.1%} of the {our_tokens.size} "
          "decoded tokens agree (first-step logits checked equal within tolerance)")
    if dtype == jnp.float32 and same < 0.99:
        raise SystemExit("FAILED: float32 decodes diverged")


if __name__ == "__main__":
    main()
