"""The dense collectives against jax.lax: forward (jit and eager), vmap, grad, dtypes, zero-size, either axis of
a 2-D mesh or both at once. Each test runs on the CPU backend and, where present, on GPUs (``-m gpu``)."""

import math
from functools import partial

import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ncclx as nx
from conftest import gpu_devices, gpu_skip_reason, run_command_buffer_worker, skip_degenerate_tuple
from helpers import FLOAT_DTYPES, INT_DTYPES, MOVE_ONLY_DTYPES, SPECIAL_DTYPES
from helpers import assert_same, put, random_array, smap


def ring(axis):
    size = jax.lax.axis_size(axis)
    return [(i, (i + 1) % size) for i in range(size)]


def lax_ppermute_ring(v, axis):
    """jax.lax.ppermute along ring(axis). jax.lax refuses a tuple of axes in another order than the mesh's
    (("b", "a")), so the same ring goes to it with the members renumbered in the mesh's order."""
    if not isinstance(axis, tuple):
        return jax.lax.ppermute(v, axis, ring(axis))
    names = axis
    mesh_names = tuple(sorted(names, key=("a", "b").index))
    sizes = [jax.lax.axis_size(name) for name in names]
    index_at = np.arange(math.prod(sizes)).reshape(sizes)  # axis_index(axis) at each coordinate
    mesh_index = np.argsort(np.transpose(index_at, [names.index(name) for name in mesh_names]).ravel())
    return jax.lax.ppermute(v, mesh_names, [(int(mesh_index[s]), int(mesh_index[d])) for s, d in ring(axis)])


# name -> (ours, jax.lax reference, reduces?)
OPS = {
    "all_reduce_sum": (lambda v, a: nx.all_reduce(v, a), lambda v, a: jax.lax.psum(v, a), True),
    "all_reduce_max": (lambda v, a: nx.all_reduce(v, a, "max"), lambda v, a: jax.lax.pmax(v, a), True),
    "all_reduce_min": (lambda v, a: nx.all_reduce(v, a, op="min"), lambda v, a: jax.lax.pmin(v, a), True),
    "all_reduce_mean": (lambda v, a: nx.all_reduce(v, a, "mean"), lambda v, a: jax.lax.pmean(v, a), True),
    "all_gather": (lambda v, a: nx.all_gather(v, a, axis=1), lambda v, a: jax.lax.all_gather(v, a, axis=1), False),
    "all_gather_tiled": (lambda v, a: nx.all_gather(v, a, axis=-1, tiled=True),
                         lambda v, a: jax.lax.all_gather(v, a, axis=v.ndim - 1, tiled=True), False),
    "reduce_scatter": (lambda v, a: nx.reduce_scatter(v, a, scatter_dimension=1, tiled=True),
                       lambda v, a: jax.lax.psum_scatter(v, a, scatter_dimension=1, tiled=True), True),
    "all_to_all": (lambda v, a: nx.all_to_all(v, a, 1, 0, tiled=True),
                   lambda v, a: jax.lax.all_to_all(v, a, 1, 0, tiled=True), False),
    "all_to_all_same_axis": (lambda v, a: nx.all_to_all(v, a, 1, 1, tiled=True),
                             lambda v, a: jax.lax.all_to_all(v, a, 1, 1, tiled=True), False),
    "ppermute": (lambda v, a: nx.ppermute(v, a, ring(a)), lax_ppermute_ring, False),
}
LINEAR = [name for name in OPS if name not in ("all_reduce_max", "all_reduce_min")]
# Either axis of the 2-D mesh, or both at once in either order (as for jax.lax: the first axis major).
AXES = ["a", "b", ("a", "b"), ("b", "a")]
AXIS_IDS = lambda axis: "+".join(axis)  # noqa: E731


def global_shape(mesh, features=3):
    """Per shard [2, 8, features]: dimension 1 splits evenly over either axis or both (up to 8 devices)."""
    return (2 * mesh.shape["a"], 8 * mesh.shape["b"], features)


