"""Programs whose jax_ncclx collectives do not depend on each other, run many times against the same program
written with jax.lax. Imported by tests/test_ordering.py; run as a script for more virtual CPU devices than
the test process has:

    python tests/ordering_worker.py DEVICES RUNS   # prints ORDERING OK, or the failures and exits 1

Each branch feeds its collective through a chain of matmuls big enough that XLA:CPU runs the branches
concurrently rather than one after another, so devices reach the collectives in different orders. In
"one_function_called_four_times" the four calls are copies of one call site (JAX lowers the jitted function
once), which devices must still tell apart.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

ROWS, HIDDEN, BRANCHES = 256, 256, 4
CASES = ["four_all_to_alls", "every_dense_op", "loop_beside_a_call", "one_function_called_four_times",
         "ragged_beside_dense"]


def _chain(h, w):
    for _ in range(3):
        h = jnp.tanh(h @ w)
    return h


def _program(case, ops):
    """The per-shard function of ``case`` on ``ops`` (jax_ncclx or jax.lax): a [BRANCHES, R, H] input and a
    [H, H] weight in, a stack of every branch's result out."""
    all_reduce, all_gather, reduce_scatter, all_to_all, ppermute, ragged = ops

    def body(a, w):
        size = jax.lax.axis_size("x")
        branches = [_chain(a[k], w) for k in range(BRANCHES)]
        if case == "four_all_to_alls":  # with one of XLA's own (blocking) collectives beside them
            out = [all_to_all(h, "x", 0, 0, tiled=True) for h in branches]
            out.append(jax.lax.psum(a[0], "x"))
        elif case == "every_dense_op":
            perm = [(i, (i + 1) % size) for i in range(size)]
            out = [all_reduce(branches[0], "x"),
                   all_gather(branches[1], "x", tiled=True)[: branches[1].shape[0]],
                   jnp.tile(reduce_scatter(branches[2], "x", tiled=True), (size, 1)),
                   ppermute(branches[3], "x", perm)]
        elif case == "one_function_called_four_times":  # one call site in the program, four calls after inlining
            shared = jax.jit(lambda h: all_to_all(_chain(h, w), "x", 0, 0, tiled=True))
            out = [shared(a[k] * (k + 1)) for k in range(BRANCHES)]
        elif case == "ragged_beside_dense":  # MaxText's pattern: ragged exchanges beside an all_gather
            rows = ROWS // size
            offsets = jnp.arange(size, dtype=jnp.int32) * rows
            sizes = jnp.full((size,), rows, jnp.int32)
            landing = jnp.full((size,), jax.lax.axis_index("x") * rows, jnp.int32)
            out = [ragged(h, jnp.zeros_like(h), offsets, sizes, landing, sizes, axis_name="x")
                   for h in branches[:3]]
            out.append(all_gather(branches[3], "x", tiled=True)[: branches[3].shape[0]])
        else:  # a loop with a collective inside, beside a collective outside it
            looped = jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(all_to_all(h, "x", 0, 0, tiled=True)), branches[0])
            out = [looped, all_reduce(branches[1], "x"), branches[2], branches[3]]
        return jnp.stack(out)

    return body


def _ops(library):
    if library == "lax":
        # The ragged case sends block j of each member to member j, landing in source order: a tiled
        # all_to_all, which XLA:CPU runs (it has no ragged_all_to_all).
        def ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
            return jax.lax.all_to_all(operand, axis_name, 0, 0, tiled=True)

        return (jax.lax.psum, jax.lax.all_gather, jax.lax.psum_scatter, jax.lax.all_to_all, jax.lax.ppermute, ragged)
    import jax_ncclx as nx

    return (nx.all_reduce, nx.all_gather, nx.reduce_scatter, nx.all_to_all, nx.ppermute, nx.ragged_all_to_all)


def run(devices, case, runs):
    """Runs ``case`` ``runs`` times on a 1-D mesh of ``devices``; returns the messages of the failed runs."""
    mesh = jax.sharding.Mesh(np.asarray(devices), ("x",))
    n = len(devices)
    rng = np.random.default_rng(0)
    a = jax.device_put(rng.normal(size=(BRANCHES, n * ROWS, HIDDEN)).astype(np.float32),
                       NamedSharding(mesh, P(None, "x")))
    w = jax.device_put((rng.normal(size=(HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32),
                       NamedSharding(mesh, P()))

    def compiled(library):
        return jax.jit(jax.shard_map(_program(case, _ops(library)), mesh=mesh, in_specs=(P(None, "x"), P()),
                                     out_specs=P(None, "x")))

    with jax.default_matmul_precision("highest"):
        expected = np.asarray(compiled("lax")(a, w))
        ours = compiled("ncclx")
        failures = []
        for i in range(runs):
            try:
                np.testing.assert_allclose(np.asarray(ours(a, w)), expected, rtol=1e-5, atol=1e-5)
            except Exception as error:  # noqa: BLE001 - a timeout or a mismatch, reported with its run
                failures.append(f"run {i}: {type(error).__name__}: {str(error)[:500]}")
    return failures


if __name__ == "__main__":
    num_devices, num_runs = int(sys.argv[1]), int(sys.argv[2])
    jax.config.update("jax_num_cpu_devices", num_devices)
    failed = [f"{case} {message}" for case in CASES for message in run(jax.devices("cpu"), case, num_runs)]
    print("\n".join(failed) if failed else "ORDERING OK")
    sys.exit(1 if failed else 0)
