"""JAX's own tests of its collectives, ported to check jax_ncclx against jax.lax: each case runs a program
with jax.lax's collectives and the same program with jax_ncclx's twins (``LAX`` and ``NX`` below give both
one interface with jax.lax's names) and requires equal results: bit-equal for data that is moved, allclose
for reductions of floats, equal dtypes and shapes always.

Ported from jax-ml/jax at cec06d1 (tests/), as tests of our own with the same inputs and cases:

* shard_map_test.py, ShardMapTest: test_all_gather, test_all_gather_invariant_basic (``to="invarying"``; and
  the same program with check_vma=False), test_all_gather_with_axis_index_groups, test_matmul_reduce_scatter,
  test_reduce_scatter_with_axis_index_groups, test_collective_permute,
  test_collective_permute_with_multiple_axis_names, test_all_to_all (both parametrizations),
  test_all_to_all_with_axis_index_groups, test_all_to_all_grad, test_eager_control_flow,
  test_repeated_psum_allowed, test_pmin, test_pmax, test_pmax_vma_in_types, test_all_gather_with_vma_in_types,
  test_get_check_rep (results and the varying axes of psum's result), test_psum_transpose_non_zero_cts,
  test_vmap_shmap_psum (explicit mesh), test_vmap_shmap_spmd_axis_name_scalar (vmap with an unbatched
  operand), test_ppermute_zip_error, test_all_reduce_rgv3 / test_reduce_scatter_rgv3 (all three meshes) /
  test_all_to_all_rgv3 (their values); ShardMapSystematicTest's test_vmap (batched and unbatched operands,
  spmd_axis_name) and test_grads (check_rep True / False, jit or not), with collectives in the body.
  Left out: test_ppermute_different_axis_order_error (jax.lax refuses a tuple of axes in another order than
  the mesh's; jax_ncclx accepts it, so that case is compared against jax.lax with the members renumbered),
  the unreduced / reduced / pcast / psend tests (no twin in jax_ncclx).
* pmap_test.py (pmap run as jit(shard_map) over a one-axis mesh of min(8, devices) members): testGather,
  testGatherBool, testGatherNegativeAxis, testGatherTiled, testGatherTiledNegativeAxis, testVmapOf,
  testReduceScatter, testReduceScatterTiled, testReduceScatterNegativeScatterDimension,
  testReduceScatterReplicaGroupsTiled, testTrees, testCollectivesWithTreesOfDifferentDtypes, testComplexPsum,
  testAllToAll (every dtype), testAllToAllNegativeAxes, testGradOfPsum, testPartiallyMapped,
  testPsumConstantReplicaGroups, testPsumUnevenReplicaGroups, testPsumReplicaGroups, testGatherReplicaGroups,
  testGatherReplicaGroupsInterleaved, testGradOf (gather / reduce_scatter, tiled, groups),
  testCollectivePermute, testCollectivePermuteGrad, testCollectivePermuteCyclicGrad,
  testPpermuteWithZipObject, testRule30, testReduceMax, testReduceMin, testPswapaxes, testGradOfPswapaxes,
  testAllToAllReplicaGroups, testGradOfAllToAllReplicaGroups, testPsumOnBooleanDtype, testPsumZeroCotangents;
  VmapPmapCollectivesTest: testCollectivesWithVmap, testCollectivesWithVmap2, testPPermuteWithVmap,
  testPPermuteAgreesWithVmap, testAllToAllInVmap, testAllToAllVsVmap, testWithVmap, testVsVmap.
  jax.lax.psum with axis_index_groups raises NotImplementedError inside shard_map, so the psum-with-groups
  cases take jax.lax's result from jax.pmap itself (jax_ncclx runs under jax.pmap and under shard_map).
  Left out: pargmax / pargmin, pbroadcast, pshuffle (no twins).
* batching_test.py (collectives under jax.vmap with axis_name, no mesh): testCommAssocCollective,
  testPPermute, testAllToAll, testAllToAllSplitAxis (nested vmaps, all_to_all over ("i", "j")),
  testGradOfPsum, testAllGatherToUnmapped, testBatchedAllGather, testAllGatherTiled,
  testBatchedAllGatherTiled, testAllGatherVjp, testAllGatherOfConst, testReduceScatterAutodiff,
  testPpermuteBatcherTrivial.
* ragged_collective_test.py: every case (test_ragged_all_to_all, _grad, _axis_index_groups,
  _degenerate_groups, _vmap_multi_dim_operand, _vmap (4 configs), _errors, test_vmap_basic), plus slices
  that overlap in the operand. _vmap_unsupported_axis_index_groups is a call jax.lax refuses
  (NotImplementedError under vmap(axis_name=)); jax_ncclx computes it, checked against the model. XLA:CPU cannot run
  jax.lax.ragged_all_to_all, so there the reference is a NumPy model of its docstring's SEND / RECEIVE
  description (and JAX's expected literals); on GPUs jax.lax's own result is compared too.

Derivatives: where JAX runs check_grads (autodiff against numerical differences) on jax.lax's op, these
tests compare jax_ncclx's JVP and VJP with jax.lax's (the ops are linear); check_grads itself runs on
jax_ncclx's op in testCommAssocCollective, testReduceScatterAutodiff and the ragged grad test.
XLA:CPU's all_to_all quiets the NaNs of 16-bit floats; testAllToAll's random bits therefore match jax.lax's
NaN for NaN and must match the NumPy reference bit for bit.

Each test runs on CPU (8 virtual devices) and, where present, on GPUs (the ``backend`` fixture); a case that
needs more devices than the backend has is skipped.
"""

import itertools as it
import math
from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ncclx as nx
from helpers import assert_bits_equal, random_bits

# --------------------------------------------------------------------------------------------------------------
# jax.lax and jax_ncclx behind one interface (jax.lax's names and keywords), so each program is written once.

LAX = SimpleNamespace(
    name="jax.lax", psum=jax.lax.psum, pmax=jax.lax.pmax, pmin=jax.lax.pmin, pmean=jax.lax.pmean,
    all_gather=jax.lax.all_gather, psum_scatter=jax.lax.psum_scatter, all_to_all=jax.lax.all_to_all,
    ppermute=jax.lax.ppermute, pswapaxes=jax.lax.pswapaxes, ragged_all_to_all=jax.lax.ragged_all_to_all)
# jax.lax's parameter names, every keyword passed on to jax_ncclx as it is (its own signature decides).
NX = SimpleNamespace(
    name="jax_ncclx",
    psum=lambda x, axis_name, **kw: nx.all_reduce(x, axis_name, "sum", **kw),
    pmax=lambda x, axis_name, **kw: nx.all_reduce(x, axis_name, "max", **kw),
    pmin=lambda x, axis_name, **kw: nx.all_reduce(x, axis_name, "min", **kw),
    pmean=lambda x, axis_name, **kw: nx.all_reduce(x, axis_name, "mean", **kw),
    all_gather=lambda x, axis_name, **kw: nx.all_gather(x, axis_name, **kw),
    psum_scatter=lambda x, axis_name, **kw: nx.reduce_scatter(x, axis_name, **kw),
    all_to_all=lambda x, axis_name, split_axis, concat_axis, **kw: nx.all_to_all(x, axis_name, split_axis,
                                                                                concat_axis, **kw),
    ppermute=lambda x, axis_name, perm: nx.ppermute(x, axis_name, perm),
    # jax.lax.pswapaxes(x, axis_name, axis) is all_to_all(x, axis_name, axis, axis)
    pswapaxes=lambda x, axis_name, axis, **kw: nx.all_to_all(x, axis_name, axis, axis, **kw),
    ragged_all_to_all=nx.ragged_all_to_all)


# --------------------------------------------------------------------------------------------------------------
# Comparison.

def _tolerance(dtype):
    real = np.finfo(np.dtype(dtype)).dtype if jnp.issubdtype(dtype, jnp.complexfloating) else np.dtype(dtype)
    return 2e-2 if real.itemsize <= 2 else (1e-5 if real.itemsize == 4 else 1e-12)


def _leaf_mismatch(actual, expected, reduced, nan_payloads=False):
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return f"{actual.dtype}{list(actual.shape)} where jax.lax gives {expected.dtype}{list(expected.shape)}"
    inexact = jnp.issubdtype(actual.dtype, jnp.inexact)
    try:
        if reduced and inexact:
            wide = np.complex128 if jnp.issubdtype(actual.dtype, jnp.complexfloating) else np.float64
            a, e = actual.astype(wide), expected.astype(wide)
            tol = _tolerance(actual.dtype)
            scale = max(1.0, float(np.max(np.abs(e), initial=0.0)))
            np.testing.assert_allclose(a, e, rtol=tol, atol=tol * scale)
        elif nan_payloads and inexact:  # a NaN where jax.lax has a NaN, whatever its payload; other bits equal
            wide = np.complex128 if jnp.issubdtype(actual.dtype, jnp.complexfloating) else np.float64
            with np.errstate(invalid="ignore"):
                nan, expected_nan = np.isnan(actual.astype(wide)), np.isnan(expected.astype(wide))
            np.testing.assert_array_equal(nan, expected_nan)
            assert_bits_equal(actual[~nan], expected[~nan])
        else:
            assert_bits_equal(actual, expected)
    except AssertionError as error:
        return str(error).strip()[:600]
    return None


def assert_same(actual, expected, reduced=False, *, nan_payloads=False):
    """``actual`` (jax_ncclx) against ``expected`` (jax.lax), two pytrees: same structure, then per leaf the
    same dtype and shape, and the same bits (moved data) or allclose (``reduced``, floats). ``reduced`` is a
    bool, or a set of the top-level dict keys that hold reductions. Every mismatching leaf is listed."""
    a_paths, a_tree = jax.tree_util.tree_flatten_with_path(actual)
    e_paths, e_tree = jax.tree_util.tree_flatten_with_path(expected)
    assert a_tree == e_tree, f"jax_ncclx's result has structure {a_tree}, jax.lax's {e_tree}"
    failures = []
    for (path, a), (_, e) in zip(a_paths, e_paths):
        key = path[0].key if path and hasattr(path[0], "key") else None
        leaf_reduced = reduced if isinstance(reduced, bool) else key in reduced
        why = _leaf_mismatch(a, e, leaf_reduced, nan_payloads)
        if why:
            failures.append(f"{jax.tree_util.keystr(path) or 'result'}: {why}")
    assert not failures, "jax_ncclx differs from jax.lax:\n" + "\n".join(failures)


def parity(run, *, reduced=False):
    """run(ops) with jax.lax's ops, then with jax_ncclx's; asserts the same results. Returns both."""
    expected = jax.block_until_ready(run(LAX))
    actual = jax.block_until_ready(run(NX))
    assert_same(actual, expected, reduced)
    return actual, expected


def same_error(run):
    """run(ops) raises with jax.lax's ops; it must raise an exception of the same type with jax_ncclx's."""
    with pytest.raises(Exception) as lax_error:
        jax.block_until_ready(run(LAX))
    with pytest.raises(lax_error.type):
        jax.block_until_ready(run(NX))


# --------------------------------------------------------------------------------------------------------------
# Meshes, arrays, maps.

def mesh_of(devices, shape, names, axis_types=None):
    size = math.prod(shape)
    if len(devices) < size:
        pytest.skip(f"needs {size} devices, the backend has {len(devices)}")
    types = axis_types or (AxisType.Auto,) * len(shape)
    return Mesh(np.asarray(devices[:size]).reshape(shape), tuple(names), axis_types=types)


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def arange(shape, dtype=np.int32):
    """JAX's tests' inputs, np.arange reshaped, in any dtype (booleans: parity; complex: a second arange for
    the imaginary part)."""
    v = np.arange(math.prod(shape)).reshape(shape)
    if dtype == np.bool_:
        return (v % 2).astype(np.bool_)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return (v + 1j * (v[::-1] if v.ndim else v)).astype(dtype)
    return v.astype(dtype)


def smap(body, mesh, in_specs, out_specs, *, jit=True, check_vma=True):
    f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    return jax.jit(f) if jit else f


