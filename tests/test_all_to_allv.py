"""all_to_allv_dynamic against the NumPy reference: adversarial count patterns, both layouts, K chunks per
peer, rows gathered through send_rows and extended by a suffix, dtypes, vmap (one call), grad, and both axes
of a 2-D mesh; on CPU and, where present, on GPUs through both transports (the NVLink kernel, required to be
taken, and the NCCL path)."""

import math
import os

import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ncclx as nx
import reference
from conftest import gpu_devices, gpu_skip_reason, run_command_buffer_worker, skip_degenerate_tuple
from helpers import assert_same, random_array

ROWS, FEATURES, CAPACITY = 12, 5, 4
NVLINK_TARGET = "ncclx_all_to_allv_dynamic_nvlink"


GPU_TRANSPORTS = {  # param -> (JAX_NCCLX_TRANSPORT, JAX_NCCLX_NVLINK_DIRECT)
    "gpu-nvlink": ("nvlink", "1"),         # rows written straight into the peers' outputs
    "gpu-nvlink-staged": ("nvlink", "0"),  # rows staged in symmetric memory, as with one process per GPU
    "gpu-nccl": ("nccl", "1"),
}


@pytest.fixture(params=["cpu", *(pytest.param(name, marks=pytest.mark.gpu) for name in GPU_TRANSPORTS)])
def backend(request, monkeypatch):
    """Overrides conftest's: GPUs run through each transport; "nvlink" makes a fallback to NCCL an error. The
    settings are read when a program is lowered."""
    if request.param == "cpu":
        return jax.devices("cpu")
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    transport, direct = GPU_TRANSPORTS[request.param]
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", transport)
    monkeypatch.setenv("JAX_NCCLX_NVLINK_DIRECT", direct)
    return gpu_devices()


def counts_for(pattern, n, k, seed):
    return reference.count_pattern(pattern, n, k, seed, rows=ROWS, capacity=CAPACITY)


def line_mesh(backend):
    return jax.sharding.Mesh(np.asarray(backend), ("x",))


def run(mesh, axis, xs, counts, layout, capacity=CAPACITY, prepare=lambda x: x, send_rows=None, suffix=None):
    n = len(xs)
    optional = {name: jnp.asarray(v) for name, v in (("send_rows", send_rows), ("suffix", suffix)) if v is not None}

    def body(x, c, *values):
        y, recv, dropped = nx.all_to_allv_dynamic(prepare(x[0]), c[0], axis, max_recv_per_peer=capacity,
                                                  layout=layout, **{k: v[0] for k, v in zip(optional, values)})
        return y[None], recv[None], dropped[None]

    spec = P(mesh.axis_names)
    args = (jnp.asarray(xs), jnp.asarray(counts), *optional.values())
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec))
    out = f(*args)
    return [tuple(np.asarray(o[i]) for o in out) for i in range(n)]


def random_send_rows(n, num_rows, source_rows, seed):
    """[n, num_rows] int32 indices into x's source_rows rows: repeats, and some outside x on both sides."""
    return np.random.default_rng(seed).integers(-2, source_rows + 2, size=(n, num_rows)).astype(np.int32)


def lax_exchange(n, rows, counts, layout, capacity=CAPACITY):
    """A per-shard exchange on axis "x" made of jax.lax ops only (all_gather, then a gather of where the NumPy
    reference lands each row), for the gradients to be checked against: [rows, F...] -> the layout's y."""
    ids = [np.arange(1, rows + 1, dtype=np.float64)[:, None] + source * rows for source in range(n)]
    landed = np.stack([y.reshape(-1) for y, _, _ in reference.all_to_allv(ids, list(counts), capacity, layout)])
    index = np.where(landed > 0, landed - 1, n * rows).astype(np.int32)  # n * rows: nothing landed there
    shape = (n * capacity,) if layout == "packed" else (n, capacity)

    def exchange(v):
        everything = jax.lax.all_gather(v, "x", tiled=True)
        taken = jnp.take(everything, jnp.asarray(index)[jax.lax.axis_index("x")], axis=0, mode="fill",
                         fill_value=0)
        return taken.reshape(*shape, *v.shape[1:])
    return exchange


def check(actual, expected, dtype):
    for (y, recv, dropped), (ry, rrecv, rdropped) in zip(actual, expected):
        assert_same(y, ry, dtype, reduced=False)
        np.testing.assert_array_equal(recv, rrecv)
        np.testing.assert_array_equal(dropped, rdropped)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("pattern", ["zero", "one_peer", "at_capacity", "overflow", "bad", "random"])
def test_patterns(backend, pattern, k, layout):
    mesh = line_mesh(backend)
    n = len(backend)
    xs = random_array((n, ROWS, FEATURES), jnp.float32)
    counts = counts_for(pattern, n, k, seed=k)
    if k == 1 and pattern == "random":
        counts = counts[..., 0]  # the [N] form
    check(run(mesh, "x", xs, counts, layout), reference.all_to_allv(list(xs), list(counts), CAPACITY, layout),
          jnp.float32)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("pattern", ["at_capacity", "overflow", "bad", "random"])
