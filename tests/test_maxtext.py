"""nx.route_lax on a toy program (every routed op, restored on exit and on an exception, nesting, threads,
forwarded calls logged), then MaxText's MoE layer on it: its expert-parallel sparse path under route_lax
against its dense path, forward and gradients, at a training and a decode shape, run back to back
(examples/maxtext_moe.py does the comparison; MaxText must be installed, requirements-maxtext.txt)."""

import importlib.util
import logging
import os
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ncclx as nx

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "maxtext_moe.py")
N = 8
ROUTED = {"psum": "ncclx_all_reduce", "pmax": "ncclx_all_reduce", "pmin": "ncclx_all_reduce",
          "pmean": "ncclx_all_reduce", "all_gather": "ncclx_all_gather", "psum_scatter": "ncclx_reduce_scatter",
          "all_to_all": "ncclx_all_to_all", "ppermute": "ncclx_ppermute",
          "ragged_all_to_all": "ncclx_ragged_all_to_all"}
XLA_COLLECTIVES = ("stablehlo.all_reduce", "stablehlo.all_gather", "stablehlo.reduce_scatter",
                   "stablehlo.all_to_all", "stablehlo.collective_permute", "@ragged_all_to_all")


def load_example():
    spec = importlib.util.spec_from_file_location("maxtext_moe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mesh():
    return jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:N]), ("x",))


def collectives(v):
    """Per member: v float32 [N]. Every op route_lax routes, but ragged_all_to_all (XLA:CPU cannot run
    jax.lax's), each by jax.lax's name."""
    gathered = jax.lax.all_gather(v, "x", tiled=True)                                   # [N * N]
    parts = [jax.lax.psum(v, "x"), jax.lax.pmax(v, "x"), jax.lax.pmin(v, ("x",)), jax.lax.pmean(v, "x"),
             jax.lax.psum_scatter(gathered, "x", tiled=True),
             jax.lax.all_to_all(gathered, "x", 0, 0, tiled=True)[:N],
             jax.lax.ppermute(v, "x", [(i, (i + 1) % N) for i in range(N)])]
    return sum(parts)


def with_ragged(v):
    """collectives(v) and a ragged_all_to_all: member m sends its row j to member j, at row m there."""
    ones = jnp.ones(N, jnp.int32)
    me = jax.lax.axis_index("x")
    rows = jax.lax.ragged_all_to_all(v[:, None], jnp.zeros((N, 1), v.dtype), jnp.arange(N, dtype=jnp.int32),
                                     ones, ones * me, ones, axis_name="x")
    return collectives(v) + rows[:, 0]


def jitted(fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh(), in_specs=P("x"), out_specs=P("x")))


def ncclx_targets(fn, x):
    text = fn.lower(x).as_text()
    return {line.split("custom_call @")[1].split("(")[0] for line in text.splitlines()
            if "custom_call @ncclx_" in line}, [op for op in XLA_COLLECTIVES if op in text]


def originals():
    return {name: getattr(jax.lax, name) for name in ROUTED}


