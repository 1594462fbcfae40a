"""Global view: on arrays sharded over a mesh axis, outside shard_map, each op works per shard and the compiled
program holds only this package's custom calls: no all-gather (or any other XLA collective) is added."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ncclx as nx
from helpers import random_array

XLA_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")

OPS = {
    "all_reduce": lambda v: nx.all_reduce(v, "x"),
    "all_gather": lambda v: nx.all_gather(v, "x", tiled=True),
    "reduce_scatter": lambda v: nx.reduce_scatter(v, "x", tiled=True),
    "all_to_all": lambda v: nx.all_to_all(v, "x", 0, 0, tiled=True),
    "ppermute": lambda v: nx.ppermute(v, "x", [(0, 1), (1, 0)]),
}


@pytest.fixture
def line(backend):
    return jax.sharding.Mesh(np.asarray(backend), ("x",))


@pytest.mark.parametrize("name", OPS)
def test_global_view_matches_shard_map(line, name):
    x = jax.device_put(random_array((line.size * line.size * 2, 3), jnp.float32), NamedSharding(line, P("x")))
    expected = jax.jit(jax.shard_map(OPS[name], mesh=line, in_specs=P("x"), out_specs=P("x")))(x)
    with jax.set_mesh(line):  # on GPU the communicators need the mesh's concrete devices at compile time
        compiled = jax.jit(OPS[name]).lower(x).compile()
    np.testing.assert_array_equal(compiled(x), expected)
    assert compiled(x).sharding.spec == P("x")
    hlo = compiled.as_text()
    assert f"ncclx_{name}" in hlo
    assert not [op for op in XLA_COLLECTIVES if op in hlo], hlo


def test_global_view_under_set_mesh(line):
    n = line.size
    x = jax.device_put(random_array((n * n, 2), jnp.float32), NamedSharding(line, P("x")))  # a row per peer
    counts = jax.device_put(np.full((n * n,), 1, np.int32), NamedSharding(line, P("x")))
    with jax.set_mesh(line):
        y, recv, dropped = jax.jit(lambda a, c: nx.all_to_allv_dynamic(a, c, "x", max_recv_per_peer=2))(x, counts)
    assert y.shape == (n * n, 2, 2) and y.sharding.spec[0] == "x"
    np.testing.assert_array_equal(recv, 1)
    np.testing.assert_array_equal(dropped, 0)
    rows = np.asarray(x).reshape(n, n, 2)  # [source j, destination i]
    received = np.asarray(y).reshape(n, n, 2, 2)  # [member i, source j, slot, feature]
    np.testing.assert_array_equal(received[:, :, 0], rows.transpose(1, 0, 2))
    np.testing.assert_array_equal(received[:, :, 1], 0)


def test_global_view_of_the_ragged_ops_adds_no_xla_collective(line):
    """all_to_allv_dynamic and ragged_all_to_all on global arrays compile to this package's custom calls only."""
    n = line.size
    sharded = lambda a: jax.device_put(a, NamedSharding(line, P("x")))  # noqa: E731
    x = sharded(random_array((n * n, 2), jnp.float32))
    ones = sharded(np.ones((n * n,), np.int32))
    offsets = sharded(np.tile(np.arange(n, dtype=np.int32), n))
    calls = {
        "all_to_allv_dynamic": (lambda a, c: nx.all_to_allv_dynamic(a, c, "x", max_recv_per_peer=2)[0], (x, ones)),
        # member i sends row j to member j, which puts it at row i
        "ragged_all_to_all": (lambda a, o, c, r: nx.ragged_all_to_all(a, jnp.zeros_like(a), o, c, r, c,
                                                                      axis_name="x"),
                              (x, offsets, ones, sharded(np.repeat(np.arange(n, dtype=np.int32), n)))),
    }
    for name, (fn, args) in calls.items():
        with jax.set_mesh(line):
            hlo = jax.jit(fn).lower(*args).compile().as_text()
        assert f"ncclx_{name}" in hlo, name
        assert not [op for op in XLA_COLLECTIVES if op in hlo], (name, hlo)