def test_many_chunks(backend, pattern, layout):
    """33 chunks per peer: the NVLink kernel plans a peer's rows with a warp from 8 chunks on, in passes of
    32 chunks."""
    n, rows, capacity, k = len(backend), 160, 48, 33
    xs = random_array((n, rows, FEATURES), jnp.float32)
    counts = reference.count_pattern(pattern, n, k, seed=k, rows=rows, capacity=capacity)
    check(run(line_mesh(backend), "x", xs, counts, layout, capacity=capacity),
          reference.all_to_allv(list(xs), list(counts), capacity, layout), jnp.float32)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("pattern", ["overflow", "bad", "random"])
def test_send_rows_gather_on_the_way(backend, pattern, layout):
    """send_rows (repeats, indices outside x, S != X) gives the result of sending x[send_rows]."""
    mesh = line_mesh(backend)
    n = len(backend)
    source_rows = ROWS - 5
    xs = random_array((n, source_rows, FEATURES), jnp.float32)
    send_rows = random_send_rows(n, ROWS, source_rows, seed=13)
    counts = counts_for(pattern, n, 2, seed=2)
    expected = reference.all_to_allv(reference.gather_rows(xs, send_rows), list(counts), CAPACITY, layout)
    check(run(mesh, "x", xs, counts, layout, send_rows=send_rows), expected, jnp.float32)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("indexed", [False, True], ids=["x", "send_rows"])
@pytest.mark.parametrize("features, columns, dtype", [(5, 3, jnp.float32), (64, 8, jnp.bfloat16), (5, 3, jnp.int8),
                                                      (5, 3, jnp.complex64)],
                         ids=["4-byte", "16-byte", "1-byte", "complex"])  # the widest copy unit the rows allow
def test_suffix_travels_with_rows(backend, layout, indexed, features, columns, dtype):
    """A suffix gives the result of sending concat(x[send_rows], suffix): the suffix follows its send row
    even where the index falls outside x (a zero row with its suffix)."""
    mesh = line_mesh(backend)
    n = len(backend)
    source_rows = ROWS - 5 if indexed else ROWS
    xs = random_array((n, source_rows, features), dtype)
    suffix = random_array((n, ROWS, columns), dtype, seed=3)
    send_rows = random_send_rows(n, ROWS, source_rows, seed=13) if indexed else None
    counts = counts_for("overflow", n, 2, seed=2)
    rows = reference.gather_rows(xs, send_rows) if indexed else list(xs)
    sent = [np.concatenate([r, t], axis=1) for r, t in zip(rows, suffix)]
    expected = reference.all_to_allv(sent, list(counts), CAPACITY, layout)
    check(run(mesh, "x", xs, counts, layout, send_rows=send_rows, suffix=suffix), expected, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.int32, jnp.int8, jnp.float8_e4m3fn, jnp.bool_,
                                   jnp.complex64], ids=lambda d: jnp.dtype(d).name)
def test_dtypes(backend, dtype):
    n = len(backend)
    xs = random_array((n, ROWS, 3), dtype)
    counts = counts_for("overflow", n, 2, seed=3)
    check(run(line_mesh(backend), "x", xs, counts, "packed"),
          reference.all_to_allv(list(xs), list(counts), CAPACITY, "packed"), dtype)


@pytest.mark.parametrize("features", [(), (0,), (7, 3)])
def test_feature_shapes(backend, features):
    n = len(backend)
    xs = random_array((n, ROWS, *features), jnp.float32)
    counts = counts_for("random", n, 1, seed=5)
    expected = reference.all_to_allv(list(xs), list(counts), CAPACITY, "padded")
    prepare = lambda x: x  # noqa: E731
    if features == (0,):
        # XLA 0.11.2's Shardy pass crashes on a zero-size shard_map *input*; make the empty rows inside instead.
        xs, prepare = random_array((n, ROWS, 1), jnp.float32), lambda x: x[:, :0]
    check(run(line_mesh(backend), "x", xs, counts, "padded", prepare=prepare), expected, jnp.float32)


def test_zero_capacity(backend):
    n = len(backend)
    xs = random_array((n, ROWS, 2), jnp.float32)
    counts = counts_for("random", n, 1, seed=6)
    check(run(line_mesh(backend), "x", xs, counts, "packed", capacity=0),
          reference.all_to_allv(list(xs), list(counts), 0, "packed"), jnp.float32)


