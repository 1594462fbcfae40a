"""jax_ncclx inside loops (tests/loop_models.py): a stack of MoE layers under lax.scan, with and without
jax.checkpoint, against the same stack in dense XLA ops (loss and gradients); decode steps under fori_loop
against jax.lax's collectives. In process on CPU and, where present, GPUs; loop_worker.py runs both with custom
calls captured into CUDA graphs, where one GPU is enough."""

import jax
import numpy as np
import pytest

import loop_models
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
    assert jaxpr.count("ncclx_all_to_allv_dynamic") == (6 if remat else 4), jaxpr


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
@pytest.mark.parametrize("loops_in_graphs", [False, True], ids=["custom_calls", "loops_too"])
def test_loops_in_command_buffers(loops_in_graphs):
    """Both programs, compiled once and run with new inputs, with custom calls captured (and whole loops): they
    must match XLA's programs, and the handlers must have been recorded into a graph (and replayed, where only
    custom calls are captured; see loop_worker.py)."""
    if loops_in_graphs:
        run_command_buffer_worker("loop_worker.py", "--loops-in-graphs", minimum=1,
                                  xla_flags="--xla_gpu_enable_command_buffer=+CUSTOM_CALL,+WHILE,+CONDITIONAL "
                                            "--xla_gpu_graph_min_graph_size=1")
    else:
        run_command_buffer_worker("loop_worker.py", minimum=1)
