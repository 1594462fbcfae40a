"""Process-wide settings of jax_ncclx, read from ``JAX_NCCLX_*`` environment variables.

The variables are read when a collective is lowered (compiled), so a test or a program can change them between
compilations; a bad value raises at once with the variable's name and what it accepts.
"""

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings that apply to every collective compiled from now on.

    Attributes:
      timeout_s: seconds a participant waits for its peers before the collective fails with an error that
        names the ranks that did not arrive (``JAX_NCCLX_TIMEOUT_S``, default 600). Enforced by the CPU
        backend today.
    """

    timeout_s: float = 600.0


def _positive_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name}={raw!r} is not valid: it must be a positive number of seconds")
    return value


def current() -> Config:
    """The settings in force now, from the environment."""
    return Config(timeout_s=_positive_float("JAX_NCCLX_TIMEOUT_S", Config.timeout_s))