@pytest.mark.parametrize("axis", ["a", "b", ("a", "b"), ("b", "a")], ids=lambda a: "+".join(a))
def test_either_axis_of_2d_mesh(mesh, axis):
    """On a ("a", "b") mesh the exchange runs within each group along the chosen axis, or along both axes taken
    as one (members ordered with the first axis major, as jax.lax.axis_index of the tuple)."""
    skip_degenerate_tuple(mesh, axis)
    rows, k, layout = 8, 2, "padded"
    names = axis if isinstance(axis, tuple) else (axis,)
    x = random_array((mesh.size, rows, 3), jnp.float32).reshape(mesh.shape["a"], mesh.shape["b"], rows, 3)
    size = math.prod(mesh.shape[name] for name in names)
    counts = np.random.default_rng(0).integers(0, 3, size=(mesh.shape["a"], mesh.shape["b"], size, k))

    def body(v, c):
        y, recv, dropped = nx.all_to_allv_dynamic(v[0, 0], c[0, 0], axis, max_recv_per_peer=CAPACITY, layout=layout)
        return y[None, None], recv[None, None], dropped[None, None]

    spec = P("a", "b")
    outputs = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec))(
        jnp.asarray(x), jnp.asarray(counts.astype(np.int32)))

    def groups(a):  # [size, groups, ...]: the named mesh axes first, in order, merged
        moved = np.moveaxis(np.asarray(a), [("a", "b").index(name) for name in names], range(len(names)))
        return moved.reshape(size, -1, *moved.shape[2:])

    y, recv, dropped = (groups(o) for o in outputs)
    for g in range(groups(x).shape[1]):  # each group on its own
        expected = reference.all_to_allv(list(groups(x)[:, g]), list(groups(counts)[:, g]), CAPACITY, layout)
        check([(y[i, g], recv[i, g], dropped[i, g]) for i in range(size)], expected, jnp.float32)


@pytest.mark.parametrize("operands", ["x", "send_rows", "suffix"])
def test_vmap_is_one_call(backend, operands):
    """Two routings at once under vmap: each matches the reference, and the jaxpr holds one collective."""
    n = len(backend)
    mesh = line_mesh(backend)
    xs = random_array((n, 2, ROWS, 3), jnp.float32)
    suffix = random_array((n, 2, ROWS, 2), jnp.float32, seed=5)
    counts = np.stack([counts_for("overflow", n, 2, seed=s) for s in (7, 8)], axis=1)  # [n, 2, n, k]
    send_rows = np.stack([random_send_rows(n, ROWS, ROWS, seed=s) for s in (1, 2)], axis=1)  # [n, 2, S]
    indexed = operands != "x"

    def body(x, c, i, t):
        f = jax.vmap(lambda u, v, w, z: nx.all_to_allv_dynamic(
            u, v, "x", max_recv_per_peer=CAPACITY, layout="packed", send_rows=w if indexed else None,
            suffix=z if operands == "suffix" else None))
        return tuple(o[None] for o in f(x[0], c[0], i[0], t[0]))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 4, out_specs=P("x")))
    args = jnp.asarray(xs), jnp.asarray(counts), jnp.asarray(send_rows), jnp.asarray(suffix)
    out = f(*args)
    for b in range(2):
        sent = reference.gather_rows(xs[:, b], send_rows[:, b]) if indexed else list(xs[:, b])
        if operands == "suffix":
            sent = [np.concatenate([r, t], axis=1) for r, t in zip(sent, suffix[:, b])]
        expected = reference.all_to_allv(sent, list(counts[:, b]), CAPACITY, "packed")
        check([tuple(np.asarray(o[i, b]) for o in out) for i in range(n)], expected, jnp.float32)
    assert str(jax.make_jaxpr(f)(*args)).count("ncclx_all_to_allv_dynamic") == 1


