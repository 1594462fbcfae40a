"""MaxText's MoE layer on jax_ncclx: its expert-parallel sparse path under ``nx.route_lax()``, checked against
the same layer's dense path.

MaxText's ``RoutedMoE`` with expert parallelism over every device runs its sparse path (``sparse_matmul``):
tokens go to their experts' devices by ``jax.lax.ragged_all_to_all`` and come back the same way, which under
``nx.route_lax()`` is ``nx.ragged_all_to_all`` (and the layer's ``jax.lax.all_gather`` is ``nx.all_gather``).
The reference is the same layer with the same weights on its dense path (``sparse_matmul=False``: every
expert's einsum over every token, no collective of its own). Both run in float32 at the highest matmul
precision. Two shapes: a training step (a batch row per device, sharded over the expert axis) and a decode
step of a few tokens (batch 1, which MaxText replicates over the expert axis, so the combine sends the same
rows to every device). Compared: the output, and the gradients of a weighted sum of it with respect to the
input and every weight. Runs on every GPU there is (with one GPU the expert axis has one member and MaxText's
layer makes no all-to-all, so only the two paths' agreement is checked), otherwise, or with
``--platform cpu``, on 8 virtual CPU devices:

    .venv/bin/pip install --no-deps -r requirements-maxtext.txt   # MaxText and what its moe.py imports
    JAX_NCCLX_TIMEOUT_S=20 python examples/maxtext_moe.py [--platform cpu] [--seq 16] [--decode-tokens 4]

Prints the largest absolute error of the output and of the gradients at each shape, and PASSED (exit code 0)
or FAILED (exit code 1).
"""

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the shared GPU machines
os.environ.setdefault("NCCL_NVLINK_MULTICAST_ENABLE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_ncclx as nx  # noqa: E402

# A tensor passes when its largest error is at most this fraction of its largest absolute value: float32 at the
# highest precision on both sides, so only summation order differs (CPU: about 1e-7).
RTOL = 1e-4


def maxtext_config(num_devices: int, *, sparse: bool, experts: int, top_k: int, hidden: int, mlp: int):
    """MaxText's config from its packaged base.yml (no file of ours): a MoE of ``experts`` experts, expert
    parallelism over all devices, float32; ``sparse`` picks the sparse (ragged all-to-all) or dense path."""
    from maxtext.configs import pyconfig

    base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    # jax_cache_dir "": base.yml would turn on JAX's persistent compilation cache for the whole process.
    return pyconfig.initialize(
        [None, base], run_name="jax_ncclx_maxtext_moe", enable_checkpointing=False, log_config=False,
        skip_jax_distributed_system=True, jax_cache_dir="",
        base_output_directory=os.path.join(tempfile.gettempdir(), "jax_ncclx_maxtext"),
        num_experts=experts, num_experts_per_tok=top_k, base_emb_dim=hidden, base_mlp_dim=mlp,
        base_moe_mlp_dim=mlp, dtype="float32", weight_dtype="float32", matmul_precision="highest",
        float32_gate_logits=True, megablox=False, sparse_matmul=sparse, ici_expert_parallelism=num_devices,
        per_device_batch_size=1, max_target_length=16)


class Layers:
    """One ``RoutedMoE`` built twice from the same seed: ``sparse`` (expert parallel, ragged all-to-all) and
    ``dense``, on a mesh of ``devices`` whose expert axis is all of them."""

    def __init__(self, devices, *, experts: int, top_k: int = 2, hidden: int = 16, mlp: int = 32, seed: int = 0):
        from flax import nnx
        from maxtext.layers import moe
        from maxtext.layers.initializers import nd_dense_init
        from maxtext.utils import maxtext_utils

        sizes = dict(experts=experts, top_k=top_k, hidden=hidden, mlp=mlp)
        self.configs = {path: maxtext_config(len(devices), sparse=path == "sparse", **sizes)
                        for path in ("sparse", "dense")}
        self.mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(self.configs["sparse"], devices),
                                      self.configs["sparse"].mesh_axes)
        self.hidden = hidden
        self.models = {}
        with self.scope():
            for path, cfg in self.configs.items():
                self.models[path] = moe.RoutedMoE(
                    config=cfg, num_experts=experts, num_experts_per_tok=top_k, mesh=self.mesh,
                    kernel_init=nd_dense_init(1.0, "fan_in", "truncated_normal"), kernel_axes=("embed", None),
                    intermediate_dim=mlp, dtype=jnp.float32, weight_dtype=jnp.float32, rngs=nnx.Rngs(params=seed))
        # The same weights on both paths, whatever the initializers draw.
        nnx.update(self.models["dense"], nnx.state(self.models["sparse"], nnx.Param))

    def scope(self):
        """MaxText's mesh and logical axis rules, which its layers read while they are built and traced."""
        from contextlib import ExitStack

        from flax.linen import partitioning as nn_partitioning

        stack = ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn_partitioning.axis_rules(self.configs["sparse"].logical_axis_rules))
        stack.enter_context(jax.default_matmul_precision("highest"))
        return stack

    def step(self, path: str):
        """``(jitted step, params)``: step(params, x, w) gives ``((sum(out * w), out), (d params, d x))`` for
        x, w float32 ``[B, S, hidden]``."""
        from flax import nnx

        graph, params, rest = nnx.split(self.models[path], nnx.Param, ...)

        def loss(params, x, w):
            out, _, _ = nnx.merge(graph, params, rest)(x)
            return jnp.sum(out * w), out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)), params

    def compare(self, batch: int, seq: int, *, seed: int = 1, repeats: int = 1):
        """Runs both paths on ``[batch, seq, hidden]`` (the sparse one under ``nx.route_lax()``, ``repeats``
        times) and returns a dict: the largest absolute errors (``output``, ``gradients``), each tensor's error
        relative to its largest value (``worst_relative``), the sparse path's jax_ncclx custom calls
        (``custom_calls``) and the median seconds of its runs after the first (``seconds``; None for one run).
        Raises AssertionError where a later run differs from the first by more than RTOL."""
        keys = jax.random.split(jax.random.key(seed))
        x = jax.random.normal(keys[0], (batch, seq, self.hidden), jnp.float32)
        w = jax.random.normal(keys[1], (batch, seq, self.hidden), jnp.float32)
        with self.scope():
            dense, dense_params = self.step("dense")
            (_, want), want_grads = jax.block_until_ready(dense(dense_params, x, w))
            with nx.route_lax():
                sparse, params = self.step("sparse")
                (_, got), grads = jax.block_until_ready(sparse(params, x, w))
                seconds = []
                for _ in range(repeats - 1):  # back to back, waiting for each: no deadlock, the same result
                    start = time.perf_counter()
                    (_, again), again_grads = jax.block_until_ready(sparse(params, x, w))
                    seconds.append(time.perf_counter() - start)
                    drift = max(_relative_error(a, b) for a, b in zip(jax.tree.leaves((again, again_grads)),
                                                                      jax.tree.leaves((got, grads))))
                    if drift > RTOL:  # GPU gradients may differ in the last bits (atomic adds), not more
                        raise AssertionError(f"run {len(seconds) + 1} of the sparse path differs from the first "
                                             f"by {drift:.1e} of its largest value")
                calls = custom_calls(sparse.lower(params, x, w).as_text())
        pairs = [(got, want), *zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads))]
        errors = [float(jnp.max(jnp.abs(a - b))) for a, b in pairs]
        return dict(output=errors[0], gradients=max(errors[1:]),
                    worst_relative=max(_relative_error(a, b) for a, b in pairs), custom_calls=calls,
                    seconds=float(np.median(seconds)) if seconds else None)