def pmap_like(fn, mesh, *, in_axes=0, check_vma=True, jit=True):
    """``jax.pmap(fn, axis_name=<mesh's axis>, in_axes=in_axes)`` as a shard_map over the one-axis ``mesh``:
    member i gets ``arg[i]`` of a mapped argument (in_axes 0) and all of an unmapped one (None); the results
    are stacked along a new leading axis."""
    axis = mesh.axis_names[0]

    def run(*args):
        axes = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)

        def body(*blocks):
            inner = [jax.tree.map(lambda b: b[0], blk) if ax == 0 else blk for blk, ax in zip(blocks, axes)]
            return jax.tree.map(lambda y: jnp.expand_dims(y, 0), fn(*inner))

        specs = tuple(P(axis) if ax == 0 else P() for ax in axes)
        return smap(body, mesh, specs, P(axis), jit=jit, check_vma=check_vma)(*args)

    return run


def pmesh(devices, n=None, name="i"):
    """The mesh of pmap_test's pmap: one axis over min(8, devices) members (``n`` of them if given)."""
    n = min(8, len(devices)) if n is None else n
    return mesh_of(devices, (n,), (name,))


GATHER_DTYPES = [np.float32, jnp.bfloat16, np.int8, np.bool_, np.complex64, jnp.float8_e4m3fn]
DTYPE_ID = lambda d: np.dtype(d).name  # noqa: E731


# ==============================================================================================================
# shard_map_test.py

def create_inputs(devices, a_spec, b_spec, dtype=np.int32):
    """shard_map_test's create_inputs: a 2x2x2 ("x", "y", "z") mesh and two [8, 8] aranges placed on it."""
    mesh = mesh_of(devices, (2, 2, 2), ("x", "y", "z"))
    return mesh, put(arange((8, 8), dtype), mesh, a_spec), put(arange((8, 8), dtype), mesh, b_spec)


@pytest.mark.parametrize("dtype,jit", [(d, True) for d in GATHER_DTYPES] + [(np.float32, False)],
                         ids=[DTYPE_ID(d) for d in GATHER_DTYPES] + ["float32-eager"])
def test_shmap_all_gather(backend, dtype, jit):
    spec = P("z", ("x", "y"))
    mesh, a, _ = create_inputs(backend, spec, P(None, None), dtype)

    def body(ops, a):
        return {"z_axis0_tiled": ops.all_gather(a, "z", axis=0, tiled=True),
                "xy_axis-1_tiled": ops.all_gather(a, ("x", "y"), axis=-1, tiled=True),
                "yx_axis-1_tiled": ops.all_gather(a, ("y", "x"), axis=-1, tiled=True),
                "z_stacked": ops.all_gather(a, "z"),
                "xy_stacked_axis1": ops.all_gather(a, ("x", "y"), axis=1),
                "yx_stacked_axis-1": ops.all_gather(a, ("y", "x"), axis=-1)}

    parity(lambda ops: smap(partial(body, ops), mesh, (spec,), spec, jit=jit)(a))


def test_shmap_all_gather_invariant_basic(backend):
    """jax.lax.all_gather(..., to="invarying"): a result replicated over the axis, out_specs P()."""
    mesh = mesh_of(backend, (4,), ("x",))
    arr = jnp.arange(8.0)

    def run(ops):
        f = smap(lambda a: ops.all_gather(a, "x", tiled=True, to="invarying"), mesh, P("x"), P())
        return {"out": f(arr), "grad": jax.jit(jax.grad(lambda v: f(v).sum()))(arr)}

    actual, _ = parity(run)
    np.testing.assert_array_equal(actual["out"], arr)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_shmap_all_gather_replicated_out_check_vma_false(backend, jit):
    """test_all_gather_invariant_basic's program with the default ``to`` under check_vma=False (out_specs P()
    is then unchecked), forward and grad."""
    mesh = mesh_of(backend, (4,), ("x",))
    arr = jnp.arange(8.0)

    def run(ops):
        f = smap(lambda a: ops.all_gather(a, "x", tiled=True), mesh, P("x"), P(), check_vma=False, jit=jit)
        grad = jax.grad(lambda v: f(v).sum())
        return {"out": f(arr), "grad": (jax.jit(grad) if jit else grad)(arr)}

    parity(run)


def test_shmap_all_gather_with_axis_index_groups(backend):
    spec = P("x", ("y", "z"))
    mesh, a, _ = create_inputs(backend, spec, P(None, None), np.float32)
    groups = ((0, 1), (2, 3))

    def body(ops, a):
        return {"yz_axis-1_tiled": ops.all_gather(a, ("y", "z"), axis_index_groups=groups, axis=-1, tiled=True),
                "zy_axis-1_tiled": ops.all_gather(a, ("z", "y"), axis_index_groups=groups, axis=-1, tiled=True),
                "yz_stacked": ops.all_gather(a, ("y", "z"), axis_index_groups=((0, 2), (1, 3)))}

    actual, _ = parity(lambda ops: smap(partial(body, ops), mesh, (spec,), spec)(a))
    c = actual["yz_axis-1_tiled"]
    assert c.addressable_data(0).shape == (4, 4)


@pytest.mark.parametrize("dtype", [np.int32, np.float32], ids=DTYPE_ID)
def test_shmap_matmul_reduce_scatter(backend, dtype):
    mesh, a, b = create_inputs(backend, P("z", "y"), P("y", None), dtype)
    out = P(("z", "y"), None)

    def body(ops, a, b):
        c = jnp.matmul(a, b)  # [B.z, F], a partial sum over y
        return (ops.psum_scatter(c, "y", scatter_dimension=0, tiled=True),
                ops.psum_scatter(c, ("z", "y"), scatter_dimension=0, tiled=True),
                ops.psum_scatter(c, ("y", "z"), scatter_dimension=0, tiled=True))

    actual, _ = parity(lambda ops: smap(partial(body, ops), mesh, (P("z", "y"), P("y", None)),
                                        (out, out, P(("y", "z"), None)))(a, b), reduced=True)
    expected = np.matmul(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(actual[0], expected, rtol=1e-5)
    np.testing.assert_allclose(actual[1], expected[:4] + expected[4:], rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.int32, np.float32], ids=DTYPE_ID)
def test_shmap_reduce_scatter_with_axis_index_groups(backend, dtype):
    groups = ((0, 2, 4, 6), (1, 3, 5, 7))
    spec = P(None, ("x", "y", "z"))
    mesh, a, _ = create_inputs(backend, spec, P(None, None), dtype)

    def body(ops, a):
        return ops.psum_scatter(a, ("x", "y", "z"), scatter_dimension=0, axis_index_groups=groups, tiled=True)

    actual, _ = parity(lambda ops: smap(partial(body, ops), mesh, (spec,), spec)(a), reduced=True)
    assert actual.addressable_data(0).shape == (2, 1)
    even = np.sum(np.asarray(a)[..., groups[0]], -1)
    for i, sums in enumerate(np.split(even, 4, 0)):
        np.testing.assert_allclose(np.squeeze(actual.addressable_data(2 * i), -1), sums)


def test_shmap_collective_permute(backend):
    """test_collective_permute's ring, and the perm forms jax.lax takes: a list of tuples, a tuple of tuples, a
    list of lists, list(zip(...)) (pmap's testPpermuteWithZipObject), NumPy ints, a partial perm (no wrap:
    zeros where nothing arrives) and an empty one."""
    mesh = mesh_of(backend, (8,), ("x",))
    a = put(arange((8, 8)), mesh, P("x", None))
    n = 8
    ring = [(j, (j + 1) % n) for j in range(n)]
    perms = {"ring": ring,
             "tuple_of_tuples": tuple((j, (j + 3) % n) for j in range(n)),
             "list_of_lists": [[j, (j - 1) % n] for j in range(n)],
             "zip": list(zip([n - 1] + list(range(n - 1)), range(n))),
             "numpy_ints": [(np.int64(j), np.int32((j + 2) % n)) for j in range(n)],
             "shift_no_wrap": [(j, j + 1) for j in range(n - 1)],
             "swap_pairs": [(0, 1), (1, 0), (4, 6), (6, 4)],
             "empty": []}

    def body(ops, a):
        return {name: ops.ppermute(a, "x", perm) for name, perm in perms.items()}

    actual, _ = parity(lambda ops: smap(partial(body, ops), mesh, (P("x", None),), P("x", None))(a))
    np.testing.assert_array_equal(actual["ring"], np.roll(arange((8, 8)), 1, axis=0))


