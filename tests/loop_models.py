"""Programs that call jax_ncclx inside loops, as models do, each beside the same program in XLA's own ops:

* a stack of routed MoE layers under ``lax.scan`` (one layer's weights per iteration), each layer optionally
  under ``jax.checkpoint``, so that the backward pass runs dispatch and combine again and then their
  transposes inside the loop;
* tensor-parallel decode steps under ``lax.fori_loop``, every step an all_reduce per layer, then an
  all_to_all, an all_gather and a ppermute (on GPU the NCCL path).

Inside a loop the same call site runs again and again with the device-side call numbers (epochs) of the NVLink
kernels moving on between iterations, and XLA may record the loop body into a command buffer and replay it.
Used by test_loops.py (in process) and loop_worker.py (custom calls captured into CUDA graphs).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_ncclx as nx
from jax_ncclx import moe

AXIS = "x"
TOKENS, HIDDEN, TOP_K, LAYERS = 8, 4, 2, 3  # tokens per member
DECODE_BATCH, DECODE_STEPS = 2, 5             # each member decodes DECODE_BATCH · n rows (all_to_all splits them)
HIGHEST = jax.lax.Precision.HIGHEST


def line_mesh(devices):
    return jax.sharding.Mesh(np.asarray(devices), (AXIS,))


def moe_inputs(n, seed=0):
    """tokens [n·T, H], routers [L, H, E] and expert weights [L, E, H, H], E = 2·n experts."""
    rng = np.random.default_rng(seed)
    num_experts = 2 * n
    return (rng.normal(size=(n * TOKENS, HIDDEN)).astype(np.float32),
            rng.normal(size=(LAYERS, HIDDEN, num_experts)).astype(np.float32),
            (rng.normal(size=(LAYERS, num_experts, HIDDEN, HIDDEN)) / 2).astype(np.float32))


def _route(tokens, router):
    gates, ids = jax.lax.top_k(jnp.dot(tokens, router, precision=HIGHEST), TOP_K)
    return ids.astype(jnp.int32), jax.nn.softmax(gates, axis=-1)


def _stack(layer, tokens, routers, experts, remat):
    body = lambda t, weights: (layer(t, *weights), None)  # noqa: E731
    if remat:
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    return jax.lax.scan(body, tokens, (routers, experts))[0]


def moe_stack_loss(mesh, *, remat):
    """loss(tokens, routers, experts) = sum of squares of the stack's output: every member routes its own
    tokens (top-k, ample capacity, nothing dropped) to experts sharded over the axis, tanh(ragged_dot) experts,
    residual connections."""
    num_experts = 2 * mesh.shape[AXIS]

    def layer(t, router, expert_weights):
        ids, gates = _route(t, router)
        rows, sizes, handle = moe.dispatch(t, ids, num_experts=num_experts, axis_name=AXIS,
                                           capacity=TOKENS * TOP_K)
        out = jnp.tanh(jax.lax.ragged_dot(rows, expert_weights, sizes, precision=HIGHEST))
        return t + moe.combine(out, handle, gates)

    stack = jax.shard_map(lambda t, r, w: _stack(layer, t, r, w, remat), mesh=mesh,
                          in_specs=(P(AXIS), P(), P(None, AXIS)), out_specs=P(AXIS))
    return lambda *args: (stack(*args) ** 2).sum()


def dense_moe_stack_loss(tokens, routers, experts, *, remat):
    """The same stack on whole arrays, every token through its k experts' weights directly."""
    def layer(t, router, expert_weights):
        ids, gates = _route(t, router)
        y = jnp.tanh(jnp.einsum("mh,mkhd->mkd", t, expert_weights[ids], precision=HIGHEST))
        return t + (y * gates[..., None]).sum(axis=1)

    return (_stack(layer, tokens, routers, experts, remat) ** 2).sum()


def moe_stack_programs(mesh, *, remat):
    """(the scanned stack, the dense stack), each jit(value_and_grad): (tokens, routers, experts) -> (loss,
    grads in all three)."""
    grads = lambda loss: jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))  # noqa: E731
    return grads(moe_stack_loss(mesh, remat=remat)), grads(functools.partial(dense_moe_stack_loss, remat=remat))


def assert_loss_and_grads_match(actual, expected, where=""):
    """Two (loss, grads) results of moe_stack_programs agree."""
    (loss, grads), (expected_loss, expected_grads) = actual, expected
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5, err_msg=where)
    for name, grad, ref in zip(("tokens", "routers", "expert weights"), grads, expected_grads):
        np.testing.assert_allclose(grad, ref, rtol=1e-4, atol=1e-4, err_msg=f"{where} {name}")


def decode_inputs(n, seed=0):
    """x [n · B·n, H] (B·n rows per member, B = DECODE_BATCH) and layer weights [L, H, H]."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n * DECODE_BATCH * n, HIDDEN)).astype(np.float32),
            (rng.normal(size=(LAYERS, HIDDEN, HIDDEN)) / 4).astype(np.float32))


def _decode(x, weights, all_reduce, all_to_all, all_gather, ppermute):
    def step(_, x):
        for layer in range(LAYERS):
            x = x + jnp.tanh(all_reduce(jnp.dot(x, weights[layer], precision=HIGHEST), AXIS))
        x = x + 0.5 * jnp.tanh(all_to_all(x, AXIS, 0, 0, tiled=True))
        gathered = all_gather(x, AXIS, tiled=True)  # [n · B·n, H]
        x = x + 0.1 * gathered.reshape(-1, *x.shape).mean(axis=0)
        size = jax.lax.axis_size(AXIS)
        return x + 0.1 * ppermute(x, AXIS, [(i, (i + 1) % size) for i in range(size)])  # a pipeline's hop

    return jax.lax.fori_loop(0, DECODE_STEPS, step, x)


def decode(mesh, *, use_nx):
    """jit(decode)(x, weights) -> x after the steps, with jax_ncclx's collectives or jax.lax's."""
    ops = (nx.all_reduce, nx.all_to_all, nx.all_gather, nx.ppermute) if use_nx else \
        (jax.lax.psum, jax.lax.all_to_all, jax.lax.all_gather, jax.lax.ppermute)
    return jax.jit(jax.shard_map(lambda x, w: _decode(x, w, *ops), mesh=mesh, in_specs=(P(AXIS), P()),
                                 out_specs=P(AXIS)))