@pytest.mark.parametrize("operands", ["x", "send_rows", "suffix"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("pattern", ["at_capacity", "overflow", "bad", "random"])
def test_vmap_over_its_own_axis(pattern, layout, operands):
    """jax.vmap(..., axis_name="i") over the exchange's own axis, an inner vmap batching two routings: the
    members are the batch entries and the rows move by gathers here, as the reference says, with no collective
    in the jaxpr. The gradient in x and the suffix matches the exchange's over a CPU mesh of as many devices."""
    n = 4
    xs = random_array((n, 2, ROWS - 2, 3), jnp.float32)
    suffix = random_array((n, 2, ROWS, 2), jnp.float32, seed=5)
    counts = np.stack([counts_for(pattern, n, 2, seed=s) for s in (7, 8)], axis=1)  # [n, 2, n, k]
    send_rows = np.stack([random_send_rows(n, ROWS, ROWS - 2, seed=s) for s in (1, 2)], axis=1)  # [n, 2, S]
    if operands == "x":
        xs = random_array((n, 2, ROWS, 3), jnp.float32)
    args = jnp.asarray(xs), jnp.asarray(counts), jnp.asarray(send_rows), jnp.asarray(suffix)

    def exchange(axis):
        return jax.vmap(lambda u, v, w, z: nx.all_to_allv_dynamic(
            u, v, axis, max_recv_per_peer=CAPACITY, layout=layout, send_rows=None if operands == "x" else w,
            suffix=z if operands == "suffix" else None))

    f = jax.jit(jax.vmap(exchange("i"), axis_name="i"))
    out = f(*args)
    for b in range(2):
        sent = list(xs[:, b]) if operands == "x" else reference.gather_rows(xs[:, b], send_rows[:, b])
        if operands == "suffix":
            sent = [np.concatenate([r, t], axis=1) for r, t in zip(sent, suffix[:, b])]
        expected = reference.all_to_allv(sent, list(counts[:, b]), CAPACITY, layout)
        check([tuple(np.asarray(o[i, b]) for o in out) for i in range(n)], expected, jnp.float32)
    assert "ncclx_" not in str(jax.make_jaxpr(f)(*args))

    mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:n]), ("x",))
    over_mesh = jax.shard_map(lambda *a: tuple(o[None] for o in exchange("x")(*(v[0] for v in a))), mesh=mesh,
                              in_specs=(P("x"),) * 4, out_specs=P("x"))
    w = random_array(out[0].shape, jnp.float32, seed=11)

    def grad(g):
        return jax.jit(jax.grad(lambda x, t: (g(x, args[1], args[2], t)[0] * w).sum(), argnums=(0, 1)))(
            args[0], args[3])

    for ours, theirs in zip(grad(f), grad(over_mesh)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_vmap_over_its_own_axis_with_extreme_counts(layout):
    """Counts at the ends of int32, whose requests overflow it, give over a vmapped axis what the kernels' plan
    gives on a CPU mesh: dropped saturates at INT32_MAX."""
    n, k = 4, 2
    xs = random_array((n, ROWS, 3), jnp.float32)
    top, bottom = np.iinfo(np.int32).max, np.iinfo(np.int32).min
    counts = np.random.default_rng(3).choice([top, bottom, top - 1, bottom + 1, 3, -1, 0], size=(n, n, k))
    counts = counts.astype(np.int32)
    over_vmap = jax.jit(jax.vmap(lambda u, v: nx.all_to_allv_dynamic(u, v, "i", max_recv_per_peer=CAPACITY,
                                                                      layout=layout), axis_name="i"))(xs, counts)
    over_mesh = run(jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:n]), ("x",)), "x", xs, counts, layout)
    check([tuple(np.asarray(o[i]) for o in over_vmap) for i in range(n)], over_mesh, jnp.float32)
    assert (np.asarray(over_vmap[2]) == top).any()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_grad_sends_cotangents_back(backend, layout):
    """d/dx sum(w * y) is w at the position each row landed, and zero for dropped rows."""
    n = len(backend)
    mesh = line_mesh(backend)
    xs = random_array((n, ROWS, 3), jnp.float32)
    counts = counts_for("bad", n, 2, seed=9)
    w = random_array((n * CAPACITY, 3) if layout == "packed" else (n, CAPACITY, 3), jnp.float32, seed=2)

    def loss(x):
        body = lambda v, c: (nx.all_to_allv_dynamic(v[0], c[0], "x", max_recv_per_peer=CAPACITY,  # noqa: E731
                                                    layout=layout)[0] * w).sum()[None]
        return jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"))(
            x, jnp.asarray(counts)).sum()

    grad = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(xs)))
    # y is linear in x: push unit rows through the reference to find where each row lands.
    expected = np.zeros_like(xs)
    for src in range(n):
        for row in range(ROWS):
            unit = np.zeros((n, ROWS, 1), np.float32)
            unit[src, row] = 1
            landed = reference.all_to_allv(list(unit), list(counts), CAPACITY, layout)
            expected[src, row] = sum((y * w).reshape(-1, 3).sum(0) for y, _, _ in landed)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6)


def test_grad_of_complex_rows(backend):
    """Complex rows differentiate as in jax.lax (lax_exchange), real and imaginary parts each sent back."""
    n = len(backend)
    mesh = line_mesh(backend)
    xs = jnp.asarray(random_array((n, ROWS, 3), jnp.complex64))
    counts = counts_for("overflow", n, 2, seed=9)
    reference_exchange = lax_exchange(n, ROWS, counts, "padded")

    def loss(x, ours):
        def body(v, c):
            y = (nx.all_to_allv_dynamic(v[0], c[0], "x", max_recv_per_peer=CAPACITY)[0] if ours else
                 reference_exchange(v[0]))
            return (jnp.abs(jnp.sin(y)) ** 2).sum()[None]
        return jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 2, out_specs=P("x"))(x, jnp.asarray(counts)).sum()

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    np.testing.assert_allclose(np.asarray(grad(xs, True)), np.asarray(grad(xs, False)), rtol=1e-5, atol=1e-6)