def _relative_error(actual, expected) -> float:
    """max |actual - expected| over max |expected|."""
    return float(jnp.max(jnp.abs(actual - expected))) / max(float(jnp.max(jnp.abs(expected))), 1e-30)


def timing(seconds) -> str:
    return "one run" if seconds is None else f"{seconds * 1e3:.1f} ms per step"


def custom_calls(hlo_text: str) -> list[str]:
    """The jax_ncclx FFI targets a lowered program calls, sorted."""
    return sorted({line.split("custom_call @")[1].split("(")[0] for line in hlo_text.splitlines()
                   if "custom_call @ncclx_" in line})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16, help="training: tokens per batch row (a row per device)")
    parser.add_argument("--decode-tokens", type=int, default=4, help="decode: tokens of the one batch row")
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--mlp", type=int, default=32, help="each expert's intermediate size")
    parser.add_argument("--experts-per-device", type=int, default=2)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs of the sparse path per shape (>= 1)")
    parser.add_argument("--platform", choices=("auto", "cpu"), default="auto",
                        help="auto: every GPU, or 8 virtual CPU devices where there is none")
    args = parser.parse_args()

    jax.config.update("jax_num_cpu_devices", 8)  # before any device use; used only without a GPU
    devices = jax.devices()
    if args.platform == "cpu" or devices[0].platform != "gpu":
        devices = jax.devices("cpu")
    n = len(devices)
    layers = Layers(devices, experts=args.experts_per_device * n, top_k=args.top_k, hidden=args.hidden,
                    mlp=args.mlp)
    print(f"MaxText RoutedMoE on {n} {devices[0].platform.upper()} devices ({devices[0].device_kind}), expert "
          f"parallel over all; {args.experts_per_device * n} experts, top-{args.top_k}, hidden {args.hidden}, "
          f"mlp {args.mlp}; CUDA build: {nx.build_info()['cuda']}")
    passed = True
    for name, batch, seq in (("training", n, args.seq), ("decode", 1, args.decode_tokens)):
        result = layers.compare(batch, seq, repeats=args.repeats)
        # With one device MaxText's layer makes no all-to-all (an expert axis of one member): nothing to route.
        ok = result["worst_relative"] <= RTOL and (result["custom_calls"] or n == 1)
        passed &= bool(ok)
        calls = ", ".join(result["custom_calls"]) or ("none (one device: MaxText sends nothing)" if n == 1 else "none")
        print(f"  {name} [{batch}, {seq}, {args.hidden}]: max |sparse on jax_ncclx - dense| output "
              f"{result['output']:.2e}, gradients {result['gradients']:.2e} (worst relative "
              f"{result['worst_relative']:.1e}); {timing(result['seconds'])}; jax_ncclx calls: {calls}")
    print("PASSED" if passed else "FAILED")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