class TestRouteLax:

    def test_every_op_runs_on_its_twin_with_jax_lax_results(self):
        x = jnp.arange(N * N, dtype=jnp.float32)  # small integers: every sum exact
        want = np.asarray(jitted(collectives)(x))
        with nx.route_lax():
            fn = jitted(with_ragged)
            targets, xla = ncclx_targets(fn, x)
            got = np.asarray(jitted(collectives)(x))
            ragged = np.asarray(fn(x) - jitted(collectives)(x)).reshape(N, N)
        assert targets == set(ROUTED.values()) and not xla, (targets, xla)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        np.testing.assert_array_equal(ragged, np.asarray(x).reshape(N, N).T)  # row j of member m at [j, m]

    def test_restores_on_exit_and_traces_again_outside(self):
        before, x = originals(), jnp.arange(N, dtype=jnp.float32)
        fn = jitted(collectives)
        with nx.route_lax():
            assert any(getattr(jax.lax, name) is not before[name] for name in ROUTED)
            inside = ncclx_targets(fn, x)
            fn(x)
        assert originals() == before
        assert inside[0] and not inside[1]
        targets, xla = ncclx_targets(fn, x)  # jit's cache keeps the traces inside and outside apart
        assert not targets and xla

    def test_restores_on_an_exception(self):
        before = originals()
        with pytest.raises(ZeroDivisionError):
            with nx.route_lax():
                1 / 0
        assert originals() == before

    def test_nested_scopes_route_until_the_outer_one_exits(self):
        before, x = originals(), jnp.arange(N, dtype=jnp.float32)
        with nx.route_lax():
            with nx.route_lax():
                assert ncclx_targets(jitted(collectives), x)[0]
            assert ncclx_targets(jitted(collectives), x)[0]  # the inner exit restores nothing yet
        assert originals() == before

    def test_another_thread_outside_a_scope_keeps_jax_lax(self):
        x, seen = jnp.arange(N, dtype=jnp.float32), {}
        with nx.route_lax():
            thread = threading.Thread(target=lambda: seen.update(outside=ncclx_targets(jitted(collectives), x)))
            thread.start()
            thread.join()
            inside = ncclx_targets(jitted(collectives), x)
        assert inside[0] and not seen["outside"][0] and seen["outside"][1]

    def test_axis_index_groups_go_to_the_twins(self):
        groups = [[0, 2, 4, 6], [1, 3, 5, 7]]

        def body(v):  # v: this member's index
            ones = jnp.ones(len(groups[0]), jnp.int32)
            ragged = jax.lax.ragged_all_to_all(  # slice p: the one row to the group's member p, at its row 0
                v, jnp.zeros_like(v), ones * 0, ones, ones * 0, ones, axis_name="x", axis_index_groups=groups)
            return jnp.concatenate([jax.lax.psum(v, "x", axis_index_groups=groups),
                                    jax.lax.all_gather(v, "x", axis_index_groups=groups, tiled=True), ragged])

        x = jnp.arange(N, dtype=jnp.float32)
        with nx.route_lax():
            fn = jitted(body)
            targets, xla = ncclx_targets(fn, x)
            got = np.asarray(fn(x)).reshape(N, -1)
        assert {"ncclx_ragged_all_to_all", "ncclx_all_gather"} <= targets and not xla, (targets, xla)
        for m in range(N):
            group = groups[m % 2]
            assert got[m, 0] == sum(group) and list(got[m, 1:5]) == group, got[m]
            assert got[m, 5] == group[-1]  # every member of the group wrote row 0: the last one wins

    def test_ragged_capacity_reaches_the_twin(self):
        """ragged_max_recv_per_peer sizes the routed exchange's receive buffer (its capacity attribute)."""
        x = jnp.arange(N * N, dtype=jnp.float32)
        capacity = lambda text: re.findall(r"capacity = (\d+)", text)  # noqa: E731
        with nx.route_lax():
            fn = jitted(with_ragged)
            assert capacity(fn.lower(x).as_text()) == [str(N)]  # output's rows
            want = np.asarray(fn(x))
        with nx.route_lax(ragged_max_recv_per_peer=1):
            fn = jitted(with_ragged)
            assert capacity(fn.lower(x).as_text()) == ["1"]
            np.testing.assert_array_equal(np.asarray(fn(x)), want)  # one row per peer: nothing dropped
        with pytest.raises(ValueError, match="ragged_max_recv_per_peer"), nx.route_lax(ragged_max_recv_per_peer=-1):
            pass

    def test_calls_jax_ncclx_does_not_take_go_to_jax_lax_logged(self, caplog):
        def body(v):  # a constant (jax.lax computes N itself) and a float8 sum (the twin refuses it): jax.lax's
            eight = jax.lax.psum(v.astype(jnp.float8_e4m3fn), "x").astype(jnp.float32)
            return v * jax.lax.psum(1, "x") + eight

        x = jnp.arange(N, dtype=jnp.float32)
        want = np.asarray(jitted(body)(x))
        with caplog.at_level(logging.INFO, logger="jax_ncclx"), nx.route_lax():
            got = np.asarray(jitted(body)(x))
        messages = [r.getMessage() for r in caplog.records if "route_lax" in r.getMessage()]
        assert any("jax.lax.psum runs on jax.lax" in m and "constant" in m for m in messages), messages
        assert any("jax.lax.psum runs on jax.lax" in m and "float8_e4m3fn" in m for m in messages), messages
        np.testing.assert_array_equal(got, want)

    def test_an_unbound_axis_is_a_name_error_naming_op_and_axis(self):
        """jax.lax fails on an axis no shard_map or vmap binds (jax 0.11 with a bare AssertionError); in the
        scope the error is a NameError that names the call and the axis, raised from jax.lax's."""
        x = jnp.arange(N, dtype=jnp.float32)
        with nx.route_lax(), pytest.raises(NameError, match=r"jax\.lax\.psum .*axis 'y' is not bound") as info:
            jitted(lambda v: jax.lax.psum(v, "y"))(x)
        assert info.value.__cause__ is not None
        with nx.route_lax():  # a bound axis inside: unchanged
            np.testing.assert_array_equal(np.asarray(jitted(lambda v: jax.lax.psum(v, "x"))(x)),
                                          np.full(N, x.sum()))


@pytest.fixture(scope="module")
def layers():
    pytest.importorskip("maxtext.layers.moe", reason="MaxText is not installed (requirements-maxtext.txt)")
    example = load_example()
    return example, example.Layers(jax.devices("cpu")[:N], experts=2 * N)


@pytest.mark.parametrize("shape", [(N, 16), (1, 4)], ids=["training", "decode"])
def test_maxtext_sparse_moe_on_jax_ncclx_matches_its_dense_path(layers, shape):
    """Forward and gradients (input and every weight); ten runs back to back, each waited for, give the same
    bits (no deadlock). Decode: batch 1, replicated over the expert axis, so the combine sends the same rows
    to every member (slices that overlap in ragged_all_to_all's operand)."""
    example, built = layers
    result = built.compare(*shape, repeats=10)
    assert "ncclx_ragged_all_to_all" in result["custom_calls"], result
    assert result["worst_relative"] <= example.RTOL, result