def test_grad_through_send_rows(backend):
    """The gradient with send_rows, and that of gathering first, equal jax.lax's (lax_exchange after the same
    gather): cotangents of repeated rows add up, and rows outside x get none."""
    n = len(backend)
    mesh = line_mesh(backend)
    source_rows = ROWS - 4
    xs = jnp.asarray(random_array((n, source_rows, 3), jnp.float32))
    send_rows = jnp.asarray(random_send_rows(n, ROWS, source_rows, seed=5))
    counts = counts_for("overflow", n, 2, seed=9)
    w = random_array((n * CAPACITY, 3), jnp.float32, seed=2)
    reference_exchange = lax_exchange(n, ROWS, counts, "packed")

    def loss(x, how):
        def body(v, c, i):
            index = i[0]
            outside = (index < 0) | (index >= source_rows)  # jnp.take wraps negative indices: move them out
            gathered = jnp.take(v[0], jnp.where(outside, source_rows, index), axis=0, mode="fill", fill_value=0)
            if how == "fused":
                y = nx.all_to_allv_dynamic(v[0], c[0], "x", max_recv_per_peer=CAPACITY, layout="packed",
                                           send_rows=index)[0]
            elif how == "gathered":
                y = nx.all_to_allv_dynamic(gathered, c[0], "x", max_recv_per_peer=CAPACITY, layout="packed")[0]
            else:
                y = reference_exchange(gathered)
            return (y * w).sum()[None]
        return jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x"))(
            x, jnp.asarray(counts), send_rows).sum()

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    expected = np.asarray(grad(xs, "lax"))
    assert np.abs(expected).sum() > 0
    for how in ("fused", "gathered"):
        np.testing.assert_allclose(np.asarray(grad(xs, how)), expected, rtol=1e-6, atol=1e-6, err_msg=how)


def test_grad_through_suffix(backend):
    """The gradients of x and the suffix equal those of concatenating first."""
    n = len(backend)
    mesh = line_mesh(backend)
    source_rows = ROWS - 4
    xs = jnp.asarray(random_array((n, source_rows, 3), jnp.float32))
    suffix = jnp.asarray(random_array((n, ROWS, 2), jnp.float32, seed=4))
    send_rows = jnp.asarray(random_send_rows(n, ROWS, source_rows, seed=5))
    counts = jnp.asarray(counts_for("overflow", n, 2, seed=9))
    w = random_array((n * CAPACITY, 5), jnp.float32, seed=2)

    def loss(x, tail, fused):
        def body(v, t, c, i):
            index = i[0]
            outside = (index < 0) | (index >= source_rows)  # jnp.take wraps negative indices: move them out
            taken = jnp.take(v[0], jnp.where(outside, source_rows, index), axis=0, mode="fill", fill_value=0)
            y = (nx.all_to_allv_dynamic(v[0], c[0], "x", max_recv_per_peer=CAPACITY, layout="packed",
                                        send_rows=index, suffix=t[0]) if fused else
                 nx.all_to_allv_dynamic(jnp.concatenate([taken, t[0]], axis=1), c[0], "x",
                                        max_recv_per_peer=CAPACITY, layout="packed"))[0]
            return (y * w).sum()[None]
        return jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 4, out_specs=P("x"))(
            x, tail, counts, send_rows).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    for fused, unfused in zip(grad(xs, suffix, True), grad(xs, suffix, False)):
        assert np.abs(np.asarray(unfused)).sum() > 0
        np.testing.assert_allclose(np.asarray(fused), np.asarray(unfused), rtol=1e-6, atol=1e-6)


