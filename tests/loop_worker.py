"""Runs the programs of loop_models.py (a scanned MoE stack under grad, with jax.checkpoint, and decode steps
under fori_loop) on every local GPU, one GPU included, with custom calls captured into CUDA graphs.

Started by test_loops.py with XLA_FLAGS that capture custom calls (the flags must be set before JAX starts).
Each program is compiled once and runs several times with new inputs; every result must match the same program
in XLA's own ops, and the handlers must have been recorded into a graph and replayed (fewer host launches than
kernel executions). With ``--loops-in-graphs`` the flags capture while loops and conditionals too, so a loop
whose body holds only command-buffer handlers (the MoE stack's) can run inside a graph, its body's kernels
again and again without the host; only the recording is required there. With
JAX_NCCLX_NCCL_COMMAND_BUFFERS=1 as well, the NCCL-path calls of the loop bodies (ppermute's) must stay out of
the loop graphs, which the package decides when lowering them: recorded, the decode loop failed to instantiate
its CUDA graph on 2xH200 (CUDA_ERROR_INVALID_VALUE, XLA 0.11.2; docs/sharp_bits.md). Prints CAPTURE OK at
the end.
"""

import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import loop_models  # noqa: E402
from jax_ncclx._src import lib  # noqa: E402

devices = jax.devices("gpu")
n = len(devices)
mesh = loop_models.line_mesh(devices)
runs = 3
require_replays = "--loops-in-graphs" not in sys.argv[1:]


def launches_during(run_all):
    """(host launches, launches recorded into graphs) of NVLink kernels while run_all() runs."""
    start = lib.cuda_module().nvlink_launch_counts()
    run_all()
    return tuple(end - begin for end, begin in zip(lib.cuda_module().nvlink_launch_counts(), start))


def check_replayed(name, run_all, executions):
    """run_all() executes at least `executions` NVLink kernels; recorded into graphs and replayed, they need
    fewer host launches."""
    launches, captured = launches_during(run_all)
    print(f"{name}: at least {executions} NVLink kernel executions, {launches} host launches, {captured} "
          "recorded into graphs", flush=True)
    assert captured > 0, f"{name}: the handlers were never recorded into a CUDA graph"
    if require_replays:
        assert launches < executions, f"{name}: every execution called the handlers: no graph replayed"


stack_args = loop_models.moe_inputs(n)
stack, dense = loop_models.moe_stack_programs(mesh, remat=True)


def run_stack():
    for run in range(runs):
        args = (stack_args[0] * (1 + run), *stack_args[1:])
        loop_models.assert_loss_and_grads_match(stack(*args), dense(*args), where=f"run {run}")
        print(f"moe stack run {run} matches", flush=True)


x, weights = loop_models.decode_inputs(n)
ours, theirs = loop_models.decode(mesh, use_nx=True), loop_models.decode(mesh, use_nx=False)


def run_decode():
    for run in range(runs):
        np.testing.assert_allclose(ours(x + run, weights), theirs(x + run, weights), rtol=1e-5, atol=1e-5,
                                   err_msg=f"run {run}")
        print(f"decode run {run} matches", flush=True)


# Counted: each layer's exchanges (dispatch and combine forward, again when recomputed, and their transposes)
# and each decode step's all_reduce per layer, on every GPU.
check_replayed("moe stack", run_stack, runs * n * 6 * loop_models.LAYERS)
check_replayed("decode", run_decode, runs * n * loop_models.LAYERS * loop_models.DECODE_STEPS)
print("CAPTURE OK", flush=True)
