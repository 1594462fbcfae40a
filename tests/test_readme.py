"""The README's first program runs as written and gives what its comments say."""

import pathlib
import re

import jax
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
CPU_DEVICES_LINE = 'jax.config.update("jax_num_cpu_devices", 4)'


def test_first_program_runs():
    block = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    # conftest.py has started JAX with 8 CPU devices already, and the count can only be set before that.
    assert CPU_DEVICES_LINE in block
    block = block.replace(CPU_DEVICES_LINE, "pass")
    namespace = {}
    exec(compile(block, str(README), "exec"), namespace)
    n = namespace["n"]
    assert n == len(jax.devices())
    y = np.asarray(namespace["y"])
    assert y.shape == (n * 4 * n, 4)
    per_member = y.reshape(n, 4 * n, 4)
    received = np.repeat(np.arange(n), 2)[None, :, None]  # two rows from each member, valued by their source
    np.testing.assert_array_equal(per_member[:, : 2 * n], np.broadcast_to(received, per_member[:, : 2 * n].shape))
    np.testing.assert_array_equal(per_member[:, 2 * n:], 0)
    np.testing.assert_array_equal(np.asarray(namespace["recv_counts"]), 2)