@pytest.mark.parametrize("axis", AXES, ids=AXIS_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + INT_DTYPES + MOVE_ONLY_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", OPS)
def test_matches_lax(mesh, name, axis, dtype):
    skip_degenerate_tuple(mesh, axis)
    ours, ref, reduces = OPS[name]
    if reduces and dtype in MOVE_ONLY_DTYPES:
        pytest.skip("8-bit floats are moved, not reduced")
    x = put(random_array(global_shape(mesh), dtype), mesh)
    expected = smap(lambda v: ref(v.astype(jnp.float32) if dtype in MOVE_ONLY_DTYPES else v, axis), mesh)(x)
    actual = smap(lambda v: ours(v, axis), mesh)(x)
    if dtype in MOVE_ONLY_DTYPES:
        actual = actual.astype(jnp.float32)
    assert_same(actual, expected, dtype, reduced=reduces)


def lax_reference(name, dtype):
    """OPS[name]'s jax.lax reference for ``dtype``. jax.lax.psum_scatter refuses booleans, which ours counts in
    int32 as jax.lax.psum does."""
    ref = OPS[name][1]
    if name == "reduce_scatter" and dtype == jnp.bool_:
        return lambda v, a: ref(v.astype(jnp.int32), a)
    return ref


def check_special_dtype(mesh, name, axis, dtype):
    """OPS[name] on ``dtype`` (SPECIAL_DTYPES) matches jax.lax, dtype included; the max / min of complex numbers
    fail clearly, as in jax.lax."""
    ours = OPS[name][0]
    x = put(random_array(global_shape(mesh), dtype), mesh)
    if dtype == jnp.complex64 and name in ("all_reduce_max", "all_reduce_min"):
        with pytest.raises(TypeError, match="complex numbers have no order"):
            smap(lambda v: ours(v, axis), mesh)(x)
        return
    actual = smap(lambda v: ours(v, axis), mesh)(x)
    expected = smap(lambda v: lax_reference(name, dtype)(v, axis), mesh)(x)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert_same(actual, expected, dtype, reduced=OPS[name][2])


@pytest.mark.parametrize("axis", ["b", ("a", "b")], ids=AXIS_IDS)
@pytest.mark.parametrize("dtype", SPECIAL_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", OPS)
def test_special_dtypes_match_lax(mesh, name, axis, dtype):
    skip_degenerate_tuple(mesh, axis)
    check_special_dtype(mesh, name, axis, dtype)


@pytest.mark.parametrize("dtype", [jnp.int16, jnp.uint16], ids=lambda d: jnp.dtype(d).name)
def test_sums_of_16_bit_integers_wrap_as_in_lax(mesh, dtype):
    """They are summed in 32 bits; the result wraps to the same 16 bits as jax.lax.psum's."""
    x = put(np.full(global_shape(mesh), jnp.iinfo(dtype).max - 3, dtype), mesh)
    scatter = dict(scatter_dimension=1, tiled=True)
    for ours, ref in ((nx.all_reduce, jax.lax.psum),
                      (partial(nx.reduce_scatter, **scatter), partial(jax.lax.psum_scatter, **scatter))):
        actual, expected = (smap(lambda v: op(v, "b"), mesh)(x) for op in (ours, ref))
        assert actual.dtype == dtype
        np.testing.assert_array_equal(actual, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, *SPECIAL_DTYPES], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("axis", [("a", "b"), ("b", "a")], ids=AXIS_IDS)
@pytest.mark.parametrize("name", OPS)
def test_tuple_of_axes_on_every_gpu(name, axis, dtype):
    """The CUDA lowering over two axes taken as one (one communicator for the merged group), on a 1 x n mesh
    of every local GPU, so that a machine with one GPU runs it too: each op matches jax.lax."""
    reason = gpu_skip_reason(minimum=1)
    if reason:
        pytest.skip(reason)
    devices = gpu_devices()
    check_special_dtype(jax.sharding.Mesh(np.asarray(devices).reshape(1, len(devices)), ("a", "b")), name, axis,
                          dtype)


@pytest.mark.parametrize("name", ["all_reduce_sum", "all_gather", "all_to_all", "ppermute"])
def test_eager_shard_map(mesh, name):
    ours, ref, reduces = OPS[name]
    x = put(random_array(global_shape(mesh), jnp.float32), mesh)
    assert_same(smap(lambda v: ours(v, "b"), mesh, jit=False)(x), smap(lambda v: ref(v, "b"), mesh)(x), jnp.float32,
                reduced=reduces)


@pytest.mark.parametrize("features", [0, 1, 5])
@pytest.mark.parametrize("name", OPS)
def test_odd_and_zero_feature_sizes(mesh, name, features):
    ours, ref, reduces = OPS[name]
    x = put(random_array(global_shape(mesh, features), jnp.float32), mesh)
    actual = smap(lambda v: ours(v, "b"), mesh)(x)
    if features == 0:  # jax.lax refuses some zero-size collectives; the shape is what there is to check
        assert actual.shape == jax.eval_shape(smap(lambda v: ref(v, "b"), mesh), x).shape
    else:
        assert_same(actual, smap(lambda v: ref(v, "b"), mesh)(x), jnp.float32, reduced=reduces)


@pytest.mark.parametrize("name", OPS)
def test_vmap_is_one_call(mesh, name):
    """vmap over a non-mesh axis (the feature axis) matches jax.lax and stays a single collective."""
    ours, ref, reduces = OPS[name]
    x = put(random_array(global_shape(mesh, 4), jnp.float32), mesh)

    def batched(op):
        return lambda v: jax.vmap(lambda u: op(u, "b"), in_axes=2, out_axes=2)(v)

    assert_same(smap(batched(ours), mesh)(x), smap(batched(ref), mesh)(x), jnp.float32, reduced=reduces)
    jaxpr = str(jax.make_jaxpr(smap(batched(ours), mesh))(x))
    assert jaxpr.count("ncclx_") == 1, jaxpr


def assert_same_up_to_order(actual, expected, dtype, reduces):
    """assert_same, but float32 sums over a vmapped axis may differ in the last bit: XLA:GPU summed a batch
    dimension that it moved in another order than psum's batching rule (one H100)."""
    if reduces and dtype == jnp.float32:
        np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6)
    else:
        assert_same(actual, expected, dtype, reduced=reduces)


@pytest.mark.parametrize("in_axis", [0, 2, None])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", OPS)
def test_vmap_over_its_own_axis(name, dtype, in_axis):
    """jax.vmap(..., axis_name="i") over the op's own axis (in_axis None: every member holds the same array):
    the members are the batch entries, so the result matches jax.lax's with no collective in the jaxpr. The
    reference always maps dimension 0 of the members' arrays (jax.lax 0.11.2's all_to_all gets the shape wrong
    for an unmapped operand)."""
    ours, ref, reduces = OPS[name]
    members = 4
    full = jnp.asarray(random_array((members, 2, 8, 3), dtype))
    if in_axis is None:
        full = jnp.broadcast_to(full[0], full.shape)
    x = full[0] if in_axis is None else jnp.moveaxis(full, 0, in_axis)
    call = lambda op, in_axes: jax.jit(jax.vmap(lambda v: op(v, "i"), in_axes=in_axes, axis_size=members,  # noqa: E731
                                                axis_name="i"))
    assert_same_up_to_order(call(ours, in_axis)(x), call(ref, 0)(full), dtype, reduces)
    assert "ncclx_" not in str(jax.make_jaxpr(call(ours, in_axis))(x))


@pytest.mark.parametrize("name", LINEAR)
def test_grad_of_complex_numbers(mesh, name):
    """Complex inputs differentiate as in jax.lax (a real loss of the op's complex result)."""
    ours, ref, _ = OPS[name]
    x = put(random_array(global_shape(mesh), jnp.complex64), mesh)

    def grad(op):
        body = smap(lambda v: jnp.sin(op(v * (1 + 2j), "b")), mesh)
        return jax.jit(jax.grad(lambda v: (jnp.abs(body(v)) ** 2).sum()))(x)

    np.testing.assert_allclose(grad(ours), grad(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", LINEAR)
def test_grad_over_a_vmapped_own_axis(name):
    ours, ref, _ = OPS[name]
    x = jnp.asarray(random_array((4, 2, 8, 3), jnp.float32))

    def loss(op):
        body = jax.vmap(lambda v: jnp.sin(op(jnp.cos(v), "i")), axis_name="i")
        return jax.jit(jax.grad(lambda v: body(v).sum()))

    np.testing.assert_allclose(loss(ours)(x), loss(ref)(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("axis", [("i", "b"), ("b", "i"), ("a", "i", "b")], ids=AXIS_IDS)
@pytest.mark.parametrize("op", ["sum", "max", "mean"])
def test_vmap_axis_with_mesh_axes_inside_shard_map(mesh, op, axis, check_vma):
    """all_reduce over a vmapped axis taken together with mesh axes reduces the batch entries here, then the
    rest over the mesh: one collective, over the mesh axes only. jax.lax 0.11.2 refuses such a psum under
    check_vma=True, so its reference runs with check_vma=False. The gradient of the summed loss matches it
    (sum and mean). For sum so does the vmap of each member's gradient without check_vma (a psum transposes
    to a psum), and with it that gradient is the member's own, cos(y) * -sin(x) (the cotangent of an
    invariant result is shared)."""
    lax_op = {"sum": jax.lax.psum, "max": jax.lax.pmax, "mean": jax.lax.pmean}[op]
    in_specs = jax.sharding.PartitionSpec(None, "a", "b")
    x = jax.device_put(random_array((3, *global_shape(mesh)), jnp.float32),
                       jax.sharding.NamedSharding(mesh, in_specs))

    def program(reduce, vma):
        body = jax.vmap(lambda v: jnp.sin(reduce(jnp.cos(v), axis)), axis_name="i")
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=in_specs, check_vma=vma)

    ours = program(lambda v, a: nx.all_reduce(v, a, op), check_vma)
    ref = program(lax_op, False)
    assert_same_up_to_order(jax.jit(ours)(x), jax.jit(ref)(x), jnp.float32, reduces=True)
    mesh_axes = tuple(name for name in axis if name != "i")
    jaxpr = str(jax.make_jaxpr(ours)(x))
    assert jaxpr.count("ncclx_all_reduce") == 1, jaxpr
    assert f"axis_name={mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes} " in jaxpr, jaxpr
    if op == "max":
        return  # jax.lax.pmax has no derivative to compare with (test_extreme_reduction_gradient checks ours)
    grad = lambda f: jax.jit(jax.grad(lambda v: f(v).sum()))(x)  # noqa: E731
    np.testing.assert_allclose(grad(ours), grad(ref), rtol=1e-5, atol=1e-5)
    if op == "mean":
        return  # the members' own gradients below are a psum's

    def member_grads(reduce, vma):
        body = jax.vmap(jax.grad(lambda v: jnp.sin(reduce(jnp.cos(v), axis)).sum()), axis_name="i")
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=in_specs, check_vma=vma))(x)

    if check_vma:  # y, the reduction of cos(x), from jax.lax where it runs
        reduced = jax.shard_map(jax.vmap(lambda v: jax.lax.psum(jnp.cos(v), axis), axis_name="i"), mesh=mesh,
                                in_specs=in_specs, out_specs=in_specs, check_vma=False)
        expected = np.cos(reduced(x)) * -np.sin(x)
    else:
        expected = member_grads(jax.lax.psum, False)
    np.testing.assert_allclose(member_grads(lambda v, a: nx.all_reduce(v, a), check_vma), expected, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("name", OPS)
def test_vmap_over_its_own_axis_inside_shard_map(mesh, name):
    """A vmapped axis inside shard_map (check_vma=True, which jax.lax 0.11.2 refuses there) is local work."""
    ours, ref, reduces = OPS[name]
    x = jnp.asarray(random_array((4, 2, 8, 3), jnp.float32))
    specs = jax.sharding.PartitionSpec()

    def program(op, check_vma):
        body = jax.vmap(lambda v: op(v, "i"), axis_name="i")
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=check_vma))

    assert_same_up_to_order(program(ours, True)(x), program(ref, False)(x), jnp.float32, reduces)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("axis", AXES, ids=AXIS_IDS)
@pytest.mark.parametrize("name", LINEAR)
def test_grad_matches_lax(mesh, name, axis, check_vma):
    skip_degenerate_tuple(mesh, axis)
    ours, ref, _ = OPS[name]
    x = put(random_array(global_shape(mesh), jnp.float32), mesh)
    def loss(op):
        body = lambda v: jnp.sin(op(jnp.cos(v), axis)).sum()[None, None]  # noqa: E731
        return jax.jit(jax.grad(lambda v: smap(body, mesh, jit=False, check_vma=check_vma)(v).sum()))

    np.testing.assert_allclose(loss(ours)(x), loss(ref)(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["max", "min"])
def test_extreme_reduction_gradient(mesh, op):
    """max/min pass the cotangent to the member holding the extreme (jax.lax.pmax has no derivative)."""
    x = put(random_array(global_shape(mesh), jnp.float32), mesh)
    grad = jax.jit(jax.grad(lambda v: smap(lambda u: nx.all_reduce(u, "b", op).sum()[None, None], mesh,
                                           jit=False)(v).sum()))(x)
    pick = np.max if op == "max" else np.min
    values = np.asarray(x).reshape(x.shape[0], mesh.shape["b"], 8, 3)
    holder = values == pick(values, axis=1, keepdims=True)
    expected = holder * mesh.shape["b"]  # each of the n members' outputs sends its cotangent to the holder
    np.testing.assert_allclose(np.asarray(grad).reshape(values.shape), expected)


def test_check_grads_numerically(mesh):
    x = put(random_array(global_shape(mesh), jnp.float32), mesh)
    f = smap(lambda v: nx.all_to_all(nx.all_gather(jnp.tanh(v), "a", axis=0, tiled=True), "b", 1, 0, tiled=True),
             mesh, out_specs=jax.sharding.PartitionSpec(("a", "b")))
    jax.test_util.check_grads(f, (x,), order=2, modes=["fwd", "rev"], atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_nccl_path_inside_command_buffers():
    """With JAX_NCCLX_NCCL_COMMAND_BUFFERS=1 and custom calls captured into CUDA graphs, the NCCL path of every
    fixed-size collective lowers to its command-buffer handler and gives the reference results call after
    call, replayed from a graph (the worker checks that fewer calls reached the host than ran)."""
    run_command_buffer_worker("nccl_command_buffer_worker.py")
