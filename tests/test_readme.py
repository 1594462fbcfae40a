"""The README's first program, and every program in the docs (a block that starts with ``import jax``), runs as
written and gives what its comments say."""

import pathlib
import re

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_DEVICES_LINE = 'jax.config.update("jax_num_cpu_devices", 4)'


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", (ROOT / path).read_text(), re.S)


def run_program(block, path):
    # conftest.py has started JAX with 8 CPU devices already, and the count can only be set before that.
    assert CPU_DEVICES_LINE in block or "devices" not in block and "mesh" not in block
    namespace = {}
    exec(compile(block.replace(CPU_DEVICES_LINE, "pass"), str(ROOT / path), "exec"), namespace)
    return namespace


def check_first_program(namespace):
    n = namespace["n"]
    assert n == len(jax.devices())
    y = np.asarray(namespace["y"])
    assert y.shape == (n * 4 * n, 4)
    per_member = y.reshape(n, 4 * n, 4)
    received = np.repeat(np.arange(n), 2)[None, :, None]  # two rows from each member, valued by their source
    np.testing.assert_array_equal(per_member[:, : 2 * n], np.broadcast_to(received, per_member[:, : 2 * n].shape))
    np.testing.assert_array_equal(per_member[:, 2 * n:], 0)
    np.testing.assert_array_equal(np.asarray(namespace["recv_counts"]), 2)


def check_ragged_program(namespace):
    n, rows = len(jax.devices()), namespace["rows"]
    x = np.asarray(namespace["x"]).reshape(n, rows, 4)
    sizes = np.asarray(namespace["send_sizes"]).reshape(n, n)  # [source, destination]
    expected = np.full((n, n * rows, 4), -1.0, np.float32)
    for dest in range(n):
        at = 0
        for source in range(n):
            first, count = sizes[source, :dest].sum(), sizes[source, dest]
            expected[dest, at: at + count] = x[source, first: first + count]
            at += count
    np.testing.assert_array_equal(np.asarray(namespace["y"]).reshape(n, n * rows, 4), expected)


def test_first_program_runs():
    check_first_program(run_program(python_blocks("README.md")[0], "README.md"))


DOC_PROGRAMS = [(path, i) for path in sorted(str(f.relative_to(ROOT)) for f in (ROOT / "docs").glob("*.md"))
                for i, block in enumerate(python_blocks(path)) if block.startswith("import jax\n")]


def test_the_docs_have_programs():
    assert {("docs/getting_started.md", 0), ("docs/getting_started.md", 1), ("docs/getting_started.md", 2),
            ("docs/getting_started.md", 3), ("docs/moe.md", 0)} <= set(DOC_PROGRAMS)


@pytest.mark.parametrize("path, index", DOC_PROGRAMS, ids=[f"{p}-{i}" for p, i in DOC_PROGRAMS])
def test_docs_program_runs(path, index):
    block = python_blocks(path)[index]
    namespace = run_program(block, path)
    if "shuffle" in namespace:  # the first collective, as in the README
        check_first_program(namespace)
    if "route_lax" in block:  # the psum ran as nx.all_reduce, with psum's result
        n, layer, x = len(jax.devices()), namespace["layer"], namespace["x"]
        np.testing.assert_array_equal(np.asarray(namespace["out"]), np.full(8, 4 * n, np.float32))
        with namespace["nx"].route_lax():
            assert "ncclx_all_reduce" in jax.jit(layer).lower(x).as_text()
        assert "ncclx_all_reduce" not in jax.jit(layer).lower(x).as_text()
    if "jax.vmap(body" in block:  # collectives over a vmapped axis: local work, no mesh
        np.testing.assert_array_equal(np.asarray(namespace["out"]), np.full((4, 8), 16, np.float32))
    if "nx.ragged_all_to_all(" in block:  # each member's rows from each source, packed in source order
        check_ragged_program(namespace)
    if "moe.dispatch" in block:  # the MoE layer: the dense layer's result, nothing dropped
        np.testing.assert_allclose(np.asarray(namespace["out"]), np.asarray(namespace["dense"]), rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_array_equal(np.asarray(namespace["dropped"]), 0)
        assert namespace["dw"].shape == namespace["w"].shape and np.isfinite(np.asarray(namespace["dw"])).all()
