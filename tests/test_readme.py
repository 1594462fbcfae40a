"""The README's quick start runs as written and gives what its comments say."""

import pathlib
import re

import jax
import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_quick_start_runs():
    if len(jax.devices()) < 4:
        pytest.skip("the quick start's mesh takes 4 devices of the default backend")
    block = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    namespace = {}
    exec(compile(block, str(README), "exec"), namespace)
    y = np.asarray(namespace["y"])
    assert y.shape == (4 * 4 * 64, 8)
    per_member = y.reshape(4, 4 * 64, 8)
    np.testing.assert_array_equal(per_member[:, :100], 1)
    np.testing.assert_array_equal(per_member[:, 100:], 0)
