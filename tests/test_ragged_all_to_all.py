"""jax_ncclx.ragged_all_to_all against the NumPy reference of jax.lax.ragged_all_to_all's description (and,
on GPUs, against jax.lax.ragged_all_to_all itself): random valid calls with several slices per peer, calls
the jax.lax contract leaves undefined (memory safe, as documented), small capacities, dtypes and row
shapes, grad, vmap, global view and bad arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ncclx as nx
import reference
from conftest import gpu_devices, gpu_skip_reason
from helpers import assert_bits_equal, random_array

OPERAND_ROWS, OUTPUT_ROWS = 24, 40


def valid_call(n, slices, seed, operand_rows=OPERAND_ROWS, output_rows=OUTPUT_ROWS):
    """Per-member arguments of a call jax.lax defines: disjoint slices of the operand in a random order with
    gaps, and each receiver's incoming slices laid out in a random order with gaps."""
    rng = np.random.default_rng(seed)
    total = n * slices
    sizes = [rng.multinomial(operand_rows // 2, np.ones(total) / total) for _ in range(n)]
    input_offsets = []
    for m in range(n):  # slices in a random order through the operand, a random gap before each
        order, offsets, cursor = rng.permutation(total), np.zeros(total, np.int64), 0
        gaps = rng.multinomial(operand_rows - sizes[m].sum(), np.ones(total + 1) / (total + 1))
        for g, i in zip(gaps, order):
            cursor += g
            offsets[i] = cursor
            cursor += sizes[m][i]
        input_offsets.append(offsets)
    recv_sizes = [np.array([sizes[src][me * slices + k] for src in range(n) for k in range(slices)])
                  for me in range(n)]
    output_offsets = [np.zeros(total, np.int64) for _ in range(n)]
    for me in range(n):  # where each incoming slice lands on `me`
        incoming = recv_sizes[me]
        assert incoming.sum() <= output_rows
        gaps = rng.multinomial(output_rows - incoming.sum(), np.ones(total + 1) / (total + 1))
        cursor = 0
        for g, back in zip(gaps, rng.permutation(total)):
            cursor += g
            src, k = divmod(back, slices)
            output_offsets[src][me * slices + k] = cursor
            cursor += incoming[back]
    return [np.stack(a).astype(np.int32) for a in (input_offsets, sizes, output_offsets, recv_sizes)]


def undefined_call(n, slices, seed):
    """Sizes and offsets jax.lax leaves undefined: negative, past the operand, past the result, recv_sizes
    that disagree with the senders, overlapping slices."""
    rng = np.random.default_rng(seed)
    shape = (n, n * slices)
    return [rng.integers(-6, OPERAND_ROWS + 6, size=shape).astype(np.int32),
            rng.integers(-3, 12, size=shape).astype(np.int32),
            rng.integers(-6, OUTPUT_ROWS + 6, size=shape).astype(np.int32),
            rng.integers(-3, 12, size=shape).astype(np.int32)]


def line(backend):
    return jax.sharding.Mesh(np.asarray(backend), ("x",))


def per_member(mesh, fn, n_in):
    spec = P("x")
    return jax.jit(jax.shard_map(lambda *a: fn(*(v[0] for v in a))[None], mesh=mesh, in_specs=(spec,) * n_in,
                                 out_specs=spec))


def ragged(mesh, capacity=None):
    return per_member(mesh, lambda *a: nx.ragged_all_to_all(*a, axis_name="x", max_recv_per_peer=capacity), 6)


def inputs(n, dtype, row_shape, seed):
    return (random_array((n, OPERAND_ROWS, *row_shape), dtype, seed),
            random_array((n, OUTPUT_ROWS, *row_shape), dtype, seed + 1))


def check(mesh, operands, outputs, sizes_and_offsets, capacity=None):
    got = np.asarray(ragged(mesh, capacity)(operands, outputs, *sizes_and_offsets))
    expected, _ = reference.ragged_all_to_all(operands, outputs, *sizes_and_offsets,
                                              capacity=OUTPUT_ROWS if capacity is None else capacity)
    for me in range(len(operands)):
        assert_bits_equal(got[me], expected[me])


@pytest.mark.parametrize("slices", [1, 3])
@pytest.mark.parametrize("dtype,row_shape", [(jnp.float32, (5,)), (jnp.bfloat16, (2, 3)), (jnp.int8, (7,)),
                                             (jnp.float32, ()), (jnp.complex64, (3,)), (jnp.bool_, (4,))])
def test_valid_calls_match_the_reference(backend, slices, dtype, row_shape):
    mesh, n = line(backend), len(backend)
    for seed in range(3):
        check(mesh, *inputs(n, dtype, row_shape, seed), valid_call(n, slices, seed))


@pytest.mark.parametrize("slices", [1, 2])
def test_undefined_calls_are_memory_safe_and_as_documented(backend, slices):
    mesh, n = line(backend), len(backend)
    for seed in range(4):
        check(mesh, *inputs(n, jnp.float32, (3,), seed), undefined_call(n, slices, seed))


@pytest.mark.parametrize("capacity", [0, 1, 4])
def test_rows_past_the_capacity_are_not_written(backend, capacity):
    mesh, n = line(backend), len(backend)
    check(mesh, *inputs(n, jnp.float32, (3,), 7), valid_call(n, 2, 7), capacity=capacity)


def test_overlapping_landings_keep_the_later_slice(backend):
    """Every slice of every member lands at row 0 of its receiver: the last source's last slice wins."""
    mesh, n = line(backend), len(backend)
    operands, outputs = inputs(n, jnp.float32, (2,), 3)
    sizes = np.full((n, 2 * n), 2, np.int32)
    offsets = np.tile(np.arange(0, 4 * n, 2, dtype=np.int32), (n, 1))
    check(mesh, operands, outputs, [offsets, sizes, np.zeros_like(sizes), sizes])


def test_grad_flows_to_the_landed_operand_rows_and_the_kept_output_rows(backend):
    mesh, n = line(backend), len(backend)
    operands, outputs = inputs(n, jnp.float32, (3,), 11)
    call = valid_call(n, 2, 11)
    weights = random_array((n, OUTPUT_ROWS, 3), jnp.float32, 12)

    def loss(operand, output, *rest):
        result = nx.ragged_all_to_all(operand, output, *rest[:4], axis_name="x")
        return jax.lax.psum(jnp.sum(result * rest[4]), "x")

    spec = P("x")
    grads = jax.jit(jax.shard_map(
        lambda *a: [g[None] for g in jax.grad(loss, argnums=(0, 1))(*(v[0] for v in a))], mesh=mesh,
        in_specs=(spec,) * 7, out_specs=spec))(operands, outputs, *call, weights)
    _, sources = reference.ragged_all_to_all(operands, outputs, *call, capacity=OUTPUT_ROWS)
    want_operand, want_output = np.zeros_like(operands), np.array(weights)
    for me, source in enumerate(sources):
        for o, landed in enumerate(source):
            if landed is not None:
                want_output[me, o] = 0
                want_operand[landed] += weights[me, o]
    np.testing.assert_allclose(np.asarray(grads[0]), want_operand, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads[1]), want_output, rtol=1e-6)


def test_vmap_over_a_batch_axis(backend):
    mesh, n = line(backend), len(backend)
    batch = [inputs(n, jnp.float32, (3,), seed) + tuple(valid_call(n, 2, seed)) for seed in (20, 21)]
    stacked = [np.stack(parts, axis=1) for parts in zip(*batch)]  # [N, batch, ...]
    vmapped = per_member(mesh, jax.vmap(lambda *a: nx.ragged_all_to_all(*a, axis_name="x")), 6)
    got = np.asarray(vmapped(*stacked))
    for b, args in enumerate(batch):
        expected, _ = reference.ragged_all_to_all(*args, capacity=OUTPUT_ROWS)
        for me in range(n):
            assert_bits_equal(got[me, b], expected[me])


def test_vmap_over_its_own_axis():
    """Every member on one device (jax.vmap(axis_name=...)): the exchanges become gathers."""
    n = 4
    operands, outputs = inputs(n, jnp.float32, (3,), 40)
    call = valid_call(n, 2, 40)
    got = jax.jit(jax.vmap(lambda *a: nx.ragged_all_to_all(*a, axis_name="m"), axis_name="m"))(
        operands, outputs, *call)
    expected, _ = reference.ragged_all_to_all(operands, outputs, *call, capacity=OUTPUT_ROWS)
    for me in range(n):
        assert_bits_equal(np.asarray(got[me]), expected[me])


def test_global_view_outside_shard_map(backend):
    mesh, n = line(backend), len(backend)
    operands, outputs = inputs(n, jnp.float32, (3,), 30)
    call = valid_call(n, 1, 30)
    put = lambda a: jax.device_put(np.concatenate(list(a)), NamedSharding(mesh, P("x")))  # noqa: E731
    with jax.set_mesh(mesh):  # on GPU the communicators need the mesh's concrete devices at compile time
        got = jax.jit(lambda *a: nx.ragged_all_to_all(*a, axis_name="x"))(*map(put, (operands, outputs, *call)))
    expected, _ = reference.ragged_all_to_all(operands, outputs, *call, capacity=OUTPUT_ROWS)
    assert_bits_equal(np.asarray(got), np.concatenate(expected))


@pytest.mark.gpu
def test_matches_lax_ragged_all_to_all_on_gpus():
    """All GPUs, or the one GPU of a machine with one (an axis of one member: every slice goes to itself)."""
    reason = gpu_skip_reason(minimum=1)
    if reason:
        pytest.skip(reason)
    mesh, n = line(gpu_devices()), len(gpu_devices())
    lax_ragged = per_member(mesh, lambda *a: jax.lax.ragged_all_to_all(*a, axis_name="x"), 6)
    for seed, slices in ((0, 1), (1, 3)):
        args = (*inputs(n, jnp.bfloat16, (16,), seed), *valid_call(n, slices, seed))
        assert_bits_equal(np.asarray(ragged(mesh)(*args)), np.asarray(lax_ragged(*args)))


@pytest.mark.parametrize("change,error,match", [
    (dict(output=np.zeros((OUTPUT_ROWS, 4), np.float32)), ValueError, "same trailing shape and dtype"),
    (dict(output=np.zeros((OUTPUT_ROWS, 3), np.int32)), ValueError, "same trailing shape and dtype"),
    (dict(send_sizes=np.zeros(3, np.int32)), ValueError, "one length, a multiple of N"),
    (dict(recv_sizes=np.zeros(0, np.int32)), ValueError, "one length, a multiple of N"),
    (dict(input_offsets=np.zeros(2, np.float32)), TypeError, "input_offsets must be a 1-D integer array"),
    (dict(output_offsets=np.zeros((2, 1), np.int32)), TypeError, "output_offsets must be a 1-D integer array"),
    (dict(max_recv_per_peer=-1), ValueError, "max_recv_per_peer must be >= 0"),
    (dict(max_recv_per_peer=2.0), TypeError, "max_recv_per_peer must be a static Python int"),
    (dict(axis_index_groups=[[0, 1]]), NotImplementedError, "axis_index_groups is not supported"),
])
def test_bad_arguments_are_refused(change, error, match):
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:2]), ("x",))
    args = dict(operand=np.zeros((OPERAND_ROWS, 3), np.float32), output=np.zeros((OUTPUT_ROWS, 3), np.float32),
                input_offsets=np.zeros(2, np.int32), send_sizes=np.zeros(2, np.int32),
                output_offsets=np.zeros(2, np.int32), recv_sizes=np.zeros(2, np.int32), max_recv_per_peer=None,
                axis_index_groups=None)
    args.update(change)
    static = dict(max_recv_per_peer=args.pop("max_recv_per_peer"), axis_index_groups=args.pop("axis_index_groups"))
    fn = jax.shard_map(lambda *a: nx.ragged_all_to_all(*a, axis_name="x", **static),
                       mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    with pytest.raises(error, match=match):
        jax.eval_shape(fn, *args.values())
