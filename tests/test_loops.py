"""jax_ncclx inside loops (tests/loop_models.py): a stack of MoE layers under lax.scan, with and without
jax.checkpoint, against the same stack in dense XLA ops (loss and gradients); decode steps under fori_loop
against jax.lax's collectives. In process on CPU and, where present, GPUs; loop_worker.py runs both with custom
calls captured into CUDA graphs, where one GPU is enough."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ncclx as nx
import loop_models
from jax_ncclx._src import compat
from jax_ncclx._src import config
from conftest import run_command_buffer_worker


@pytest.mark.parametrize("remat", [False, True], ids=["saved", "remat"])
def test_moe_stack_under_scan(backend, remat):
    """Loss and gradients of the scanned stack match the dense stack; the exchanges stay inside the scan (one
    call site each way, whatever the layer count), and jax.checkpoint runs dispatch and combine again in the
    backward pass."""
    mesh = loop_models.line_mesh(backend)
    args = loop_models.moe_inputs(len(backend))
    stack, dense = loop_models.moe_stack_programs(mesh, remat=remat)
    loop_models.assert_loss_and_grads_match(stack(*args), dense(*args))

    jaxpr = str(jax.make_jaxpr(stack)(*args))
    # forward: dispatch and combine; backward: their transposes, plus both again when recomputed
    exchanges = jaxpr.count("ncclx_moe_dispatch") + jaxpr.count("ncclx_all_to_allv_dynamic")
    assert exchanges == (6 if remat else 4), jaxpr


def test_decode_under_fori_loop(backend):
    """Decode steps with jax_ncclx's all_reduce, all_to_all, all_gather and ppermute match the same steps with
    jax.lax's (float32: the same sums in the same order on CPU; within rounding on GPU)."""
    n = len(backend)
    mesh = loop_models.line_mesh(backend)
    x, weights = loop_models.decode_inputs(n)
    actual = loop_models.decode(mesh, use_nx=True)(x, weights)
    expected = loop_models.decode(mesh, use_nx=False)(x, weights)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
    assert not np.array_equal(np.asarray(actual), x)  # the steps did something


@pytest.mark.gpu
@pytest.mark.parametrize("loops_in_graphs,nccl_recorded", [(False, False), (True, False), (True, True)],
                         ids=["custom_calls", "loops_too", "loops_too_nccl_recordable"])
def test_loops_in_command_buffers(loops_in_graphs, nccl_recorded):
    """Both programs, compiled once and run with new inputs, with custom calls captured (and whole loops): they
    must match XLA's programs, and the handlers must have been recorded into a graph (and replayed, where only
    custom calls are captured; see loop_worker.py). With the NCCL handlers recordable too, the NCCL-path calls
    in the loop bodies must stay out of XLA's loop graphs (lowering._lower), or those fail to instantiate."""
    env = {"JAX_NCCLX_NCCL_COMMAND_BUFFERS": "1"} if nccl_recorded else {}
    if loops_in_graphs:
        run_command_buffer_worker("loop_worker.py", "--loops-in-graphs", minimum=1,
                                  xla_flags="--xla_gpu_enable_command_buffer=+CUSTOM_CALL,+WHILE,+CONDITIONAL "
                                            "--xla_gpu_graph_min_graph_size=1", **env)
    else:
        run_command_buffer_worker("loop_worker.py", minimum=1, **env)


@pytest.mark.parametrize("flags,records", [
    ("", False),
    ("--xla_gpu_enable_command_buffer=+CUSTOM_CALL --xla_gpu_graph_min_graph_size=1", False),
    ("--xla_gpu_enable_command_buffer=+CUSTOM_CALL,+WHILE,+CONDITIONAL", True),
    ("--xla_gpu_enable_command_buffer=FUSION,CONDITIONAL", True),
    ("--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_enable_command_buffer=-WHILE", False),
    ("--xla_gpu_enable_command_buffer=+while --xla_gpu_enable_command_buffer=FUSION", False),
    ("--xla_gpu_enable_command_buffer='+WHILE'", True),
])
def test_xla_flags_that_record_loops(flags, records):
    assert config.xla_records_loops(flags) is records


def test_control_flow_is_seen_from_lowering_rules(monkeypatch):
    """compat.lowering_may_be_inside_control_flow, asked from the collectives' lowering: true in fori_loop,
    scan, cond and a nested jitted function, wherever it is first met (JAX lowers its body once and calls it
    from every place, a loop body included); false elsewhere."""
    seen = []
    lower = jax.ffi.ffi_lowering

    def spy(target, **options):
        seen.append(compat.lowering_may_be_inside_control_flow())
        return lower(target, **options)

    monkeypatch.setattr(jax.ffi, "ffi_lowering", spy)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:2]), ("x",))
    swap = [(0, 1), (1, 0)]
    step = jax.jit(lambda v: nx.ppermute(v, "x", swap))
    programs = {
        "plain": (lambda v: nx.ppermute(v, "x", swap), False),
        "fori_loop": (lambda v: jax.lax.fori_loop(0, 2, lambda i, u: nx.ppermute(u, "x", swap), v), True),
        "scan": (lambda v: jax.lax.scan(lambda u, _: (nx.ppermute(u, "x", swap), None), v, length=2)[0], True),
        "cond": (lambda v: jax.lax.cond(v[0] > 0, lambda u: nx.ppermute(u, "x", swap), lambda u: u, v), True),
        "jitted step in a loop": (lambda v: jax.lax.fori_loop(0, 2, lambda i, u: step(u), v), True),
        "jitted step, then the same in a loop": (lambda v: jax.lax.fori_loop(0, 2, lambda i, u: step(u), step(v)),
                                                 True),
        "checkpoint": (jax.checkpoint(lambda v: nx.ppermute(v, "x", swap)), False),
    }
    for name, (body, inside) in programs.items():
        seen.clear()
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))).lower(np.ones(4, np.float32))
        assert seen == [inside], (name, seen)