def test_check_grads_numerically(backend):
    n = len(backend)
    mesh = line_mesh(backend)
    counts = jnp.asarray(counts_for("overflow", n, 1, seed=4))
    f = jax.shard_map(lambda v, c: nx.all_to_allv_dynamic(jnp.sin(v[0]), c[0], "x", max_recv_per_peer=CAPACITY,
                                                          layout="packed")[0][None],
                      mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"))
    # Jitted: check_grads evaluates f and its derivatives many times; eagerly, each evaluation re-dispatches
    # the shard_map op by op (a minute per backend).
    jax.test_util.check_grads(jax.jit(lambda v: f(v, counts)),
                              (jnp.asarray(random_array((n, ROWS, 2), jnp.float32)),),
                              order=2, modes=["fwd", "rev"], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_large_random_rows(backend, layout):
    """Many rows of an odd width (4-byte copies) and bf16 rows of 16-byte multiples, several pieces per peer;
    rows gathered through send_rows; rows wider than one slice."""
    n = len(backend)
    rows, capacity = 600, 220
    rng = np.random.default_rng(11)
    counts = rng.integers(0, 2 * capacity // 3, size=(n, n, 3)).astype(np.int32)
    for features, dtype in (((129,), jnp.float32), ((256,), jnp.bfloat16)):
        xs = random_array((n, rows, *features), dtype, seed=3)
        check(run(line_mesh(backend), "x", xs, counts, layout, capacity=capacity),
              reference.all_to_allv(list(xs), list(counts), capacity, layout), dtype)
    # Rows gathered through send_rows, wide enough that each lane of a row's copy has several loads in flight.
    xs = random_array((n, rows // 2, 1024), jnp.bfloat16, seed=4)
    send_rows = random_send_rows(n, rows, rows // 2, seed=6)
    check(run(line_mesh(backend), "x", xs, counts, layout, capacity=capacity, send_rows=send_rows),
          reference.all_to_allv(reference.gather_rows(xs, send_rows), list(counts), capacity, layout), jnp.bfloat16)
    # Rows wider than the NVLink kernel's slices of 1024 copy units: 16-byte units (the last slice one unit
    # wide) and 1-byte units (three slices).
    counts = rng.integers(0, 17, size=(n, n, 2)).astype(np.int32)
    for features, dtype in (((4100,), jnp.float32), ((2051,), jnp.int8)):
        xs = random_array((n, 40, *features), dtype, seed=5)
        check(run(line_mesh(backend), "x", xs, counts, layout, capacity=24),
              reference.all_to_allv(list(xs), list(counts), 24, layout), dtype)


@pytest.mark.parametrize("capacity, features", [(160, 256), (1152, 1024)], ids=["few_zeros", "many_zeros"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("pattern", ["zero", "one_peer", "random"])
def test_zero_rows_over_a_stale_buffer(backend, pattern, layout, capacity, features):
    """The rows after the data are zeros even where y's buffer held NaNs: y takes a donated NaN buffer. The
    NVLink kernel in one process writes a peer's zero rows at the sender when they are few, and leaves them to
    the receiver from 2 MiB per peer up (many_zeros: a peer that gets nothing, 1152 bf16 rows of 2 KiB)."""
    if backend[0].platform == "cpu" and capacity > 160:
        pytest.skip("a case of the NVLink kernel (zero rows left to the receiver); on CPU few_zeros covers it")
    n = len(backend)
    rows = capacity * 5 // 4
    xs = random_array((n, rows, features), jnp.bfloat16, seed=7)
    scale = capacity // CAPACITY  # counts_for's patterns, scaled to this capacity
    counts = counts_for(pattern, n, 2, seed=8) * scale
    y_shape = (n, capacity, features) if layout == "padded" else (n * capacity, features)
    mesh = line_mesh(backend)
    spec = P("x")

    def body(x, c, stale):
        del stale  # its buffer becomes y's
        y, recv, dropped = nx.all_to_allv_dynamic(x[0], c[0], "x", max_recv_per_peer=capacity, layout=layout)
        return y[None], recv[None], dropped[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec), donate_argnums=2,
                keep_unused=True)
    sharding = jax.sharding.NamedSharding(mesh, spec)
    stale = jax.jit(lambda: jnp.full((n, *y_shape), jnp.nan, jnp.bfloat16), out_shardings=sharding)()
    stale_buffers = [shard.data.unsafe_buffer_pointer() for shard in stale.addressable_shards]
    out = f(jnp.asarray(xs), jnp.asarray(counts), stale)
    assert [shard.data.unsafe_buffer_pointer() for shard in out[0].addressable_shards] == stale_buffers
    check([tuple(np.asarray(o[i]) for o in out) for i in range(n)],
          reference.all_to_allv(list(xs), list(counts), capacity, layout), jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("extra_block", [False, True], ids=["one_job_per_block", "blocks_with_two_jobs"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("pattern", ["one_peer", "overflow", "random"])
def test_staged_pieces_in_rounds(monkeypatch, pattern, layout, extra_block):
    """Staged calls (as with one process per GPU) whose pieces of a MiB or more are sent in rounds of at least
    256 KiB: N blocks give one 4.5 MiB piece per peer (eight rounds, the most), 3N + 1 blocks four 1.125 MiB
    pieces per peer (four rounds) and some blocks two send jobs. The blocks that sent a rank's own rows copy
    out every source's rows round by round. Two calls of one program and two runs of it reuse the progress
    flags under new epochs; a vmap of two batch elements is one call of one tile."""
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    devices = gpu_devices()
    n = len(devices)
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "nvlink")
    monkeypatch.setenv("JAX_NCCLX_NVLINK_DIRECT", "0")
    monkeypatch.setenv("JAX_NCCLX_NVLINK_BLOCKS", str(3 * n + 1 if extra_block else n))
    capacity, features = 1152, 1024  # 2.25 MiB of bf16 rows per peer slot and batch element
    rows = capacity * 5 // 4
    scale = capacity // CAPACITY  # counts_for's patterns, scaled to this capacity
    xs = random_array((n, 2, rows, features), jnp.bfloat16, seed=12)
    counts = np.stack([counts_for(pattern, n, 2, seed=s) * scale for s in (13, 14)], axis=1)  # [n, 2, n, k]

    def body(x, c):
        call = jax.vmap(lambda u, v: nx.all_to_allv_dynamic(u, v, "x", max_recv_per_peer=capacity, layout=layout))
        first = call(x[0], c[0])
        second = call(x[0], c[0, ::-1])  # the batch elements' counts swapped
        return tuple(o[None] for o in (*first, *second))

    mesh = line_mesh(devices)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
    for _ in range(2):
        out = f(jnp.asarray(xs), jnp.asarray(counts))
        for call, order in enumerate(((0, 1), (1, 0))):
            for b, routing in enumerate(order):
                expected = reference.all_to_allv(list(xs[:, b]), list(counts[:, routing]), capacity, layout)
                check([tuple(np.asarray(o[i, b]) for o in out[3 * call:3 * call + 3]) for i in range(n)],
                      expected, jnp.bfloat16)


def test_repeated_calls_reuse_flags(backend):
    """One compiled program run many times with changing counts: the epochs on the device keep the peers in
    step without any reset."""
    n = len(backend)
    mesh = line_mesh(backend)
    xs = random_array((n, ROWS, FEATURES), jnp.float32)

    def body(x, c):
        y, recv, dropped = nx.all_to_allv_dynamic(x[0], c[0], "x", max_recv_per_peer=CAPACITY, layout="packed")
        return y[None], recv[None], dropped[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
    for step in range(30):
        counts = counts_for("random", n, 2, seed=100 + step)
        out = f(jnp.asarray(xs), jnp.asarray(counts))
        if step % 10 == 9:
            check([tuple(np.asarray(o[i]) for o in out) for i in range(n)],
                  reference.all_to_allv(list(xs), list(counts), CAPACITY, "packed"), jnp.float32)


def test_calls_of_other_shapes_back_to_back(backend):
    """Packed calls with 1 and with 64 chunks per peer, alternating in one program, whose count slots differ in
    size. A rank shares its counts for one call while its peers may still read theirs of the call before, so
    the two calls' slots must not overlap whatever their sizes. This checks the results; the race itself needs
    a peer to lag by a few microseconds, and the old layout passed it too (3 runs on 2xH200)."""
    n = len(backend)
    mesh = line_mesh(backend)
    xs = random_array((n, ROWS, FEATURES), jnp.float32)
    rng = np.random.default_rng(21)
    counts = [rng.integers(0, ROWS // n + 1, size=(n, n, 1)).astype(np.int32),
              rng.integers(0, 2, size=(n, n, 64)).astype(np.int32)]
    steps = 8

    def body(x, one_chunk, many_chunks):
        outs = []
        for step in range(steps):
            c = (one_chunk, many_chunks)[step % 2]
            outs += [o[None] for o in nx.all_to_allv_dynamic(x[0], c[0], "x", max_recv_per_peer=CAPACITY,
                                                              layout="packed")]
        return outs

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x")))
    expected = [reference.all_to_allv(list(xs), list(c), CAPACITY, "packed") for c in counts]
    for _ in range(5):
        out = f(*(jnp.asarray(a) for a in (xs, *counts)))
        for step in range(steps):
            y, recv, dropped = out[3 * step:3 * step + 3]
            check([(np.asarray(y[i]), np.asarray(recv[i]), np.asarray(dropped[i])) for i in range(n)],
                  expected[step % 2], jnp.float32)


def test_lowering_picks_the_transport(backend):
    n = len(backend)
    mesh = line_mesh(backend)
    f = jax.jit(jax.shard_map(lambda x, c: nx.all_to_allv_dynamic(x[0], c[0], "x", max_recv_per_peer=2)[0][None],
                              mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
    text = f.lower(jnp.zeros((n, 4, 2)), jnp.zeros((n, n), jnp.int32)).as_text()
    on_nvlink = os.environ.get("JAX_NCCLX_TRANSPORT") == "nvlink" and backend[0].platform == "gpu"
    assert (NVLINK_TARGET in text) == on_nvlink
    if on_nvlink:
        stats = [s for s in nx.memory_stats() if s["symmetric_data_bytes"] > 0]
        assert stats and all(s["control_bytes"] < 1 << 17 for s in stats)


def test_device_trace_records_every_call(backend, monkeypatch):
    """With JAX_NCCLX_TRACE=1 every NVLink call leaves one complete, ordered timeline per rank."""
    if os.environ.get("JAX_NCCLX_TRANSPORT") != "nvlink":
        pytest.skip("only the NVLink kernel records device timelines")
    from jax_ncclx._src import trace
    monkeypatch.setenv("JAX_NCCLX_TRACE", "1")
    n = len(backend)
    mesh = line_mesh(backend)
    calls_per_step, steps = 4, 3

    def body(x, c):
        x, c = x[0], c[0]
        for _ in range(calls_per_step):
            y, _, _ = nx.all_to_allv_dynamic(x, c, "x", max_recv_per_peer=CAPACITY, layout="padded")
            x = x + y.reshape(-1, FEATURES)[: x.shape[0]].sum() * 0  # the next call waits for this one
        return x[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
    xs = jnp.asarray(random_array((n, ROWS, FEATURES), jnp.float32))
    counts = jnp.asarray(counts_for("random", n, 1, seed=7))
    before = {(r["comm_id"], r["device"]): r["epoch"] for r in trace.device_timeline()}
    for _ in range(steps):
        jax.block_until_ready(f(xs, counts))
    records = [r for r in trace.device_timeline() if r["epoch"] > before.get((r["comm_id"], r["device"]), 0)]
    by_device = {}
    for r in records:
        by_device.setdefault(r["device"], []).append(r)
    assert sorted(by_device) == sorted(d.local_hardware_id for d in backend)
    for device, calls in by_device.items():
        epochs = [r["epoch"] for r in calls]
        assert epochs == list(range(epochs[0], epochs[0] + calls_per_step * steps)), (device, epochs)
        for r in calls:
            assert r["kernel"] == "all_to_allv_dynamic" and r["blocks"] >= 1
            assert r["start_ns"] <= r["peers_ns"] <= r["sent_ns"] <= r["end_ns"], r
            assert r["peers_ns"] <= r["data_ns"] <= r["end_ns"], r
    summary = trace.summarize(records)
    assert summary["calls"] == len(records) and summary["kernel_us"] > 0


def test_device_trace_summary():
    """summarize's phases are medians of spans within each call; a field the call did not set (older than its
    start, such as ready_ns outside moe.dispatch) is left out, and a phase no call has is None."""
    from jax_ncclx._src import trace

    def call(epoch, start, ready, peers, sent, data, end):
        return dict(comm_id=1, device=0, rank=0, epoch=epoch, start_ns=start, ready_ns=ready, peers_ns=peers,
                    sent_ns=sent, data_ns=data, end_ns=end, blocks=1, kernel="moe.dispatch")

    summary = trace.summarize([call(1, 1000, 3000, 1000, 4000, 5000, 9000),
                               call(2, 10000, 14000, 10000, 15000, 16000, 20000),
                               call(3, 30000, 0, 30000, 31000, 32000, 34000)])
    assert summary["calls"] == 3 and summary["kernel_us"] == 8.0
    assert summary["ready_us"] == 3.0  # calls 1 and 2 only: call 3 holds no time of its own there
    assert summary["send_us"] == 3.0 and summary["finish_us"] == 4.0 and summary["gap_us"] == 5.5
    assert trace.summarize([call(1, 1000, 0, 1000, 4000, 5000, 9000)])["ready_us"] is None


@pytest.mark.gpu
def test_nvlink_kernel_inside_command_buffers():
    """With custom calls captured into CUDA graphs, the NVLink kernel gives the reference results call after
    call (the worker checks the compiled program really holds a command buffer)."""
    run_command_buffer_worker("command_buffer_worker.py", JAX_NCCLX_TRANSPORT="nvlink")


def test_int64_counts_and_expert_ids_saturate_rather_than_wrap():
    """Under jax_enable_x64 the integer arguments may be int64. Values beyond int32 saturate: a count of
    2**32 + 1 stays too large (the member takes its capacity, the rest is reported dropped) instead of wrapping
    to 1, and an expert id of 2**32 + 5 names no expert instead of expert 5."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:2]), ("x",))
    huge = 2**32 + 1
    with jax.enable_x64(True):
        def exchange(x, counts):
            _, recv, dropped = nx.all_to_allv_dynamic(x, counts[0], "x", max_recv_per_peer=2)
            return recv[None], dropped[None]

        counts = np.array([[huge, 1], [1, huge]], np.int64)  # each member sends itself too many rows
        recv, dropped = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=(P("x"), P("x")),
                                              out_specs=(P("x"), P("x"))))(jnp.ones((8, 3)), counts)
        np.testing.assert_array_equal(np.diagonal(recv), [2, 2])
        assert (np.diagonal(dropped) > 0).all(), dropped

        def group_sizes(tokens, ids):
            _, sizes, _ = nx.moe.dispatch(tokens, ids, num_experts=8, axis_name="x", capacity=8)
            return sizes[None]

        ids = np.array([[0, 1], [2, huge + 4], [4, 5], [6, 7]], np.int64)  # member 0's second token: 1 valid id
        sizes = jax.jit(jax.shard_map(group_sizes, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))(
            jnp.ones((4, 3), jnp.float32), ids)
        np.testing.assert_array_equal(np.asarray(sizes).sum(), 7)
        np.testing.assert_array_equal(np.asarray(sizes)[1, 1], 1)  # expert 5: member 1's first token only