def explicit_line(line):
    return jax.sharding.Mesh(line.devices, ("x",), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.mark.parametrize("name", OPS)
def test_global_view_on_an_explicit_mesh(line, name):
    """On a mesh of explicit axes (jax.make_mesh's default), where shard_map takes its inputs as they are
    sharded, the op works per shard as on an automatic one."""
    mesh = explicit_line(line)
    x = random_array((line.size * line.size * 2, 3), jnp.float32)
    expected = jax.jit(jax.shard_map(OPS[name], mesh=line, in_specs=P("x"), out_specs=P("x")))(
        jax.device_put(x, NamedSharding(line, P("x"))))
    with jax.set_mesh(mesh):
        actual = jax.jit(OPS[name])(jax.device_put(x, NamedSharding(mesh, P("x"))))
    np.testing.assert_array_equal(actual, expected)
    assert jax.typeof(actual).sharding.spec == P("x", None)


def test_leading_dimension_over_more_axes_is_pointed_to_shard_map():
    """An array whose leading dimension is split over the axis and another one (one block per device of a 2-D
    mesh) is refused with the shard_map that gives jax.lax's per-group result, and the reshard the error offers
    runs as written, outside any mesh context."""
    mesh = jax.make_mesh((2, len(jax.devices()) // 2), ("dp", "x"))  # explicit axes
    x = jax.device_put(jnp.arange(mesh.size * 6.0).reshape(mesh.size * 2, 3), NamedSharding(mesh, P(("dp", "x"))))
    expected_error = ("argument 0 is sharded P(('dp', 'x')). Reshard it first (jax.reshard(arg, NamedSharding(mesh, "
                      "P('x')))) or call all_reduce inside jax.shard_map with in_specs=P(('dp', 'x')), which keeps "
                      "one result per group of 'dp' as jax.lax does")
    with pytest.raises(ValueError, match=re.escape(expected_error)):
        nx.all_reduce(x, "x")
    spec = P(("dp", "x"))
    per_group = jax.jit(jax.shard_map(lambda v: nx.all_reduce(v, "x"), mesh=mesh, in_specs=spec, out_specs=spec))(x)
    expected = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=spec, out_specs=spec))(x)
    np.testing.assert_array_equal(per_group, expected)
    resharded = nx.all_reduce(jax.reshard(x, NamedSharding(mesh, P("x"))), "x")
    blocks = np.asarray(x).reshape(mesh.shape["x"], -1, 3)
    np.testing.assert_array_equal(resharded, np.tile(blocks.sum(0), (mesh.shape["x"], 1)))


@pytest.mark.parametrize("spec, text", [(P(), "P()"), (P(None, "x"), "P(None, 'x')")], ids=["replicated", "dim1"])
def test_explicit_mesh_input_sharded_otherwise_is_named(line, spec, text):
    """An input sharded otherwise than along its leading dimension is refused by this package, naming the
    argument and its sharding, not by JAX's error about in_specs the caller never wrote."""
    mesh = explicit_line(line)
    x = jax.device_put(jnp.ones((line.size * 2, line.size)), NamedSharding(mesh, spec))
    counts = jax.device_put(jnp.ones((line.size * line.size,), jnp.int32), NamedSharding(mesh, P("x")))
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=re.escape(f"argument 0 is sharded {text}. Reshard it first "
                                                       "(jax.reshard(arg, NamedSharding(mesh, P('x')))) or call "
                                                       "all_reduce inside jax.shard_map\n")):
            jax.jit(lambda v: nx.all_reduce(v, "x"))(x)
        with pytest.raises(ValueError, match=re.escape("all_to_allv_dynamic: outside shard_map it runs per shard of "
                                                       "arrays whose leading dimension is sharded over 'x', and "
                                                       "nothing else; argument 1 is sharded P()")):
            jax.jit(lambda v, c: nx.all_to_allv_dynamic(v, c, "x", max_recv_per_peer=2))(
                jax.device_put(x, NamedSharding(mesh, P("x"))), jax.device_put(counts, NamedSharding(mesh, P())))


def test_explicit_mesh_input_made_outside_the_mesh_is_named(line):
    """An array made before the mesh was set (no sharding on it) is replicated to shard_map on an explicit mesh:
    refused by this package, naming the argument, not by JAX's error about in_specs."""
    x = jnp.ones((line.size * 2, 3))
    with jax.set_mesh(explicit_line(line)):
        with pytest.raises(ValueError, match=re.escape("all_reduce: outside shard_map it runs per shard of arrays "
                                                       "whose leading dimension is sharded over 'x', and nothing "
                                                       "else; argument 0 is sharded P()")):
            nx.all_reduce(x, "x")


def test_global_view_needs_a_leading_dimension_of_whole_blocks(line):
    """Outside shard_map each array's leading dimension holds the members' blocks: a length that does not split
    into them is refused by this package, naming the argument, not by JAX's error about in_specs."""
    if line.size == 1:
        pytest.skip("every length splits over one member")
    x = jnp.ones((line.size * 2 + 1, 3))
    with jax.set_mesh(line):
        with pytest.raises(ValueError, match=re.escape(
                f"all_reduce: outside shard_map every argument's leading dimension holds the {line.size} members' "
                f"blocks of 'x', so it must be a multiple of {line.size}; argument 0 has shape "
                f"({line.size * 2 + 1}, 3)")):
            jax.jit(lambda v: nx.all_reduce(v, "x"))(x)