def test_shmap_collective_permute_with_multiple_axis_names(backend):
    spec = P("x", ("y", "z"))
    mesh = mesh_of(backend, (2, 2, 2), ("x", "y", "z"))
    a = put(arange((4, 16)), mesh, spec)

    def body(ops, a):
        xy, yz = jax.lax.axis_size(("x", "y")), jax.lax.axis_size(("y", "z"))
        return (ops.ppermute(a, ("x", "y"), perm=[(j, (j + 1) % xy) for j in range(xy)]),
                ops.ppermute(a, ("y", "z"), perm=[(j, (j + 1) % yz) for j in range(yz)]))

    (c, d), _ = parity(lambda ops: smap(partial(body, ops), mesh, (spec,), spec)(a))
    for i in range(8):
        np.testing.assert_array_equal(a.addressable_data(i), c.addressable_data((i + 2) % 8))
        np.testing.assert_array_equal(a.addressable_data(i), d.addressable_data(4 * (i // 4) + (i + 1) % 4))


def test_shmap_ppermute_axes_in_other_order(backend):
    """A tuple of axes in another order than the mesh's: jax.lax refuses it (test_ppermute_different_axis_
    order_error), jax_ncclx takes it as one axis ordered as jax.lax.axis_index of the tuple; compared with
    jax.lax's ppermute over the mesh's order with the same members renumbered."""
    mesh = mesh_of(backend, (2, 4), ("x", "y"))
    spec = P(("y", "x"))
    x = put(arange((16, 3), np.float32), mesh, spec)
    perm = [(j, (j + 1) % 8) for j in range(8)]
    index_yx = np.arange(8).reshape(4, 2)  # axis_index(("y", "x")) at [y, x]
    as_xy = index_yx.T.ravel()  # axis_index(("y", "x")) of the member at axis_index(("x", "y")) = k
    to_xy = np.argsort(as_xy)
    lax_perm = [(int(to_xy[s]), int(to_xy[d])) for s, d in perm]
    ours = smap(lambda v: nx.ppermute(v, ("y", "x"), perm), mesh, (spec,), spec)(x)
    ref = smap(lambda v: jax.lax.ppermute(v, ("x", "y"), lax_perm), mesh, (spec,), spec)(x)
    assert_same(ours, ref)


@pytest.mark.parametrize("axis_name,mesh_axes,rows,dtype", [
    ("x", dict(x=8), 8, np.int32), ("x", dict(x=8), 8, jnp.bfloat16), ("x", dict(x=8), 8, np.bool_),
    (("x", "y"), dict(x=4, y=2), 8, np.int32), (("y", "x"), dict(x=4, y=2), 8, np.int32),
    ("x", dict(x=2), 4, np.int32)],
    ids=["x8-int32", "x8-bfloat16", "x8-bool", "xy4x2-int32", "yx4x2-int32", "x2_rgv3-int32"])
def test_shmap_all_to_all(backend, axis_name, mesh_axes, rows, dtype):
    mesh = mesh_of(backend, tuple(mesh_axes.values()), tuple(mesh_axes))
    a = put(arange((rows, rows), dtype), mesh, P(axis_name, None))

    def body(ops, a):
        return {"split1_concat1": ops.all_to_all(a, axis_name, split_axis=1, concat_axis=1, tiled=True),
                "split1_concat0": ops.all_to_all(a, axis_name, split_axis=1, concat_axis=0, tiled=True),
                "split-1_concat-2": ops.all_to_all(a, axis_name, split_axis=-1, concat_axis=-2, tiled=True)}

    actual, _ = parity(lambda ops: smap(partial(body, ops), mesh, (P(axis_name, None),), P(None, axis_name))(a))
    if rows == 8 and dtype == np.int32:
        assert (actual["split1_concat1"] == jnp.reshape(jnp.asarray(a).T, (1, 64))).all()


def test_shmap_all_to_all_with_axis_index_groups(backend):
    mesh = mesh_of(backend, (4,), ("x",))
    a = put(arange((4, 4)), mesh, P("x", None))

    def body(ops, a):
        return ops.all_to_all(a, "x", split_axis=1, concat_axis=0, axis_index_groups=((0, 1), (2, 3)), tiled=True)

    c, _ = parity(lambda ops: smap(partial(body, ops), mesh, (P("x", None),), P(None, "x"))(a))
    assert c.addressable_data(0).shape == (2, 2)
    for i, row_block in enumerate(np.split(np.asarray(a), 2, axis=0)):
        for j, block in enumerate(np.split(row_block, 2, axis=-1)):
            np.testing.assert_array_equal(block, c.addressable_data(2 * i + j))


@pytest.mark.parametrize("jit,check_vma", [(True, True), (True, False), (False, True)],
                         ids=["jit-vma", "jit-no_vma", "eager-vma"])
def test_shmap_all_to_all_grad(backend, jit, check_vma):
    mesh = mesh_of(backend, (4,), ("x",))
    a = put(arange((8, 8), np.float32), mesh, P("x", None))

    def run(ops):
        fwd = smap(lambda x: ops.all_to_all(x, "x", split_axis=1, concat_axis=0, tiled=True), mesh,
                   (P("x", None),), P(None, "x"), jit=jit, check_vma=check_vma)

        def loss(x):
            value = fwd(x).sum() * 2
            return value, value

        grad = jax.grad(loss, has_aux=True)
        g, value = (jax.jit(grad) if jit else grad)(a)
        return {"fwd": fwd(a), "grad": g, "loss": value}

    actual, _ = parity(run, reduced={"loss"})
    np.testing.assert_array_equal(actual["fwd"], a)
    assert actual["loss"] == 2 * sum(range(64))
    np.testing.assert_array_equal(actual["grad"], 2 * np.ones((8, 8)))


@pytest.mark.parametrize("axes", [("x", "y"), ("y", "x")], ids="+".join)
def test_shmap_eager_control_flow(backend, axes):
    mesh = mesh_of(backend, (2, 2), ("x", "y"))
    x = jnp.arange(2 * 2.0).reshape(2, 2)

    def body(ops, v):
        y = ops.psum(v, axes)
        return v if y < 0 else -v

    actual, _ = parity(lambda ops: smap(partial(body, ops), mesh, (P("x", "y"),), P("x", "y"), jit=False)(x))
    np.testing.assert_array_equal(actual, -x)


SMALL_CASES = {
    "repeated_psum": (4, "i", P("i"), P(), lambda ops, v: ops.psum(ops.psum(v, "i"), "i"), True),
    "pmin": (4, "i", P("i"), P(), lambda ops, v: ops.pmin(v, "i"), True),
    "pmax": (4, "i", P("i"), P(), lambda ops, v: ops.pmax(v, "i"), True),
    "pmax_vma_in_types": (4, "i", P(), P(), lambda ops, v: ops.pmax(v, "i"), True),
    "all_gather_with_vma_in_types": (2, "x", P(), P("x"), lambda ops, v: ops.all_gather(v, "x"), False),
    "all_reduce_rgv3": (None, None, P("x", "y"), P("x", "y"), lambda ops, v: ops.psum(v, "x"), True),
}


@pytest.mark.parametrize("case", SMALL_CASES)
def test_shmap_small_cases(backend, case):
    """test_repeated_psum_allowed, test_pmin, test_pmax, test_pmax_vma_in_types (a replicated input, so the op
    itself makes it varying), test_all_gather_with_vma_in_types, test_all_reduce_rgv3."""
    n, name, in_spec, out_spec, body, reduced = SMALL_CASES[case]
    if n is None:
        mesh, x = mesh_of(backend, (2, 2), ("x", "y")), jnp.ones((2, 2))
    else:
        mesh, x = mesh_of(backend, (n,), (name,)), jnp.arange(8.0)
    actual, _ = parity(lambda ops: smap(partial(body, ops), mesh, (in_spec,), out_spec)(x), reduced=reduced)
    expected = {"repeated_psum": lambda: np.asarray(x).reshape(4, 2).sum(0) * 4, "pmin": lambda: [0, 1],
                "pmax": lambda: [6, 7], "all_reduce_rgv3": lambda: 2 * np.asarray(x)}
    if case in expected:
        np.testing.assert_array_equal(actual, np.asarray(expected[case](), np.float32))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_shmap_get_check_rep(backend, jit):
    """test_get_check_rep: psum over some of the mesh's axes; its result varies over the others only (the
    varying axes of jax_ncclx's result must be jax.lax's), out_specs without the reduced axes."""
    mesh = mesh_of(backend, (2, 2), ("x", "y"))
    x = arange((8, 8), np.float32)
    for reduce_along in [("y",), ("x",), ("x", "y"), ("y", "x")]:
        out_spec = P(*(n for n in ("x", "y") if n not in reduce_along))
        varying = {}

        def body(ops, v):
            result = ops.psum(v, reduce_along)
            varying[ops.name] = (set(jax.typeof(v).mat.varying), set(jax.typeof(result).mat.varying))
            return result

        parity(lambda ops: smap(partial(body, ops), mesh, (P("x", "y"),), out_spec, jit=jit)(x), reduced=True)
        assert varying["jax_ncclx"] == varying["jax.lax"], (reduce_along, varying)
        assert varying["jax.lax"][1] == varying["jax.lax"][0] - set(reduce_along)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_shmap_psum_transpose_non_zero_cts(backend, jit):
    mesh = mesh_of(backend, (8,), ("x",))
    x1 = jnp.arange(16.0)

    def run(ops):
        f1 = jax.shard_map(lambda b: (b, ops.psum(b, axis_name="x")), mesh=mesh, in_specs=P("x"),
                           out_specs=(P("x"), P()))
        grad = jax.grad(lambda b: f1(b)[0].sum())
        return {"f1": f1(x1), "grad": (jax.jit(grad) if jit else grad)(x1)}

    parity(run, reduced=True)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_shmap_vmap_shmap_psum_explicit_mesh(backend, jit):
    """test_vmap_shmap_psum: vmap over a shard_map on an explicit mesh, the batch dimension sharded over "x".
    The vmapped shard_map leaves "x" to the compiler, which cannot partition jax_ncclx's custom calls: jax_ncclx
    refuses it on purpose, with the error docs/sharp_bits.md documents; jax.lax runs it."""
    mesh = mesh_of(backend, (2, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)

    def run(ops):
        with jax.set_mesh(mesh):
            arr = jax.device_put(jnp.arange(16).reshape(2, 8), P("x", "y"))
            f = jax.shard_map(lambda v: ops.psum(v, axis_name="y"), in_specs=P("y"), out_specs=P(None))
            return (jax.jit(jax.vmap(f)) if jit else jax.vmap(f))(arr)

    out = run(LAX)
    assert out.sharding == NamedSharding(mesh, P("x", None)), out.sharding
    with pytest.raises(NotImplementedError, match=r"jax_ncclx\.all_reduce: jax\.shard_map must make every mesh axis "
                                                  r"of size > 1 manual; its axis_names leave 'x' to the compiler"):
        run(NX)


def _vmap_shmap_body(ops, x, y):
    """Every collective over "y" on x [2, 6] (per member) and y [6] (replicated)."""
    return {"psum": ops.psum(x * y, "y"),
            "pmax": ops.pmax(x - y, "y"),
            "all_gather": ops.all_gather(x, "y", tiled=True) * y,
            "psum_scatter": ops.psum_scatter(x * y, "y", scatter_dimension=1, tiled=True),
            "all_to_all": ops.all_to_all(x + y, "y", 1, 0, tiled=True),
            "ppermute": ops.ppermute(x * y, "y", [(0, 1), (1, 0)])}


VMAP_IN_AXES = {"both_batched": (0, 0), "y_unbatched": (0, None), "x_unbatched": (None, 0),
                "x_batched_dim1": (1, None)}


@pytest.mark.parametrize("in_axes,spmd_axis_name,check_vma",
                         [("both_batched", None, True), ("both_batched", "x", True), ("y_unbatched", None, True),
                          ("y_unbatched", "x", True), ("x_unbatched", None, True), ("x_batched_dim1", "x", True),
                          ("both_batched", None, False), ("y_unbatched", "x", False)],
                         ids=lambda v: {None: "no_spmd", "x": "spmd_x", True: "vma", False: "no_vma"}.get(v, v))
def test_shmap_vmap_of_shard_map(backend, in_axes, spmd_axis_name, check_vma):
    """ShardMapSystematicTest.test_vmap and test_vmap_shmap_spmd_axis_name_scalar with collectives in the
    body: vmap over a jitted shard_map, each operand batched (along dim 0 or 1) or not (in_axes None)."""
    mesh = mesh_of(backend, (2, 2), ("x", "y"))
    axes = VMAP_IN_AXES[in_axes]
    batch = 2
    x_shape = {0: (batch, 4, 6), 1: (4, batch, 6), None: (4, 6)}[axes[0]]
    y_shape = {0: (batch, 6), None: (6,)}[axes[1]]
    x = jnp.asarray(arange(x_shape, np.float32) / 7)
    y = jnp.asarray(1 + arange(y_shape, np.float32) / 5)

    def run(ops):
        f = smap(partial(_vmap_shmap_body, ops), mesh, (P("y"), P()), P("y"), check_vma=check_vma)
        return jax.vmap(f, in_axes=axes, spmd_axis_name=spmd_axis_name)(x, y)

    actual, _ = parity(run, reduced={"psum", "psum_scatter"})
    # and as ShardMapSystematicTest.test_vmap checks: the vmap equals the stacked slices
    f = smap(partial(_vmap_shmap_body, NX), mesh, (P("y"), P()), P("y"), check_vma=check_vma)
    take = lambda v, ax, i: v if ax is None else jnp.take(v, i, axis=ax)  # noqa: E731
    stacked = jax.tree.map(lambda *s: jnp.stack(s), *[f(take(x, axes[0], i), take(y, axes[1], i))
                                                      for i in range(batch)])
    assert_same(actual, stacked, reduced={"psum", "psum_scatter"})


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
def test_shmap_grads(backend, check_vma, jit=True):
    """ShardMapSystematicTest.test_grads (check_rep True / False) with collectives: the gradient of
    sum(w * op(x)) through the shard_map for each op (jax.lax has no derivative of pmax / pmin)."""
    mesh = mesh_of(backend, (2, 4), ("x", "y"))
    spec = P("x", "y")
    ops_of = {
        "psum": lambda ops, v: ops.psum(v, "y"),
        "psum_xy": lambda ops, v: ops.psum(v, ("x", "y")),
        "pmean_yx": lambda ops, v: ops.pmean(v, ("y", "x")),
        "all_gather": lambda ops, v: ops.all_gather(v, "y", axis=1),
        "all_gather_tiled": lambda ops, v: ops.all_gather(v, ("x", "y"), axis=-1, tiled=True),
        "psum_scatter": lambda ops, v: ops.psum_scatter(v, "y", scatter_dimension=1, tiled=True),
        "psum_scatter_untiled": lambda ops, v: ops.psum_scatter(v.reshape(2, 4, 2), "y", scatter_dimension=1),
        "all_to_all": lambda ops, v: ops.all_to_all(v, "y", 1, 0, tiled=True),
        "ppermute": lambda ops, v: ops.ppermute(v, "y", [(0, 2), (2, 1), (1, 3), (3, 0)]),
    }
    x = jnp.asarray(np.sin(arange((4, 32), np.float32)))

    def run(ops):
        def body(*vs):
            return {name: fn(ops, v) for (name, fn), v in zip(ops_of.items(), vs)}

        f = smap(body, mesh, (spec,) * len(ops_of), spec, check_vma=check_vma, jit=jit)

        def loss(*vs):
            outs = f(*vs)
            return sum(jnp.sum(jnp.cos(k + out) * out) for k, out in enumerate(outs.values()))

        grad = jax.grad(loss, argnums=tuple(range(len(ops_of))))
        grads = (jax.jit(grad) if jit else grad)(*([x] * len(ops_of)))
        return dict(zip(ops_of, grads))

    parity(run, reduced=True)


def test_shmap_ppermute_zip_error(backend):
    mesh = mesh_of(backend, (2,), ("x",))
    arr = jnp.arange(8)
    same_error(lambda ops: smap(lambda v: ops.ppermute(v, "x", zip([0, 1], [1, 0])), mesh, (P("x"),), P("x"))(arr))


RGV3_SCATTER = {
    "simple": ((2, 2), ("x", "y"), P("x", "y"), "x", 0, (4, 2)),
    "multidim_mesh": ((1, 1, 2, 1), ("replica", "data", "seq", "model"), P(None, "seq", None), "seq", 1, (1, 4, 8)),
    "multidim_mesh_tuple_sharding": ((1, 1, 2, 1), ("replica", "data", "seq", "model"),
                                     P(("replica", "data"), "seq", None), "seq", 1, (1, 4, 8)),
}


@pytest.mark.parametrize("case", RGV3_SCATTER)
def test_shmap_reduce_scatter_rgv3(backend, case):
    """test_reduce_scatter_rgv3's meshes (axes of size 1 around the scattered one), on its ones and on an arange."""
    mesh_shape, names, spec, axis, dim, shape = RGV3_SCATTER[case]
    mesh = mesh_of(backend, mesh_shape, names)

    def run(ops):
        f = smap(lambda v: ops.psum_scatter(v, axis, scatter_dimension=dim, tiled=True), mesh, (spec,), spec)
        return {"ones": f(jnp.ones(shape)), "arange": f(jnp.asarray(arange(shape, np.float32)))}

    actual, _ = parity(run, reduced=True)
    out_shape = list(shape)
    out_shape[dim] //= 2
    np.testing.assert_array_equal(actual["ones"], 2 * np.ones(out_shape))


def test_shmap_all_gather_rgv3(backend):
    """test_all_gather_rgv3: all_gather(..., to="invarying") leaves the result replicated over "x"."""
    mesh = mesh_of(backend, (2, 2), ("x", "y"))
    x = jnp.asarray(arange((2, 2), np.float32))

    def run(ops):
        return smap(lambda v: ops.all_gather(v, "x", tiled=True, to="invarying"), mesh, (P("x", "y"),),
                    P(None, "y"))(x)

    parity(run)


# ==============================================================================================================
# pmap_test.py

@pytest.mark.parametrize("dtype", GATHER_DTYPES, ids=DTYPE_ID)
def test_pmap_gather(backend, dtype):
    """testGather, testGatherBool, testGatherNegativeAxis, testGatherTiled, testGatherTiledNegativeAxis."""
    mesh = pmesh(backend)
    n = mesh.size
    x, x3 = arange((n, 4), dtype), arange((n, 4, 3), dtype)

    def run(ops):
        def fn(v, v3):
            return {"gather": ops.all_gather(v, "i"),
                    "negative_axis": ops.all_gather(v, "i", axis=-1),
                    "tiled": ops.all_gather(v, "i", tiled=True),
                    "tiled_negative_axis": ops.all_gather(v3, "i", tiled=True, axis=-1)}
        return pmap_like(fn, mesh)(x, x3)

    actual, _ = parity(run)
    np.testing.assert_array_equal(actual["gather"], np.array([x] * n))
    np.testing.assert_array_equal(actual["negative_axis"], np.array([x.T] * n))
    np.testing.assert_array_equal(actual["tiled_negative_axis"], np.array([x3.transpose(1, 0, 2).reshape(4, -1)] * n))


@pytest.mark.parametrize("prim", ["all_gather", "psum_scatter"])
def test_pmap_vmap_of(backend, prim):
    """testVmapOf: vmap over the pmap (a batched operand)."""
    mesh = pmesh(backend)
    n = mesh.size
    x = arange((4, n, n), np.float32)

    def run(ops):
        f = pmap_like(lambda v: getattr(ops, prim)(v, "i"), mesh)
        return jax.vmap(f)(x)

    actual, _ = parity(run, reduced=prim == "psum_scatter")
    f = pmap_like(lambda v: getattr(NX, prim)(v, "i"), mesh)
    assert_same(actual, jnp.stack([f(xs) for xs in x], axis=0), reduced=prim == "psum_scatter")


@pytest.mark.parametrize("dtype", [np.float32, np.int32], ids=DTYPE_ID)
def test_pmap_reduce_scatter(backend, dtype):
    """testReduceScatter, testReduceScatterTiled, testReduceScatterNegativeScatterDimension."""
    mesh = pmesh(backend)
    n = mesh.size
    x2, x_tiled, x3 = arange((n, n), dtype), arange((n, 4 * n), dtype), arange((n, n, 4 * n), dtype)

    def run(ops):
        def fn(a, b, c):
            return {"untiled": ops.psum_scatter(a, "i"),
                    "tiled": ops.psum_scatter(b, "i", tiled=True),
                    "scatter_dimension_1": ops.psum_scatter(c, "i", scatter_dimension=1, tiled=True),
                    "scatter_dimension_-1": ops.psum_scatter(c, "i", scatter_dimension=-1, tiled=True),
                    "untiled_scatter_dimension_-2": ops.psum_scatter(c, "i", scatter_dimension=-2)}
        return pmap_like(fn, mesh)(x2, x_tiled, x3)

    actual, _ = parity(run, reduced=True)
    expected = np.sum(x2, axis=0)
    for i in range(n):
        np.testing.assert_allclose(actual["untiled"][i], expected[i])
    np.testing.assert_array_equal(actual["scatter_dimension_-1"], actual["scatter_dimension_1"])


def test_pmap_reduce_scatter_replica_groups_tiled(backend):
    mesh = pmesh(backend)
    n = mesh.size
    if n % 2:
        pytest.skip("needs an even number of devices")
    groups = [[i for i in range(n) if i % 2 == 0], [i for i in range(n) if i % 2 != 0]]
    x = arange((n, 4 * n), np.float32)
    actual, _ = parity(lambda ops: pmap_like(lambda v: ops.psum_scatter(v, "i", axis_index_groups=groups,
                                                                        tiled=True), mesh)(x), reduced=True)
    scatter_len = 4 * n * 2 // n
    for i, row in enumerate(actual):
        group_sum = np.sum(x[i % 2::2], axis=0)
        np.testing.assert_allclose(row, group_sum[i // 2 * scatter_len:(i // 2 + 1) * scatter_len])


def _pmap_tree_ops(ops):
    def protate(v, axis_name):
        n = jax.lax.axis_size(axis_name)
        return ops.ppermute(v, axis_name, [(i, (i + 1) % n) for i in range(n)])

    return {"pmax": ops.pmax, "pmin": ops.pmin, "psum": ops.psum, "pmean": ops.pmean,
            "ptranspose": lambda v, a: ops.all_to_all(v, a, 0, 0), "protate": protate}


@pytest.mark.parametrize("case", ["trees", "trees_of_different_dtypes"])
def test_pmap_trees(backend, case):
    """testTrees and testCollectivesWithTreesOfDifferentDtypes: each collective on a dict of arrays."""
    mesh = pmesh(backend)
    n = mesh.size
    if case == "trees":
        x = {k: np.arange(lo * n * n, (lo + 1) * n * n).reshape(n, n).astype(np.int32)
             for k, lo in (("a", 1), ("b", 2), ("c", 4))}
    else:
        x = {k: np.arange(lo * n * n, (lo + 1) * n * n, dtype=dt).reshape(n, n)
             for k, lo, dt in (("a", 1, np.float32), ("b", 2, np.int32), ("c", 4, np.float32), ("d", 6, np.int32))}

    def run(ops):
        names = _pmap_tree_ops(ops)
        if case != "trees":
            names = {k: names[k] for k in ("pmax", "pmin", "psum", "pmean")}
        return pmap_like(lambda v: {k: op(v, "i") for k, op in names.items()}, mesh)(x)

    actual, _ = parity(run, reduced={"pmax", "pmin", "psum", "pmean"})
    np_f = lambda p: jax.tree.map(lambda v: np.broadcast_to(p(v, 0), v.shape), x)  # noqa: E731
    for name, bulk in (("pmax", np.max), ("pmin", np.min), ("psum", np.sum), ("pmean", np.mean)):
        jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-6), actual[name], np_f(bulk))
    if case == "trees":
        jax.tree.map(np.testing.assert_array_equal, actual["ptranspose"], jax.tree.map(np.transpose, x))
        jax.tree.map(np.testing.assert_array_equal, actual["protate"],
                     jax.tree.map(lambda v: np.concatenate([v[-1:], v[:-1]]), x))


PMAP_REDUCTIONS = {
    "reduce_max": (lambda ops, v: v - ops.pmax(v, "i"), np.float32, lambda x: x - np.max(x, 0)),
    "reduce_min": (lambda ops, v: v - ops.pmin(v, "i"), np.float32, lambda x: x - np.min(x, 0)),
    "complex_psum": (lambda ops, v: v - ops.psum(v, "i"), np.complex64, lambda x: x - np.sum(x, 0)),
}


@pytest.mark.parametrize("case", PMAP_REDUCTIONS)
def test_pmap_reductions(backend, case):
    """testReduceMax, testReduceMin, testComplexPsum."""
    mesh = pmesh(backend)
    n = mesh.size
    body, dtype, ref = PMAP_REDUCTIONS[case]
    if dtype == np.complex64:
        x = np.arange(n * 4 * 2, dtype=np.float32).reshape(n, 4 * 2).view(np.complex64)
    else:
        x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
    actual, _ = parity(lambda ops: pmap_like(partial(body, ops), mesh)(x), reduced=True)
    np.testing.assert_allclose(actual, ref(x), rtol=1e-6)


def test_pmap_psum_on_boolean_dtype(backend):
    """testPsumOnBooleanDtype: psum counts booleans in int32, pmean gives float32."""
    mesh = pmesh(backend, 2)
    x = jnp.array([True, False])
    actual, _ = parity(lambda ops: pmap_like(lambda v: {"psum": ops.psum(v, "i"), "pmean": ops.pmean(v, "i")},
                                             mesh)(x), reduced=True)
    assert list(actual["psum"]) == [1, 1] and list(actual["pmean"]) == [0.5, 0.5]


ALL_TO_ALL_DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32, np.float16,
                     jnp.bfloat16, np.float32, np.complex64]


@pytest.mark.slow  # pmap in vmap: each compiles several nested programs
def test_pmap_all_to_all(backend):
    """testAllToAll (split_axis, concat_axis in {0, 1}, every dtype of lax_test_util.all_dtypes but the
    64-bit ones) and testAllToAllNegativeAxes (float32), in one program; random bits, so every bit pattern
    must arrive."""
    mesh = pmesh(backend)
    n = mesh.size
    x = {DTYPE_ID(d): (np.random.default_rng(0).random((n, n, n)) > 0.5 if d == np.bool_ else
                       random_bits((n, n, n), d, seed=k)) for k, d in enumerate(ALL_TO_ALL_DTYPES)}

    def run(ops):
        def fn(v):
            return {f"split{s}_concat{c}": ops.all_to_all(v, "i", s, c) for s in range(2) for c in range(2)}

        def all_dtypes(v):
            out = {name: fn(leaf) for name, leaf in v.items()}
            out["float32"]["split-2_concat-1"] = ops.all_to_all(v["float32"], "i", -2, -1)
            return out
        return pmap_like(all_dtypes, mesh)(x)

    # XLA:CPU's all_to_all (jax.lax) quiets the NaNs of 16-bit floats, so against it a NaN matches any NaN;
    # jax_ncclx's must keep every bit of the NumPy reference
    expected = jax.block_until_ready(run(LAX))
    actual = jax.block_until_ready(run(NX))
    assert_same(actual, expected, nan_payloads=True)
    for name, leaf in x.items():
        for s, c in it.product(range(2), range(2)):
            assert_bits_equal(actual[name][f"split{s}_concat{c}"], np.moveaxis(leaf, (0, s + 1), (c + 1, 0)))
    assert_bits_equal(actual["float32"]["split-2_concat-1"], actual["float32"]["split0_concat1"])


def _jvp_vjp(f, args, seed=1):
    """The JVP and the VJP of f at args with random tangents and cotangents (one program each)."""
    rng = np.random.default_rng(seed)
    tangents = jax.tree.map(lambda a: rng.normal(size=np.shape(a)).astype(np.asarray(a).dtype), args)
    out, tangent_out = jax.jvp(f, args, tangents)
    cotangent = jax.tree.map(lambda o: rng.normal(size=o.shape).astype(o.dtype), out)
    return {"out": out, "jvp": tangent_out, "vjp": jax.vjp(f, *args)[1](cotangent)}


def test_pmap_grad_of_psum(backend):
    mesh = pmesh(backend)
    x = np.arange(mesh.size * 4, dtype=np.float32).reshape(mesh.size, 4)
    parity(lambda ops: _jvp_vjp(pmap_like(lambda v: ops.psum(v, axis_name="i"), mesh), (x,)), reduced=True)


def test_pmap_partially_mapped(backend):
    """testPartiallyMapped: an unmapped argument (in_axes None) beside a mapped one."""
    mesh = pmesh(backend)
    x = np.array(3.0, dtype=np.float32)
    y = np.arange(mesh.size * 4, dtype=np.float32).reshape(mesh.size, 4)
    actual, _ = parity(lambda ops: pmap_like(lambda a, b: a - ops.psum(b, "i"), mesh, in_axes=(None, 0))(x, y),
                       reduced=True)
    np.testing.assert_allclose(actual, np.broadcast_to(x - np.sum(y, 0, keepdims=True), y.shape))


@pytest.mark.parametrize("case", ["constant", "uneven", "even"])
def test_pmap_psum_replica_groups(backend, case):
    """testPsumConstantReplicaGroups (psum of a Python float), testPsumUnevenReplicaGroups ([[0, 1],
    np.arange(2, n)]: groups of two sizes, one a NumPy array), testPsumReplicaGroups; under jax.pmap as in
    JAX (jax.lax refuses psum's groups in shard_map) and, for jax_ncclx, under shard_map too."""
    mesh = pmesh(backend)
    n = mesh.size
    if n % 2 or (case == "uneven" and n <= 2):
        pytest.skip("needs an even number of devices (more than 2 for uneven groups)")
    halves = np.arange(n).reshape(2, n // 2).tolist()
    x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
    if case == "constant":
        fn = lambda ops, v: v - ops.psum(2.0, "i", axis_index_groups=halves)  # noqa: E731
        expected = x - 2.0 * n // 2
    else:
        groups = [[0, 1], np.arange(2, n)] if case == "uneven" else halves
        fn = lambda ops, v: v - ops.psum(v, "i", axis_index_groups=groups)  # noqa: E731
        expected = x - np.concatenate([np.broadcast_to(x[np.asarray(g)].sum(0), (len(g), 4)) for g in groups])
    # jax.lax.psum with axis_index_groups raises NotImplementedError inside shard_map: jax.lax's result comes
    # from jax.pmap, jax_ncclx's from jax.pmap and from shard_map
    real_pmap = lambda ops: jax.pmap(partial(fn, ops), axis_name="i", devices=list(mesh.devices.flat))(x)  # noqa: E731
    reference = real_pmap(LAX)
    assert_same(real_pmap(NX), reference, reduced=True)
    actual = pmap_like(partial(fn, NX), mesh)(x)
    assert_same(actual, reference, reduced=True)
    np.testing.assert_allclose(actual, expected)


def even_pmesh_and_strided_groups(backend):
    """pmesh(backend), its size n and the two groups of every other index; skips on an odd number of devices."""
    mesh = pmesh(backend)
    n = mesh.size
    if n % 2:
        pytest.skip("needs an even number of devices")
    return mesh, n, np.arange(n, dtype=np.int32).reshape(n // 2, 2).T.tolist()


def test_pmap_gather_replica_groups(backend):
    """testGatherReplicaGroups and testGatherReplicaGroupsInterleaved."""
    mesh, n, strided = even_pmesh_and_strided_groups(backend)
    indexes = np.arange(n)
    interleaved = np.concatenate([indexes[::2], indexes[1::2]]).reshape(2, n // 2).tolist()
    x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)

    def run(ops):
        return pmap_like(lambda v: {"strided": ops.all_gather(v, "i", axis_index_groups=strided),
                                    "interleaved": ops.all_gather(v, "i", axis_index_groups=interleaved)}, mesh)(x)

    actual, _ = parity(run)
    expected = np.empty((n, n // 2, 4), np.float32)
    expected[0::2], expected[1::2] = x[0::2], x[1::2]
    np.testing.assert_array_equal(actual["strided"], expected)
    np.testing.assert_array_equal(actual["interleaved"], expected)


@pytest.mark.parametrize("prim,tiled,use_groups", [
    ("all_gather", False, False), ("all_gather", True, False), ("all_gather", False, True),
    ("psum_scatter", False, False), ("psum_scatter", True, False), ("psum_scatter", False, True)],
    ids=["Gather", "GatherTiled", "GatherIndexGroups", "ReduceScatter", "ReduceScatterTiled",
         "ReduceScatterIndexGroups"])
def test_pmap_grad_of(backend, prim, tiled, use_groups):
    """testGradOf: the JVP and VJP against jax.lax's (JAX's check_grads compares them with numerical
    differences; these ops are linear, so the first order is all there is)."""
    mesh = pmesh(backend)
    n = mesh.size
    groups = [(2 * k, 2 * k + 1) for k in range(n // 2)] if use_groups else None
    if use_groups and n % 2:
        pytest.skip("needs an even number of devices")
    x = np.arange(n * (2 if groups else n), dtype=np.float32).reshape(n, 2 if groups else n)
    f_of = lambda ops: pmap_like(lambda v: getattr(ops, prim)(v, axis_name="i", tiled=tiled,  # noqa: E731
                                                              axis_index_groups=groups), mesh)
    parity(lambda ops: _jvp_vjp(f_of(ops), (x,)), reduced=True)


def test_pmap_collective_permute(backend):
    """testCollectivePermute, testPpermuteWithZipObject, testCollectivePermuteGrad (a shift without wrap) and
    testCollectivePermuteCyclicGrad, gradients against jax.lax's and JAX's expected values."""
    mesh = pmesh(backend)
    n = mesh.size
    rotation = [(i, (i + 1) % n) for i in range(n)]
    shift_right = [(i, i + 1) for i in range(n - 1)]
    perm = [n - 1] + list(range(n - 1))
    x = jnp.arange(4 * n).reshape(n, 4)
    y = np.pi + np.arange(n, dtype=np.float32)
    xf = np.arange(n, dtype=np.float32)

    def run(ops):
        out = {"rotation": pmap_like(lambda v: ops.ppermute(v, perm=rotation, axis_name="i"), mesh)(x),
               "zip": pmap_like(lambda v: ops.ppermute(v, "i", list(zip(perm, range(n)))), mesh)(
                   jnp.arange(n, dtype=jnp.float32))}
        for name, p in (("grad_shift", shift_right), ("grad_cyclic", rotation)):
            def g(v, p=p):
                return jnp.sum(y * pmap_like(lambda a: ops.ppermute(a, perm=p, axis_name="i"), mesh)(v))

            out[name] = jax.grad(g)(xf)
        return out

    actual, _ = parity(run)
    np.testing.assert_array_equal(actual["rotation"], np.roll(x, shift=1, axis=0))
    np.testing.assert_array_equal(actual["zip"], np.asarray(perm, np.float32))
    np.testing.assert_allclose(actual["grad_shift"], np.concatenate([np.pi + np.arange(1, n), [0]]), rtol=1e-6)
    np.testing.assert_allclose(actual["grad_cyclic"], np.roll(np.pi + np.arange(n), -1), rtol=1e-6)


def test_pmap_rule30(backend):
    """testRule30: a halo exchange of booleans with ppermute, nine steps of the automaton."""
    mesh = pmesh(backend)
    n = mesh.size
    if 40 % n:
        pytest.skip("the 40-cell board must split evenly")

    def boards(ops):
        def send_right(v):
            return ops.ppermute(v, "i", [(i, (i + 1) % n) for i in range(n)])

        def send_left(v):
            return ops.ppermute(v, "i", [((i + 1) % n, i) for i in range(n)])

        def step(board_slice):
            left, right = board_slice[:1], board_slice[-1:]
            right, left = send_left(left), send_right(right)
            enlarged = jnp.concatenate([left, board_slice, right])
            return jax.lax.bitwise_xor(enlarged[:-2], jax.lax.bitwise_or(enlarged[1:-1], enlarged[2:]))

        step = pmap_like(step, mesh)
        board = np.zeros(40, dtype=bool)
        board[board.shape[0] // 2] = True
        board = board.reshape(n, -1)
        out = [board]
        for _ in range(9):
            board = jax.block_until_ready(step(board))
            out.append(board)
        return np.stack([np.asarray(b).ravel() for b in out])

    actual, _ = parity(boards)
    assert ["".join("*" if c else " " for c in row) for row in actual] == RULE30


RULE30 = [
    "                    *                   ",
    "                   ***                  ",
    "                  **  *                 ",
    "                 ** ****                ",
    "                **  *   *               ",
    "               ** **** ***              ",
    "              **  *    *  *             ",
    "             ** ****  ******            ",
    "            **  *   ***     *           ",
    "           ** **** **  *   ***          ",
]


def test_pmap_pswapaxes(backend):
    """testPswapaxes and testGradOfPswapaxes (jax.lax.pswapaxes is all_to_all(x, axis, axis))."""
    mesh = pmesh(backend)
    n = mesh.size
    x = np.arange(n * 3 * n * 5).reshape(n, 3, n, 5)
    xg = np.arange(n * n, dtype=np.float32).reshape(n, 1, n)
    w = np.arange(n, dtype=np.float32)

    def run(ops):
        def grad_body(v, wi):
            return jax.grad(lambda a: jnp.sum(ops.pswapaxes(a, "i", 1) * wi))(v)
        return {"swap": pmap_like(lambda v: ops.pswapaxes(v, "i", 1), mesh)(x),
                "grad": pmap_like(grad_body, mesh)(xg, w)}

    actual, _ = parity(run)
    np.testing.assert_array_equal(actual["swap"], np.swapaxes(x, 0, 2))
    np.testing.assert_array_equal(actual["grad"], np.tile(w, reps=n).reshape(n, 1, n))


def test_pmap_all_to_all_replica_groups(backend):
    """testAllToAllReplicaGroups and testGradOfAllToAllReplicaGroups."""
    mesh, n, strided = even_pmesh_and_strided_groups(backend)
    halves = np.arange(n, dtype=np.int32).reshape(2, n // 2).tolist()
    x = np.arange(n * (n // 2)).reshape(n, n // 2)
    xg = np.arange(n * (n // 2), dtype=np.float32).reshape(n, n // 2, 1)
    w = np.arange(n, dtype=np.float32)

    def run(ops):
        def grad_body(v, wi):
            return jax.grad(lambda a: jnp.sum(ops.all_to_all(a, "i", 0, 1, axis_index_groups=halves) * wi))(v)
        return {"fwd": pmap_like(lambda v: ops.all_to_all(v, "i", 0, 0, axis_index_groups=strided), mesh)(x),
                "grad": pmap_like(grad_body, mesh)(xg, w)}

    actual, _ = parity(run)
    np.testing.assert_array_equal(actual["fwd"], np.swapaxes(x.reshape(n // 2, 2, n // 2), 0, 2).reshape(n, n // 2))
    expected = np.ones_like(xg) * w[:, None, None]
    np.testing.assert_array_equal(actual["grad"],
                                  np.swapaxes(expected.reshape(2, n // 2, n // 2), 1, 2).reshape(xg.shape))


def test_pmap_psum_zero_cotangents(backend):
    """testPsumZeroCotangents: psum of a pytree of gradients inside a gradient, over a pmap of one member."""
    mesh = pmesh(backend, 1)

    def outer_of(ops):
        def loss(params, meta_params):
            net, mpo = params
            return meta_params * mpo * net

        def inner(meta_params, params):
            grads = ops.psum(jax.grad(loss)(params, meta_params), axis_name="i")
            net_grads, _ = grads
            return params[1] * (params[0] + net_grads)

        return lambda params: jax.grad(inner)(jnp.array(4.0), params)

    params = (jnp.array([2.0]), jnp.array([3.0]))
    parity(lambda ops: _jvp_vjp(pmap_like(outer_of(ops), mesh), (params,)), reduced=True)


# --- VmapPmapCollectivesTest ----------------------------------------------------------------------------------

def nested_maps(devices, map1, map2, fn, shape, *, names=("i", "j"), check_vma=True):
    """fn under map1 (outer, axis names[0]) and map2 (inner, axis names[1]), each "vmap" or "pmap" (a shard_map
    over a one-axis mesh of that dimension's size); a name None leaves that map's axis unnamed."""
    def wrap(kind, f, name, size):
        if kind == "vmap":
            return jax.vmap(f, axis_name=name) if name else jax.vmap(f)
        return pmap_like(f, mesh_of(devices, (size,), (name or "unnamed",)), check_vma=check_vma)

    return wrap(map1, wrap(map2, fn, names[1], shape[1]), names[0], shape[0])


COLLECTIVES = ["psum", "pmean", "pmax", "pmin"]


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
@pytest.mark.parametrize("shape", [(2, 2, 64, 64), (4, 2, 64, 64)], ids=["WithVmap", "WithVmap2"])
@pytest.mark.slow  # pmap in vmap: each compiles several nested programs
def test_vmap_pmap_collectives_with_vmap(backend, shape, check_vma):
    """testCollectivesWithVmap / testCollectivesWithVmap2: each reduction over ("i", "j") with "i" and "j" a
    vmap or a pmap, against jax.lax under vmap / vmap (JAX's reference; jax.lax refuses a vmapped axis in a
    collective inside shard_map(check_vma=True), so its pmap forms run with check_vma=False)."""
    x = jnp.ones(shape) if shape[0] == 2 else jnp.arange(math.prod(shape), dtype=jnp.float32).reshape(shape)

    def fn(ops, a, b):
        return {name: a + getattr(ops, name)(a.dot(b), ("i", "j")) for name in COLLECTIVES}

    reference = jax.jit(nested_maps(backend, "vmap", "vmap", partial(fn, LAX), shape))(x, x)
    for map1, map2 in [("vmap", "vmap"), ("pmap", "vmap"), ("vmap", "pmap")]:
        actual = nested_maps(backend, map1, map2, partial(fn, NX), shape, check_vma=check_vma)(x, x)
        assert_same(actual, reference, reduced=True)
        if map1 != map2:  # jax.lax's same program
            lax_program = nested_maps(backend, map1, map2, partial(fn, LAX), shape, check_vma=False)(x, x)
            assert_same(actual, lax_program, reduced=True)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
@pytest.mark.slow  # pmap in vmap: each compiles several nested programs
def test_vmap_pmap_ppermute_with_vmap(backend, check_vma):
    """testPPermuteWithVmap: ppermute over the outer axis "i" (a vmap or a pmap) with an unnamed inner map."""
    perm = [(0, 1), (1, 0)]
    shape = (2, 2, 64, 64)
    inputs = {"ones": jnp.ones(shape), "arange": jnp.arange(math.prod(shape), dtype=jnp.float32).reshape(shape) / 1e4}

    def fn(ops, a, b):
        return a + ops.ppermute(a.dot(b), "i", perm)

    def run(ops, map1, map2, vma):
        f = nested_maps(backend, map1, map2, partial(fn, ops), shape, names=("i", None), check_vma=vma)
        return {k: f(v, v) for k, v in inputs.items()}

    lax_vp = run(LAX, "vmap", "pmap", False)
    assert_same(run(NX, "vmap", "pmap", check_vma), lax_vp)
    assert_same(run(NX, "pmap", "vmap", check_vma), run(LAX, "pmap", "vmap", check_vma))
    assert_same(run(NX, "pmap", "vmap", check_vma), lax_vp)


@pytest.mark.slow  # pmap in vmap: each compiles several nested programs
def test_vmap_pmap_ppermute_agrees_with_vmap(backend):
    mesh = pmesh(backend, 3)
    xs = jnp.arange(3) * 10

    def run(ops):
        f = lambda v: ops.ppermute(v, "i", [[1, 0], [2, 1], [0, 2]])  # noqa: E731
        return {"pmap": pmap_like(f, mesh)(xs), "vmap": jax.vmap(f, axis_name="i")(xs)}

    actual, _ = parity(run)
    assert_same(actual["pmap"], actual["vmap"])


@pytest.mark.slow  # pmap in vmap: each compiles several nested programs
def test_vmap_pmap_all_to_all_in_vmap(backend):
    """testAllToAllInVmap: pmap(vmap(all_to_all over the pmap's axis, in_axes=vmap_axis)), every split_axis,
    concat_axis in 0..2 and vmap_axis in 0..3, in one program."""
    mesh = pmesh(backend)
    n = mesh.size
    x = jnp.arange(n ** 5).reshape((n,) * 5)
    cases = list(it.product(range(3), range(3), range(4)))

    def run(ops):
        def fn(v):
            return {f"split{s}_concat{c}_vmap{m}": jax.vmap(lambda a, s=s, c=c: ops.all_to_all(a, "i", s, c),
                                                            in_axes=m)(v) for s, c, m in cases}
        return pmap_like(fn, mesh)(x)

    parity(run)


@pytest.mark.slow  # pmap in vmap: each compiles several nested programs
def test_vmap_pmap_all_to_all_vs_vmap(backend):
    """testAllToAllVsVmap: all_to_all over a pmap's axis equals it over vmap(axis_name=) of the same axis."""
    mesh = pmesh(backend)
    n = mesh.size
    x = jnp.arange(n ** 4).reshape((n,) * 4)

    def run(ops):
        fns = {f"split{s}_concat{c}": lambda a, s=s, c=c: ops.all_to_all(a, "i", split_axis=s, concat_axis=c)
               for s, c in it.product(range(3), range(3))}
        return {"pmap": pmap_like(lambda v: {k: f(v) for k, f in fns.items()}, mesh)(x),
                "vmap": jax.vmap(lambda v: {k: f(v) for k, f in fns.items()}, axis_name="i")(x)}

    actual, _ = parity(run)
    assert_same(actual["pmap"], actual["vmap"])


@pytest.mark.parametrize("prim", ["all_gather", "psum_scatter"])
@pytest.mark.slow  # pmap in vmap: each compiles several nested programs
def test_vmap_pmap_with_vmap(backend, prim):
    """testWithVmap: map1(map2(prim over "i"), axis_name="i") for (vmap, pmap) and (pmap, vmap)."""
    x = jnp.ones((2, 2, 2, 64))
    xa = jnp.arange(2 * 2 * 2 * 64, dtype=jnp.float32).reshape(2, 2, 2, 64)

    def run(ops, map1, map2):
        f = nested_maps(backend, map1, map2, lambda v: getattr(ops, prim)(v, axis_name="i"), x.shape,
                        names=("i", None), check_vma=False)
        return {"ones": f(x), "arange": f(xa)}

    reduced = prim == "psum_scatter"
    vp = run(NX, "vmap", "pmap")
    assert_same(vp, run(LAX, "vmap", "pmap"), reduced)
    assert_same(run(NX, "pmap", "vmap"), run(LAX, "pmap", "vmap"), reduced)
    assert_same(vp, run(LAX, "pmap", "vmap"), reduced)


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
@pytest.mark.parametrize("prim", ["all_gather", "psum_scatter"])
@pytest.mark.slow  # pmap in vmap: each compiles several nested programs
def test_vmap_pmap_vs_vmap(backend, prim, tiled):
    """testVsVmap: vmap(f, axis_name="i") against pmap(f) of 4 members."""
    mesh = pmesh(backend, 4)
    x = jnp.arange(4 * 4 * 8).reshape(4, 4, 8)

    def run(ops):
        f = partial(getattr(ops, prim), axis_name="i", tiled=tiled)
        return {"vmap": jax.vmap(f, axis_name="i")(x), "pmap": pmap_like(f, mesh)(x)}

    actual, _ = parity(run, reduced=prim == "psum_scatter")
    assert_same(actual["vmap"], actual["pmap"], reduced=prim == "psum_scatter")


# ==============================================================================================================
# batching_test.py: collectives under jax.vmap(axis_name=...), no mesh

BULK = {"psum": np.sum, "pmax": np.max, "pmin": np.min}


@pytest.mark.parametrize("vmap_names", [("i",), ("i", "j"), ("i", "j", "k")], ids="".join)
@pytest.mark.parametrize("collective", BULK)
def test_vmap_comm_assoc_collective(one_device, collective, vmap_names):
    """testCommAssocCollective: every ordered subset of the vmapped names (in_axes = out_axes = the map's
    position), in one program; psum's gradient against jax.lax's, and check_grads on jax_ncclx's."""
    x = jnp.arange(8, dtype=jnp.float32).reshape(2, 2, 2)
    cases = [names for size in range(1, len(vmap_names) + 1) for subset in it.combinations(vmap_names, size)
             for names in it.permutations(subset)]

    def mapped(ops, names):
        f = lambda v: v - getattr(ops, collective)(v, names)  # noqa: E731
        for i, axis_name in enumerate(vmap_names):
            f = jax.vmap(f, axis_name=axis_name, in_axes=i, out_axes=i)
        return f

    with jax.default_device(one_device):
        def program(ops, v):
            out = {"".join(names): mapped(ops, names)(v) for names in cases}
            if collective == "psum":
                w = jnp.cos(v)
                out.update({"grad_" + "".join(names): jax.grad(lambda a, n=names: jnp.sum(w * mapped(ops, n)(a)))(v)
                            for names in cases})
            return out

        actual, _ = parity(lambda ops: jax.jit(partial(program, ops))(x), reduced=True)
        for names in cases:
            pos_axis = tuple(i for i, name in enumerate(vmap_names) if name in names)
            np.testing.assert_allclose(actual["".join(names)],
                                       x - BULK[collective](np.asarray(x), axis=pos_axis, keepdims=True))
        if collective == "psum":  # as JAX checks it, on the case of every name in reverse order
            jax.test_util.check_grads(jax.jit(mapped(NX, tuple(reversed(vmap_names)))), (x,), 2, eps=1)


def test_vmap_ppermute(one_device):
    """testPPermute: ten random permutations of 10 elements, as lists of NumPy (src, dst) rows."""
    nelem = 10
    x = np.arange(nelem)
    rng = np.random.RandomState(0)
    perms = []
    for _ in range(10):
        perm = np.arange(nelem)
        rng.shuffle(perm)
        pairs = np.stack([np.arange(nelem), perm], axis=-1)
        rng.shuffle(pairs)
        perms.append((perm, list(pairs)))
    with jax.default_device(one_device):
        actual, _ = parity(lambda ops: [jax.vmap(lambda v, p=p: v - ops.ppermute(v, "i", p), axis_name="i")(x)
                                        for _, p in perms])
    for (perm, _), got in zip(perms, actual):
        np.testing.assert_array_equal(got, x - x[np.argsort(perm)])


def test_vmap_all_to_all(one_device):
    """testAllToAll: vmap(all_to_all over the vmapped axis, in_axes=vmap_axis), split / concat in 0..2."""
    x = np.arange(4 ** 4).reshape(4, 4, 4, 4)
    cases = list(it.product(range(3), range(3), range(4)))

    def run(ops):
        return {f"split{s}_concat{c}_vmap{m}": jax.vmap(lambda v, s=s, c=c: ops.all_to_all(v, "i", s, c),
                                                        in_axes=m, axis_name="i")(x) for s, c, m in cases}

    with jax.default_device(one_device):
        actual, _ = parity(lambda ops: jax.jit(lambda: run(ops))())
    for s, c, m in cases:
        ref = np.moveaxis(x, (m, s + (m <= s)), (c + 1, 0))
        np.testing.assert_array_equal(actual[f"split{s}_concat{c}_vmap{m}"], ref)


@pytest.mark.parametrize("names", [("i", "j"), ("j", "i")], ids="".join)
def test_vmap_all_to_all_split_axis(one_device, names):
    """testAllToAllSplitAxis: all_to_all over two nested vmaps' axes taken together (no mesh), every
    split_axis, concat_axis in {0, 1} and vmap_axis in 0..2, in one program; ("j", "i") too, the inner axis
    major."""
    shape = (4, 4, 4)
    x = np.arange(math.prod(shape)).reshape(shape)
    cases = list(it.product(range(2), range(2), range(3)))

    def case(ops, split_axis, concat_axis, vmap_axis):
        unroll = list(shape)
        unroll[vmap_axis:vmap_axis + 1] = (2, 2)

        @partial(jax.vmap, in_axes=vmap_axis, axis_name="i")
        @partial(jax.vmap, in_axes=vmap_axis, axis_name="j")
        def f(v):
            return ops.all_to_all(v, names, split_axis, concat_axis)
        return f(x.reshape(unroll))

    def run(ops):
        return jax.jit(lambda: {f"split{s}_concat{c}_vmap{m}": case(ops, s, c, m) for s, c, m in cases})()

    with jax.default_device(one_device):
        actual, _ = parity(run)
    if names == ("i", "j"):
        for s, c, m in cases:
            split = s + 1 if m <= s else s
            ref = np.moveaxis(x, (m, split), (c + 1, 0))
            np.testing.assert_array_equal(np.asarray(actual[f"split{s}_concat{c}_vmap{m}"]).reshape(shape), ref)


def test_vmap_gather_cases(one_device):
    """testGradOfPsum, testAllGatherToUnmapped, testBatchedAllGather (both nestings), testAllGatherTiled,
    testBatchedAllGatherTiled, testAllGatherVjp, testAllGatherOfConst (a Python int) and
    testPpermuteBatcherTrivial."""
    x = jnp.arange(15).reshape((3, 5))
    x3 = jnp.arange(60).reshape((4, 3, 5))
    rng = np.random.RandomState(0)
    xv, y_bar = rng.randn(3, 4).astype(np.float32), rng.randn(3, 3, 4).astype(np.float32)

    def run(ops):
        gather = lambda v: ops.all_gather(v, axis_name="i")  # noqa: E731
        tiled = lambda v: ops.all_gather(v, axis_name="i", tiled=True)  # noqa: E731

        def of_const(v):
            return ops.all_gather(jnp.ones_like(v), axis_name="i"), ops.all_gather(1, axis_name="i")

        return {
            "grad_of_psum": jax.vmap(jax.grad(lambda v: -ops.psum(v, "i")), out_axes=None, axis_name="i")(jnp.ones(5)),
            "to_unmapped": jax.vmap(gather, axis_name="i", in_axes=1, out_axes=None)(x),
            "batched_ij": jax.vmap(jax.vmap(gather, axis_name="i", out_axes=None), axis_name="j")(x),
            "batched_ji": jax.vmap(jax.vmap(gather, axis_name="j"), axis_name="i", out_axes=None)(x),
            "tiled": jax.vmap(tiled, axis_name="i", in_axes=(1,), out_axes=None)(x3),
            "batched_tiled": jax.vmap(jax.vmap(tiled, in_axes=1, out_axes=1), axis_name="i", in_axes=1,
                                      out_axes=None)(x3),
            "vjp": jax.vmap(lambda a, yb: jax.vjp(gather, a)[1](yb), axis_name="i")(xv, y_bar),
            "of_const": jax.vmap(of_const, axis_name="i", in_axes=1, out_axes=None)(x),
            "ppermute_batcher_trivial": jax.vmap(jax.grad(lambda v: ops.ppermute(v, "i", [[0, 1], [1, 0]])),
                                                 axis_name="i")(jnp.array([1.0, 2.0])),
        }

    with jax.default_device(one_device):
        actual, _ = parity(run, reduced={"grad_of_psum", "vjp"})
    np.testing.assert_array_equal(actual["to_unmapped"], x.T)
    np.testing.assert_array_equal(actual["batched_ij"], x)
    np.testing.assert_array_equal(actual["batched_ji"], x.T)
    np.testing.assert_array_equal(actual["tiled"], np.asarray(x3).transpose((1, 0, 2)).reshape(-1, 5))
    np.testing.assert_allclose(actual["vjp"][0], np.sum(y_bar, axis=0), rtol=1e-5)
    np.testing.assert_array_equal(actual["of_const"][0], np.ones((5, 3), np.int32))
    np.testing.assert_array_equal(actual["of_const"][1], np.ones((5,), np.int32))
    np.testing.assert_array_equal(actual["ppermute_batcher_trivial"], np.ones(2, np.float32))


def test_vmap_reduce_scatter_autodiff(one_device):
    """testReduceScatterAutodiff: JVP and VJP against jax.lax's."""
    x = np.random.RandomState(0).randn(3, 3, 4).astype(np.float32)
    f_of = lambda ops: jax.vmap(partial(ops.psum_scatter, axis_name="i"), axis_name="i")  # noqa: E731
    with jax.default_device(one_device):
        parity(lambda ops: _jvp_vjp(f_of(ops), (x,)), reduced=True)
        jax.test_util.check_grads(jax.jit(f_of(NX)), (x,), 2, ["fwd", "rev"], 1e-2, 1e-2, eps=1.0)


# ==============================================================================================================
# ragged_collective_test.py

def ragged_model(operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes, groups=None):
    """jax.lax.ragged_all_to_all's docstring, run on NumPy: per member (axis index) m, slice i of
    ``operands[m]`` goes to the i // K-th member of m's group, and the receiver writes what it receives from
    its group's s-th member, slice j, at that sender's output_offsets, recv_sizes of its own long (the loop
    over i = s * K + j in order: later ones win). Returns (results, sources): sources[m][o] = (sender, row)
    of the row written at o, or None."""
    n = len(operands)
    groups = [list(range(n))] if groups is None else [list(g) for g in groups]
    results = [np.array(o, copy=True) for o in outputs]
    sources = [[None] * len(o) for o in outputs]
    for group in groups:
        k = len(input_offsets[group[0]]) // len(group)
        for d_pos, dst in enumerate(group):
            for i in range(len(group) * k):
                s_pos, j = divmod(i, k)
                src, sent = group[s_pos], d_pos * k + j
                start, size = int(input_offsets[src][sent]), int(send_sizes[src][sent])
                at, count = int(output_offsets[src][sent]), int(recv_sizes[dst][i])
                assert count <= size, "the model covers valid calls only: recv_sizes == the senders' send_sizes"
                for r in range(count):
                    results[dst][at + r] = operands[src][start + r]
                    sources[dst][at + r] = (src, start + r)
    return results, sources


def ragged_vjp_model(operands, outputs, sources, cotangents):
    """The VJP of the model: output's cotangent where nothing landed, each operand row the sum of the
    cotangents of the result rows it landed in."""
    d_operands = [np.zeros_like(np.asarray(o, np.float64)) for o in operands]
    d_outputs = [np.array(c, np.float64) for c in cotangents]
    for m, rows in enumerate(sources):
        for o, source in enumerate(rows):
            if source is not None:
                d_outputs[m][o] = 0
                d_operands[source[0]][source[1]] += cotangents[m][o]
    return d_operands, d_outputs


def ragged_program(ops, mesh, axis_name, *, groups=None, jit=True, check_vma=False):
    """ragged_collective_test's fwd: a shard_map over ``axis_name`` whose six arguments are [members, ...]
    sharded along it, each member's row its own argument; the result is [members * rows, ...]."""
    spec = P(axis_name, None)
    kwargs = {} if groups is None else {"axis_index_groups": groups}

    def fwd(*args):
        return ops.ragged_all_to_all(*(a.reshape(a.shape[1:]) for a in args), axis_name=axis_name, **kwargs)

    return smap(fwd, mesh, (spec,) * 6, P(axis_name), jit=jit, check_vma=check_vma)


def ragged_check(devices, ops_program, args, groups=None, expected_literal=None, reduced=False):
    """Runs jax_ncclx's program on ``args`` (per member, [members, ...]); compares with the NumPy model, with
    JAX's expected literal where given and, on GPUs, with jax.lax's result. Returns jax_ncclx's."""
    members = len(args[0])
    out = np.asarray(jax.block_until_ready(ops_program(NX)(*args))).reshape(np.shape(args[1]))
    model, _ = ragged_model(*[np.asarray(a) for a in args], groups=groups)
    assert_same(out, np.stack(model), reduced)
    if expected_literal is not None:
        np.testing.assert_array_equal(out, np.asarray(expected_literal).reshape(out.shape))
    if devices[0].platform == "gpu":
        lax_out = np.asarray(ops_program(LAX)(*args)).reshape(np.shape(args[1]))
        assert_same(out, lax_out, reduced)
    assert out.shape[0] == members
    return out


RAGGED_BASIC = (np.array([[1, 2, 2], [3, 4, 0]]), np.zeros((2, 4)), np.array([[0, 1], [0, 1]]),
                np.array([[1, 2], [1, 1]]), np.array([[0, 0], [1, 2]]), np.array([[1, 1], [2, 1]]))
RAGGED_BASIC_RESULT = [[1, 3, 0, 0], [2, 2, 4, 0]]


def _ragged_args(data, dtype, row_shape=()):
    """The six arguments as jnp arrays: operand and output in ``dtype`` with rows of ``row_shape`` (each
    value v as a row of v + its position), the offsets and sizes int32."""
    operand, output = (np.asarray(a).astype(np.float32) for a in data[:2])
    if row_shape:
        pattern = np.arange(math.prod(row_shape), dtype=np.float32).reshape(row_shape) / 8
        operand = operand[..., None, None] + pattern * (operand[..., None, None] != 0)
        output = output[..., None, None] + np.zeros(row_shape, np.float32)
    return (jnp.asarray(operand.astype(dtype)), jnp.asarray(output.astype(dtype)),
            *(jnp.asarray(a, jnp.int32) for a in data[2:]))


@pytest.mark.parametrize("dtype,jit,row_shape", [
    (np.int32, True, ()), (np.float32, True, ()), (np.float32, True, (2, 3)),
    (jnp.bfloat16, True, (2, 3)), (np.int8, True, ()), (np.bool_, True, (2, 3))],
    ids=["int32", "float32", "float32-rows_2x3", "bfloat16-rows_2x3", "int8", "bool-rows_2x3"])
def test_ragged_all_to_all(backend, dtype, jit, row_shape):
    """test_ragged_all_to_all (its int32 operand, and other dtypes and row shapes, jit or not)."""
    mesh = mesh_of(backend, (2,), ("x",))
    args = _ragged_args(RAGGED_BASIC, dtype, row_shape)
    literal = RAGGED_BASIC_RESULT if row_shape == () and dtype != np.bool_ else None
    ragged_check(backend, lambda ops: ragged_program(ops, mesh, "x", jit=jit), args, expected_literal=literal)


def test_ragged_all_to_all_grad(backend):
    """test_ragged_all_to_all_grad: check_grads (order 1) in operand and output, and the VJP against the
    model's (and jax.lax's, on GPUs)."""
    mesh = mesh_of(backend, (2,), ("x",))
    operand, output, *rest = _ragged_args(RAGGED_BASIC, np.float32)
    fwd = ragged_program(NX, mesh, "x")
    jax.test_util.check_grads(lambda op, out: fwd(op, out, *rest), (operand, output), order=1)
    cotangent = np.sin(np.arange(8, dtype=np.float32)).reshape(2, 4)
    _, vjp = jax.vjp(lambda op, out: fwd(op, out, *rest).reshape(2, 4), operand, output)
    d_operand, d_output = vjp(jnp.asarray(cotangent))
    _, sources = ragged_model(*[np.asarray(a) for a in (operand, output, *rest)])
    m_operand, m_output = ragged_vjp_model(np.asarray(operand), np.asarray(output), sources, cotangent)
    np.testing.assert_allclose(d_operand, np.stack(m_operand), rtol=1e-6)
    np.testing.assert_allclose(d_output, np.stack(m_output), rtol=1e-6)
    if backend[0].platform == "gpu":
        lax_fwd = ragged_program(LAX, mesh, "x")
        lax_vjp = jax.vjp(lambda op, out: lax_fwd(op, out, *rest).reshape(2, 4), operand, output)[1]
        assert_same((d_operand, d_output), lax_vjp(jnp.asarray(cotangent)), reduced=True)


def test_ragged_all_to_all_axis_index_groups(backend):
    mesh = mesh_of(backend, (4,), ("x",))
    data = (np.array([[1, 2, 2], [3, 4, 0], [10, 20, 20], [30, 40, 0]]), np.zeros((4, 4)),
            np.array([[0, 1]] * 4), np.array([[1, 2], [1, 1]] * 2), np.array([[0, 0], [1, 2]] * 2),
            np.array([[1, 1], [2, 1]] * 2))
    groups = ((0, 1), (2, 3))
    ragged_check(backend, lambda ops: ragged_program(ops, mesh, "x", groups=groups), _ragged_args(data, np.int32),
                 groups=groups, expected_literal=[[1, 3, 0, 0], [2, 2, 4, 0], [10, 30, 0, 0], [20, 20, 40, 0]])


def test_ragged_all_to_all_degenerate_groups(backend):
    mesh = mesh_of(backend, (2,), ("x",))
    data = (np.array([[1, 0, 0, 0], [2, 3, 4, 0]]), np.zeros((2, 4)), np.array([[0], [0]]), np.array([[1], [3]]),
            np.array([[2], [1]]), np.array([[1], [3]]))
    groups = ((0,), (1,))
    ragged_check(backend, lambda ops: ragged_program(ops, mesh, "x", groups=groups), _ragged_args(data, np.int32),
                 groups=groups, expected_literal=[[0, 0, 1, 0], [0, 2, 3, 4]])


def test_ragged_all_to_all_overlapping_input_slices(backend):
    """Slices that overlap in the operand (to different peers, and two to one peer from one row): each sends
    its own rows, as the docstring's SEND loop reads them."""
    mesh = mesh_of(backend, (4,), ("x",))
    n, k = 4, 2
    operand = np.arange(1, 4 * 6 + 1).reshape(4, 6)
    output = -np.ones((4, 16))
    input_offsets = np.array([[0, 1] * n, [2, 2] * n, [1, 0, 3, 3, 0, 1, 2, 2], [4, 0] * n])
    send_sizes = np.array([[2, 1] * n, [1, 2] * n, [1, 2, 2, 1, 1, 1, 2, 1], [2, 2] * n])
    recv_sizes = np.array([[send_sizes[s][d * k + j] for s in range(n) for j in range(k)] for d in range(n)])
    output_offsets = np.zeros((n, n * k), np.int64)
    for d in range(n):  # each receiver's incoming slices end to end, in source order
        cursor = 0
        for s in range(n):
            for j in range(k):
                output_offsets[s][d * k + j] = cursor
                cursor += recv_sizes[d][s * k + j]
    args = _ragged_args((operand, output, input_offsets, send_sizes, output_offsets, recv_sizes), np.int32)
    ragged_check(backend, lambda ops: ragged_program(ops, mesh, "x"), args)


def test_ragged_all_to_all_vmap_multi_dim_operand(backend):
    mesh = mesh_of(backend, (2,), ("x",))
    shapes = [(2, 2, 3), (2, 2, 4)] + [(2, 2, 2)] * 4
    args = [jnp.zeros(s, jnp.int32) for s in shapes]
    args = [put(a, mesh, P("x", None, None)) for a in args]

    def run(ops):
        fwd = ragged_program(ops, mesh, "x", jit=False)
        return jax.jit(jax.vmap(fwd, in_axes=0, out_axes=0))(*args)

    res = run(NX)
    fwd = ragged_program(NX, mesh, "x")
    assert_same(res, jnp.stack(list(map(fwd, *args))))
    model = [np.stack(ragged_model(*[np.asarray(a)[b] for a in args])[0]).reshape(-1) for b in range(2)]
    assert_same(res, np.stack(model))
    if backend[0].platform == "gpu":
        assert_same(res, run(LAX))


RAGGED_VMAP_CONFIGS = {
    0: (np.array([[[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]]]), np.array([[[1, 2], [1, 1]], [[1, 2], [1, 1]]]),
        np.array([[[0, 0], [1, 2]], [[0, 0], [1, 2]]]), np.array([[[1, 1], [2, 1]], [[1, 1], [2, 1]]])),
    1: (np.array([[[1, 2, 3], [1, 2, 3]], [[4, 5, 6], [4, 5, 6]]]), np.array([[[1, 2], [1, 2]], [[1, 1], [1, 1]]]),
        np.array([[[0, 0], [0, 0]], [[1, 2], [1, 2]]]), np.array([[[1, 1], [1, 1]], [[2, 1], [2, 1]]])),
}


@pytest.mark.parametrize("vmap_batch_axis,data_shard_axis,input_config", [(0, 0, 0), (0, 1, 0), (1, 0, 1), (1, 1, 1)],
                         ids=["batch_0_data_shard_axis_0_input_0", "batch_0_data_shard_axis_1_input_0",
                              "batch_1_data_shard_axis_0_input_1", "batch_1_data_shard_axis_1_input_1"])
def test_ragged_all_to_all_vmap(backend, vmap_batch_axis, data_shard_axis, input_config):
    mesh = mesh_of(backend, (2, 2), ("x", "y"))
    sharding = P("x", None, None) if data_shard_axis == 0 else P(None, "x", None)
    operand, send_sizes, output_offsets, recv_sizes = RAGGED_VMAP_CONFIGS[input_config]
    input_offsets = np.array([[[0, 1], [0, 1]], [[0, 1], [0, 1]]])
    data = [operand, np.zeros((2, 2, 4)), input_offsets, send_sizes, output_offsets, recv_sizes]
    args = [put(jnp.asarray(a, jnp.int32), mesh, sharding) for a in data]

    def run(ops):
        fwd = ragged_program(ops, mesh, "x", jit=False)
        return jax.jit(jax.vmap(fwd, in_axes=vmap_batch_axis, out_axes=0))(*args)

    res = run(NX)
    fwd = ragged_program(NX, mesh, "x")
    slices = lambda b: [jax.lax.index_in_dim(a, b, vmap_batch_axis, False) for a in args]  # noqa: E731
    assert_same(res, jnp.stack([fwd(*slices(b)) for b in range(2)]))
    model = [np.stack(ragged_model(*[np.asarray(a) for a in slices(b)])[0]).reshape(-1) for b in range(2)]
    assert_same(res, np.stack(model))
    if backend[0].platform == "gpu":
        assert_same(res, run(LAX))


def test_ragged_all_to_all_vmap_unsupported_axis_index_groups(backend):
    """jax.lax raises NotImplementedError for axis_index_groups under vmap(axis_name="b"). jax_ncclx computes
    the call instead: checked against its unbatched calls and the model (JAX's zeros, and a valid call)."""
    mesh = mesh_of(backend, (2,), ("x",))
    shapes = [(2, 2, 3), (2, 2, 4)] + [(2, 2, 2)] * 4
    zeros = [put(jnp.zeros(s, jnp.int32), mesh, P("x", None, None)) for s in shapes]
    basic = [put(jnp.stack([a, a]), mesh, P("x", None, None)) for a in _ragged_args(RAGGED_BASIC, np.int32)]

    def run(ops, args):
        fwd = ragged_program(ops, mesh, "x", groups=[[0, 1]], jit=False)
        return jax.jit(jax.vmap(fwd, in_axes=0, out_axes=0, axis_name="b"))(*args)

    with pytest.raises(NotImplementedError):
        run(LAX, zeros)
    fwd = ragged_program(NX, mesh, "x", groups=[[0, 1]])
    for args in (zeros, basic):
        res = run(NX, args)
        assert_same(res, jnp.stack([fwd(*[a[b] for a in args]) for b in range(2)]))
        model = [np.stack(ragged_model(*[np.asarray(a)[b] for a in args])[0]).reshape(-1) for b in range(2)]
        assert_same(res, np.stack(model))


RAGGED_ERRORS = {f"{name}_{what}": (name, bad) for name in ("input_offsets", "send_sizes", "output_offsets",
                                                              "recv_sizes")
                 for what, bad in (("float", np.array([0.0, 1.0, 3.0], np.float32)),
                                   ("rank_2", np.array([[0, 1, 3]], np.int32)),
                                   ("empty", np.array([], np.int32)))}


@pytest.mark.parametrize("case", RAGGED_ERRORS)
def test_ragged_all_to_all_errors(backend, case):
    """test_ragged_all_to_all_errors: jax.lax raises ValueError for float, rank-2 and empty offsets / sizes;
    jax_ncclx must raise the same type (traced inside a shard_map over one member, so both see a bound axis)."""
    mesh = mesh_of(backend, (1,), ("x",))
    name, bad = RAGGED_ERRORS[case]
    args = dict(operand=jnp.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), output=jnp.zeros(7),
                input_offsets=jnp.array([0, 1, 3]), send_sizes=jnp.array([1, 2, 3]),
                output_offsets=jnp.array([0, 1, 3]), recv_sizes=jnp.array([1, 2, 3]))
    args[name] = jnp.asarray(bad)

    def run(ops):
        f = jax.shard_map(lambda: ops.ragged_all_to_all(**args, axis_name="x"), mesh=mesh, in_specs=(),
                          out_specs=P(), check_vma=False)
        return jax.eval_shape(f)

    same_error(run)


def test_ragged_vmap_basic(backend):
    """test_vmap_basic: an expert x pipeline mesh; the call alone, then vmapped over a batch sharded over
    "pipeline"."""
    n = 8 if len(backend) >= 8 else len(backend)
    if n not in (4, 8):
        pytest.skip("needs 4 or 8 devices")
    ep, pp = 2, n // 2
    mesh = mesh_of(backend, (ep, pp), ("expert", "pipeline"))
    spec = P("expert", None)
    batch, model = 2 * ep ** 2, 3

    def wrapper_of(ops):
        def ra2a(x, output, input_offsets, send_sizes, output_offsets, recv_sizes):
            squeeze = lambda a: a.reshape(a.shape[1:])  # noqa: E731
            return ops.ragged_all_to_all(x, output, squeeze(input_offsets), squeeze(send_sizes),
                                         squeeze(output_offsets), squeeze(recv_sizes), axis_name="expert")
        return jax.shard_map(ra2a, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec, check_vma=False)

    x = put(jnp.tile(jnp.arange(0.0, batch)[:, None], (1, model)), mesh, spec)
    meta = [put(jnp.array(v, jnp.int32), mesh, spec) for v in
            ([[0, 2], [0, 2]], [[2, 2], [2, 2]], [[0, 0], [2, 2]], [[2, 2], [2, 2]])]
    expected = np.array([[0] * 3, [1] * 3, [4] * 3, [5] * 3, [2] * 3, [3] * 3, [6] * 3, [7] * 3], np.float32)
    out = jax.jit(wrapper_of(NX))(x, x.copy(), *meta)
    assert out.shape == (batch, model)
    np.testing.assert_array_equal(out, expected)

    vmap_sharding = NamedSharding(mesh, P("pipeline", "expert", None))
    expand = lambda a: jax.device_put(jnp.tile(a[None], (pp, 1, 1)), vmap_sharding)  # noqa: E731
    vout = jax.jit(jax.vmap(wrapper_of(NX)))(expand(x), expand(x), *map(expand, meta))
    assert vout.shape == (pp, batch, model)
    for i in range(pp):
        np.testing.assert_array_equal(vout[i], expected)
    if backend[0].platform == "gpu":
        assert_same(vout, jax.jit(jax.vmap(wrapper_of(LAX)))(expand(x), expand(x), *map(expand, meta)))
