"""jax_ncclx.ragged_all_to_all against a NumPy reference of jax.lax.ragged_all_to_all's description (and,
on GPUs, against jax.lax.ragged_all_to_all itself): random valid calls with several slices per peer, slices
that overlap in the operand (to several peers and within one), calls the jax.lax contract leaves undefined
(memory safe, as documented), small capacities, dtypes and row shapes, grad, vmap, global view and bad
arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ncclx as nx
from conftest import NUM_CPU_DEVICES, gpu_devices, gpu_skip_reason
from helpers import assert_bits_equal, drop_warnings, random_array

OPERAND_ROWS, OUTPUT_ROWS = 24, 40


@pytest.fixture
def backend(any_backend):
    """One GPU is enough: on an axis of one member every slice goes to the member itself, through the same
    exchange, place table and aliased output."""
    return any_backend


def lax_reference(operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes, capacity):
    """jax.lax.ragged_all_to_all's description, slice by slice (slices may overlap in the operand), with
    jax_ncclx's rules where it leaves a call undefined: a negative size sends nothing, a peer takes at most
    ``capacity`` rows from a member (its slices walked in order and cut there), rows read outside the operand
    are zeros, a slice writes min(recv_sizes, rows sent) rows and none outside the result, later slices win.
    Per member: (result, source), source[o] = (member, operand row) of the row written at o (a row outside
    the operand wrote zeros), or None where nothing was written."""
    n = len(operands)
    slices = len(send_sizes[0]) // n
    sent = []  # sent[src][i]: the operand rows of slice i
    for src in range(n):
        sizes = np.maximum(np.asarray(send_sizes[src], np.int64), 0).reshape(n, slices)
        rows = []
        for peer in range(n):
            room = capacity
            for k in range(slices):
                taken = min(int(sizes[peer, k]), room)
                room -= taken
                rows.append([int(input_offsets[src][peer * slices + k]) + r for r in range(taken)])
        sent.append(rows)
    results, sources = [], []
    for me in range(n):
        result, source = np.array(outputs[me]), [None] * len(outputs[me])
        for src in range(n):
            for k in range(slices):
                i, back = me * slices + k, src * slices + k
                for r, row in enumerate(sent[src][i][: max(int(recv_sizes[me][back]), 0)]):
                    o = int(output_offsets[src][i]) + r
                    if 0 <= o < len(result):
                        result[o] = operands[src][row] if 0 <= row < len(operands[src]) else 0
                        source[o] = (src, row)
        results.append(result)
        sources.append(source)
    return results, sources


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
    return landed_call(rng, slices, input_offsets, sizes, output_rows)


def overlapping_call(n, slices, seed, same_rows_to_every_peer, operand_rows=OPERAND_ROWS):
    """Per-member arguments of a call jax.lax defines whose slices overlap in the operand: with
    ``same_rows_to_every_peer``, slice k to every peer is one range (a decode step's combine); else the K
    slices to one peer all start at one row (a random one per peer), 1 to 5 - K + 1 rows each. Each member
    sends at most 5 rows per peer, so 8 members' slices fit in any result."""
    rng = np.random.default_rng(seed)
    input_offsets, sizes = [], []
    for _ in range(n):
        if same_rows_to_every_peer:
            own = rng.multinomial(rng.integers(4, 6), np.ones(slices) / slices)  # 8 peers: past X in all
            starts = [rng.integers(0, operand_rows - size + 1) for size in own]
            sizes.append(np.tile(own, n))
            input_offsets.append(np.tile(starts, n))
        else:
            assert slices <= 5
            sizes.append(np.concatenate([1 + rng.multinomial(rng.integers(0, 6 - slices), np.ones(slices) / slices)
                                         for _ in range(n)]))
            input_offsets.append(np.repeat(rng.integers(0, operand_rows - 5, size=n), slices))
    return landed_call(rng, slices, input_offsets, sizes, OUTPUT_ROWS)


def landed_call(rng, slices, input_offsets, sizes, output_rows):
    """The senders' slices (per member: offsets and sizes ``[N * K]``) completed by the receivers' side: each
    receiver's incoming slices laid out in a random order with gaps."""
    n = len(sizes)
    total = n * slices
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
    expected, _ = lax_reference(operands, outputs, *sizes_and_offsets,
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


OVERLAPS = [pytest.param(1, True, id="same_rows_to_every_peer-1"),
            pytest.param(3, True, id="same_rows_to_every_peer-3"),
            pytest.param(2, False, id="within_a_peer-2"), pytest.param(3, False, id="within_a_peer-3")]


@pytest.mark.parametrize("slices,same_rows_to_every_peer", OVERLAPS)
def test_slices_overlapping_in_the_operand_match_the_reference(backend, slices, same_rows_to_every_peer):
    """Slices that overlap in the operand each send their rows, even where they add up to more than X."""
    mesh, n = line(backend), len(backend)
    for seed in range(3):
        call = overlapping_call(n, slices, seed, same_rows_to_every_peer)
        if same_rows_to_every_peer and n == 8:
            assert call[1].sum(axis=1).max() > OPERAND_ROWS  # the case a cut at X rows in all would get wrong
        check(mesh, *inputs(n, jnp.float32, (3,), seed), call)


@pytest.mark.parametrize("slices", [1, 2])
def test_undefined_calls_are_memory_safe_and_as_documented(backend, slices):
    mesh, n = line(backend), len(backend)
    for seed in range(4):
        check(mesh, *inputs(n, jnp.float32, (3,), seed), undefined_call(n, slices, seed))


@pytest.mark.parametrize("overlapping", [False, True], ids=["disjoint", "overlapping"])
@pytest.mark.parametrize("capacity", [0, 1, 4])
def test_rows_past_the_capacity_are_not_written(backend, capacity, overlapping):
    mesh, n = line(backend), len(backend)
    call = overlapping_call(n, 2, 7, False) if overlapping else valid_call(n, 2, 7)
    check(mesh, *inputs(n, jnp.float32, (3,), 7), call, capacity=capacity)


def test_warn_drops_names_the_member(monkeypatch, caplog):
    """JAX_NCCLX_WARN_DROPS=1 logs the rows each member dropped past max_recv_per_peer, per destination; none
    when nothing drops or when the variable is unset."""
    mesh = line(jax.devices("cpu")[:2])
    sizes = np.asarray([[3, 1], [0, 2]], np.int32)  # member 0 sends 3 rows to 0 and 1 to 1; member 1 2 to 1
    zeros = np.zeros((2, 2), np.int32)
    args = (jnp.ones((2, 4, 3)), jnp.zeros((2, 4, 3)), zeros, sizes, zeros, sizes.T.copy())

    def run(drops):
        jax.block_until_ready(ragged(mesh, 1 if drops else 3)(*args))
        jax.effects_barrier()

    messages = drop_warnings(monkeypatch, caplog, run)
    assert messages == [
        "jax_ncclx.ragged_all_to_all: member 0 dropped 2 rows past capacity 1 (max_recv_per_peer); per destination "
        "member: [2, 0]",
        "jax_ncclx.ragged_all_to_all: member 1 dropped 1 rows past capacity 1 (max_recv_per_peer); per destination "
        "member: [0, 1]"], messages


def test_overlapping_landings_keep_the_later_slice(backend):
    """Every slice of every member lands at row 0 of its receiver: the last source's last slice wins."""
    mesh, n = line(backend), len(backend)
    operands, outputs = inputs(n, jnp.float32, (2,), 3)
    sizes = np.full((n, 2 * n), 2, np.int32)
    offsets = np.tile(np.arange(0, 4 * n, 2, dtype=np.int32), (n, 1))
    check(mesh, operands, outputs, [offsets, sizes, np.zeros_like(sizes), sizes])


@pytest.mark.parametrize("overlapping", [False, True], ids=["disjoint", "same_rows_to_every_peer"])
def test_grad_flows_to_the_landed_operand_rows_and_the_kept_output_rows(backend, overlapping):
    """An operand row sent in several slices gets the sum of their cotangents."""
    mesh, n = line(backend), len(backend)
    operands, outputs = inputs(n, jnp.float32, (3,), 11)
    call = overlapping_call(n, 2, 11, True) if overlapping else valid_call(n, 2, 11)
    weights = random_array((n, OUTPUT_ROWS, 3), jnp.float32, 12)

    def loss(operand, output, *rest):
        result = nx.ragged_all_to_all(operand, output, *rest[:4], axis_name="x")
        return jax.lax.psum(jnp.sum(result * rest[4]), "x")

    spec = P("x")
    grads = jax.jit(jax.shard_map(
        lambda *a: [g[None] for g in jax.grad(loss, argnums=(0, 1))(*(v[0] for v in a))], mesh=mesh,
        in_specs=(spec,) * 7, out_specs=spec))(operands, outputs, *call, weights)
    _, sources = lax_reference(operands, outputs, *call, capacity=OUTPUT_ROWS)
    want_operand, want_output = np.zeros_like(operands), np.array(weights)
    for me, source in enumerate(sources):
        for o, landed in enumerate(source):
            if landed is not None:
                want_output[me, o] = 0
                want_operand[landed] += weights[me, o]
    np.testing.assert_allclose(np.asarray(grads[0]), want_operand, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads[1]), want_output, rtol=1e-6)


@pytest.mark.parametrize("overlapping", [False, True], ids=["disjoint", "same_rows_to_every_peer"])
def test_jvp_and_vjp_agree(backend, overlapping):
    """Forward and reverse mode of the linear map (operand, output) -> result: the JVP is the map of the
    tangents, and <vjp(w), t> == <w, jvp(t)> for every member."""
    mesh, n = line(backend), len(backend)
    operands, outputs = inputs(n, jnp.float32, (3,), 50)
    call = overlapping_call(n, 2, 50, True) if overlapping else valid_call(n, 2, 50)
    t_operands, t_outputs = inputs(n, jnp.float32, (3,), 52)
    weights = random_array((n, OUTPUT_ROWS, 3), jnp.float32, 54)

    def per(operand, output, t_operand, t_output, w, *rest):
        f = lambda a, b: nx.ragged_all_to_all(a, b, *rest, axis_name="x")  # noqa: E731
        result, tangent = jax.jvp(f, (operand, output), (t_operand, t_output))
        _, pullback = jax.vjp(f, operand, output)
        ct_operand, ct_output = pullback(w)
        forward = jax.lax.psum(jnp.sum(w * tangent), "x")
        backward = jax.lax.psum(jnp.sum(ct_operand * t_operand) + jnp.sum(ct_output * t_output), "x")
        return [v[None] for v in (result, tangent, f(t_operand, t_output), forward, backward)]

    spec = P("x")
    result, tangent, mapped, forward, backward = jax.jit(jax.shard_map(
        lambda *a: per(*(v[0] for v in a)), mesh=mesh, in_specs=(spec,) * 9, out_specs=spec))(
            operands, outputs, t_operands, t_outputs, weights, *call)
    expected, _ = lax_reference(operands, outputs, *call, capacity=OUTPUT_ROWS)
    for me in range(n):
        assert_bits_equal(result[me], expected[me])
    assert_bits_equal(tangent, mapped)
    np.testing.assert_allclose(np.asarray(forward), np.asarray(backward), rtol=1e-5)


def test_rows_land_from_the_exchange_itself(backend):
    """The HLO guard: one ragged exchange that takes over output's buffer, and no gather or XLA collective
    after it; the offsets travel by one all_to_all."""
    mesh, n = line(backend), len(backend)
    operands, outputs = inputs(n, jnp.float32, (3,), 60)
    call = valid_call(n, 2, 60)
    with jax.set_mesh(mesh):
        hlo = ragged(mesh).lower(operands, outputs, *call).as_text()
    calls = [line for line in hlo.splitlines() if "custom_call @ncclx_" in line]
    assert [c.split("custom_call @")[1].split("(")[0].removesuffix("_nvlink") for c in calls] == \
        ["ncclx_all_to_all", "ncclx_ragged_all_to_all"], calls
    assert "output_operand_aliases" in calls[1], calls[1]
    assert not [op for op in ("stablehlo.all_to_all", "stablehlo.all_gather", "@ragged_all_to_all")
                if op in hlo]


def test_checksum_mode_gives_the_same_result(backend, monkeypatch):
    """JAX_NCCLX_CHECKSUM=1 moves the rows through all_to_allv_dynamic's checksummed padded layout and places
    them by a scatter: the same bits."""
    mesh, n = line(backend), len(backend)
    operands, outputs = inputs(n, jnp.float32, (3,), 70)
    call = overlapping_call(n, 2, 70, True)
    plain = np.asarray(ragged(mesh)(operands, outputs, *call))
    monkeypatch.setenv("JAX_NCCLX_CHECKSUM", "1")
    assert_bits_equal(ragged(mesh)(operands, outputs, *call), plain)
    nx.check_errors()


def test_vmap_over_a_batch_axis(backend):
    mesh, n = line(backend), len(backend)
    batch = [inputs(n, jnp.float32, (3,), seed) + tuple(valid_call(n, 2, seed)) for seed in (20, 21)]
    stacked = [np.stack(parts, axis=1) for parts in zip(*batch)]  # [N, batch, ...]
    vmapped = per_member(mesh, jax.vmap(lambda *a: nx.ragged_all_to_all(*a, axis_name="x")), 6)
    got = np.asarray(vmapped(*stacked))
    for b, args in enumerate(batch):
        expected, _ = lax_reference(*args, capacity=OUTPUT_ROWS)
        for me in range(n):
            assert_bits_equal(got[me, b], expected[me])


def test_vmap_over_its_own_axis():
    """Every member on one device (jax.vmap(axis_name=...)): the exchanges become gathers."""
    n = 4
    operands, outputs = inputs(n, jnp.float32, (3,), 40)
    call = valid_call(n, 2, 40)
    got = jax.jit(jax.vmap(lambda *a: nx.ragged_all_to_all(*a, axis_name="m"), axis_name="m"))(
        operands, outputs, *call)
    expected, _ = lax_reference(operands, outputs, *call, capacity=OUTPUT_ROWS)
    for me in range(n):
        assert_bits_equal(np.asarray(got[me]), expected[me])


def test_global_view_outside_shard_map(backend):
    mesh, n = line(backend), len(backend)
    operands, outputs = inputs(n, jnp.float32, (3,), 30)
    call = valid_call(n, 1, 30)
    put = lambda a: jax.device_put(np.concatenate(list(a)), NamedSharding(mesh, P("x")))  # noqa: E731
    with jax.set_mesh(mesh):  # on GPU the communicators need the mesh's concrete devices at compile time
        got = jax.jit(lambda *a: nx.ragged_all_to_all(*a, axis_name="x"))(*map(put, (operands, outputs, *call)))
    expected, _ = lax_reference(operands, outputs, *call, capacity=OUTPUT_ROWS)
    assert_bits_equal(np.asarray(got), np.concatenate(expected))


@pytest.mark.parametrize("groups", [((0, 2, 4, 6), (1, 3, 5, 7)), ((3, 0, 5, 6), (7, 1, 2, 4))],
                         ids=["strided", "shuffled"])
@pytest.mark.parametrize("overlapping", [False, True], ids=["disjoint", "same_rows_to_every_peer"])
def test_axis_index_groups_exchange_within_each_group(groups, overlapping):
    """Each group of 4 of the 8 CPU devices runs its own call, its arrays [4 * K] in group order."""
    mesh, n, size = line(jax.devices("cpu")), NUM_CPU_DEVICES, len(groups[0])
    operands, outputs = inputs(n, jnp.float32, (3,), 50)
    calls = [overlapping_call(size, 2, 51 + g, True) if overlapping else valid_call(size, 2, 51 + g)
             for g in range(len(groups))]
    arrays = [np.zeros((n, size * 2), np.int32) for _ in range(4)]
    for group, call in zip(groups, calls):
        for position, member in enumerate(group):
            for array, values in zip(arrays, call):
                array[member] = values[position]
    fn = per_member(mesh, lambda *a: nx.ragged_all_to_all(*a, axis_name="x", axis_index_groups=groups), 6)
    got = np.asarray(fn(operands, outputs, *arrays))
    for group, call in zip(groups, calls):
        expected, _ = lax_reference([operands[m] for m in group], [outputs[m] for m in group], *call,
                                    capacity=OUTPUT_ROWS)
        for position, member in enumerate(group):
            assert_bits_equal(got[member], expected[position])


@pytest.mark.gpu
def test_matches_lax_ragged_all_to_all_on_gpus():
    """All GPUs, or the one GPU of a machine with one (an axis of one member: every slice goes to itself)."""
    reason = gpu_skip_reason(minimum=1)
    if reason:
        pytest.skip(reason)
    mesh, n = line(gpu_devices()), len(gpu_devices())
    lax_ragged = per_member(mesh, lambda *a: jax.lax.ragged_all_to_all(*a, axis_name="x"), 6)
    calls = [valid_call(n, 1, 0), valid_call(n, 3, 1), overlapping_call(n, 1, 2, True),
             overlapping_call(n, 3, 3, True), overlapping_call(n, 3, 4, False)]
    for seed, call in enumerate(calls):
        args = (*inputs(n, jnp.bfloat16, (16,), seed), *call)
        assert_bits_equal(np.asarray(ragged(mesh)(*args)), np.asarray(lax_ragged(*args)))


@pytest.mark.parametrize("change,error,match", [
    (dict(output=np.zeros((OUTPUT_ROWS, 4), np.float32)), ValueError, "same trailing shape and dtype"),
    (dict(output=np.zeros((OUTPUT_ROWS, 3), np.int32)), ValueError, "same trailing shape and dtype"),
    (dict(send_sizes=np.zeros(3, np.int32)), ValueError, "one length, a multiple of N"),
    (dict(recv_sizes=np.zeros(0, np.int32)), ValueError, "one length, a multiple of N"),
    (dict(input_offsets=np.zeros(2, np.float32)), ValueError, "input_offsets must be a 1-D integer array"),
    (dict(output_offsets=np.zeros((2, 1), np.int32)), ValueError, "output_offsets must be a 1-D integer array"),
    (dict(send_sizes=[0, 0]), TypeError, r"ragged_all_to_all: send_sizes must be an array .*got a list"),
    (dict(max_recv_per_peer=-1), ValueError, "max_recv_per_peer must be >= 0"),
    (dict(max_recv_per_peer=2.0), TypeError, "max_recv_per_peer must be a static Python int"),
    (dict(axis_index_groups=[[0], [0]]), ValueError, "must cover the axis indices 0 .. 1 exactly once"),
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
