"""route_lax: ``jax.lax``'s collectives, called by code jax_ncclx does not own, run on jax_ncclx's twins.

A program written against ``jax.lax`` (MaxText's MoE layer, say) switches to jax_ncclx without an edit::

    with nx.route_lax():
        out = jax.jit(layer)(x)        # traced here: its jax.lax collectives are jax_ncclx's

Inside the scope the module attributes ``jax.lax.psum`` ... ``jax.lax.ragged_all_to_all`` are wrappers that
translate each call to the twin. They are installed while any scope is open and put back when the last one
closes; a wrapper routes only on a thread inside a scope (a value of ``jax.make_user_context``, so it is per
thread, and part of ``jax.jit``'s cache key: a function traced inside is traced again outside, and the other
way round).
"""

import contextlib
import dataclasses
import functools
import inspect
import logging
import threading

import jax
import numpy as np

from jax_ncclx._src import validation
from jax_ncclx._src.ops.all_gather import all_gather
from jax_ncclx._src.ops.all_reduce import all_reduce
from jax_ncclx._src.ops.all_to_all import all_to_all
from jax_ncclx._src.ops.ppermute import ppermute
from jax_ncclx._src.ops.reduce_scatter import reduce_scatter
from jax_ncclx._src.ops.ragged_all_to_all import ragged_all_to_all

logger = logging.getLogger("jax_ncclx")

# jax.lax's reductions -> all_reduce's op.
_REDUCTIONS = {"psum": "sum", "pmax": "max", "pmin": "min", "pmean": "mean"}
ROUTED_OPS = ("psum", "pmax", "pmin", "pmean", "all_gather", "psum_scatter", "all_to_all", "ppermute",
              "ragged_all_to_all")

# The innermost scope's settings on a thread inside one (None outside); in jax.jit's cache key, so traces
# inside and outside (or under other settings) never mix.
_routing = jax.make_user_context(default_value=None)
_lock = threading.Lock()
_open_scopes = 0
_originals: dict = {}  # name -> jax.lax's function, while the wrappers are installed


@dataclasses.dataclass(frozen=True)
class _Settings:
    ragged_max_recv_per_peer: int | None


@contextlib.contextmanager
def route_lax(*, ragged_max_recv_per_peer: int | None = None):
    """Runs ``jax.lax``'s collectives called in this scope on jax_ncclx's twins.

    ``with nx.route_lax(): ...``: code traced in the scope that calls ``jax.lax.psum`` / ``pmax`` / ``pmin`` /
    ``pmean`` gets ``nx.all_reduce(op="sum" / "max" / "min" / "mean")``, ``jax.lax.all_gather`` ->
    ``nx.all_gather``, ``psum_scatter`` -> ``nx.reduce_scatter``, ``all_to_all`` -> ``nx.all_to_all``,
    ``ppermute`` -> ``nx.ppermute`` and ``ragged_all_to_all`` -> ``nx.ragged_all_to_all`` (its
    ``max_recv_per_peer`` from ``ragged_max_recv_per_peer``, below), the arguments translated. Shapes, dtypes
    and results follow each twin (its docstring); so do the errors of a call that reaches it.
    ``axis_index_groups`` go to the twins that take them (see their signatures).

    What is routed: calls that look the function up on the module at trace time, ``jax.lax.psum(...)`` or
    ``lax.psum(...)`` after ``from jax import lax`` (MaxText's moe.py calls them so), also a default argument
    ``f=jax.lax.all_gather`` evaluated in the scope. Not routed: a name bound before the scope
    (``from jax.lax import psum`` at import, a default argument evaluated at import), collectives that JAX's
    transforms insert themselves (e.g. the psum of a replicated weight's gradient under ``check_vma``), and
    functions traced outside the scope (a ``jax.vjp`` backward traced after it closed).

    Calls jax_ncclx does not take go to ``jax.lax`` itself, each logged at INFO on the ``jax_ncclx`` logger
    with the op and the reason: ``axis_index_groups`` for a twin that does not take them, positional
    (integer) axes, an axis not bound by an enclosing ``shard_map`` or ``vmap`` (where jax.lax fails, a
    NameError that names the op and the axis is raised from its error), operands of which none is traced
    (jax.lax computes constants such as ``psum(1, axis)`` statically), a dtype the twin refuses,
    ``all_gather(to="reduced")``, a ``shard_map`` that leaves mesh axes of size > 1 to the compiler, the CPU
    backend in a program of several processes, and (but for reductions and all_to_all) a vmapped axis in a
    tuple with other axes.

    Nesting works (the inner scope changes nothing), and so do scopes on several threads at once: routing is
    per thread, and while any scope is open ``jax.lax``'s attributes are the wrappers, which call the
    originals on every thread outside a scope. Everything is put back when the last scope exits, also on an
    exception.

    Args:
      ragged_max_recv_per_peer: ``max_recv_per_peer`` of every routed ``ragged_all_to_all`` (static int >= 0;
        None: its default, ``output.shape[0]``, with a receive buffer of N times ``output``). A layer that
        bounds what one peer sends it (an MoE capacity) should give that bound here.
    """
    global _open_scopes
    if ragged_max_recv_per_peer is not None:
        validation.check_static_int(ragged_max_recv_per_peer, "ragged_max_recv_per_peer", "route_lax", minimum=0)
    with _lock:
        if not _open_scopes:
            for name in ROUTED_OPS:
                _originals[name] = getattr(jax.lax, name)
                setattr(jax.lax, name, _wrapper(name, _originals[name]))
        _open_scopes += 1
    try:
        with _routing(_Settings(ragged_max_recv_per_peer)):
            yield
    finally:
        with _lock:
            _open_scopes -= 1
            if not _open_scopes:
                for name in ROUTED_OPS:
                    setattr(jax.lax, name, _originals.pop(name))


def _wrapper(name: str, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def routed(*args, **kwargs):
        if _routing.value is None:
            return original(*args, **kwargs)
        try:
            call = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # jax.lax's own error for a call it does not take
        call.apply_defaults()
        arguments = dict(call.arguments)
        reason = _refusal(name, arguments)
        if not reason:
            return _twin(name, arguments)
        logger.info("jax_ncclx.route_lax: jax.lax.%s runs on jax.lax, not jax_ncclx: %s", name, reason)
        try:
            return original(*args, **kwargs)
        except Exception as error:  # jax.lax's own error for an unbound axis can be a bare AssertionError
            unbound = _unbound_axes(arguments)
            if not unbound:
                raise
            raise NameError(
                f"jax.lax.{name} (in jax_ncclx.route_lax): axis {unbound[0]!r} is not bound by an enclosing "
                f"shard_map or vmap; name an axis of the shard_map's mesh or a vmap's axis_name"
            ) from error

    return routed


def _twin(name: str, a: dict):
    groups = {} if a.get("axis_index_groups") is None else {"axis_index_groups": a["axis_index_groups"]}
    if name in _REDUCTIONS:
        return all_reduce(a["x"], a["axis_name"], _REDUCTIONS[name], **groups)
    if name == "all_gather":
        return all_gather(a["x"], a["axis_name"], axis=a["axis"], tiled=a["tiled"], to=a["to"], **groups)
    if name == "psum_scatter":
        return reduce_scatter(a["x"], a["axis_name"], scatter_dimension=a["scatter_dimension"], tiled=a["tiled"],
                              **groups)
    if name == "all_to_all":
        return all_to_all(a["x"], a["axis_name"], a["split_axis"], a["concat_axis"], tiled=a["tiled"], **groups)
    if name == "ppermute":
        return ppermute(a["x"], a["axis_name"], a["perm"])
    return ragged_all_to_all(a["operand"], a["output"], a["input_offsets"], a["send_sizes"], a["output_offsets"],
                             a["recv_sizes"], axis_name=a["axis_name"],
                             max_recv_per_peer=_routing.value.ragged_max_recv_per_peer, **groups)


_TWINS = {"psum": all_reduce, "pmax": all_reduce, "pmin": all_reduce, "pmean": all_reduce,
          "all_gather": all_gather, "psum_scatter": reduce_scatter, "all_to_all": all_to_all,
          "ppermute": ppermute, "ragged_all_to_all": ragged_all_to_all}


def _takes_groups(name: str) -> bool:
    """Whether the twin of ``jax.lax.<name>`` takes ``axis_index_groups``."""
    return "axis_index_groups" in inspect.signature(_TWINS[name]).parameters


def _axis_names(a: dict) -> tuple:
    """The call's axis names, a tuple (its ``axis_name`` bound argument)."""
    axis_name = a["axis_name"]
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _unbound_axes(a: dict) -> list:
    """The call's named (not positional) axes that no enclosing shard_map or vmap binds."""
    return [n for n in _axis_names(a) if not isinstance(n, (int, np.integer)) and not validation.is_bound(n)]


def _refusal(name: str, a: dict) -> str | None:
    """Why jax_ncclx's twin does not take this call of ``jax.lax.<name>`` (its bound arguments), or None."""
    if a.get("axis_index_groups") is not None and not _takes_groups(name):
        return f"axis_index_groups={a['axis_index_groups']!r} (jax_ncclx's twin has no groups within an axis)"
    if name == "all_gather" and a["to"] not in ("varying", "invarying"):
        return f"to={a['to']!r} (jax_ncclx's all_gather returns a varying or an invarying array)"
    if name == "all_gather" and a["to"] == "invarying" and a.get("axis_index_groups") is not None:
        return "to='invarying' with axis_index_groups"
    axis_name = a["axis_name"]
    names = _axis_names(a)
    if not names:
        return "no axis named"
    if any(isinstance(n, (int, np.integer)) for n in names):
        return f"positional axes in axis_name={axis_name!r}"
    unbound = _unbound_axes(a)
    if unbound:
        return f"axis {unbound[0]!r} is not bound by an enclosing shard_map or vmap"
    data = (a["operand"], a["output"]) if name == "ragged_all_to_all" else a["x"]
    leaves = jax.tree.leaves(data)
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        return "no operand is traced (jax.lax computes it as a constant)"
    reduce_op = {"pmean": "sum", "psum_scatter": "sum"}.get(name, _REDUCTIONS.get(name))
    for leaf in leaves:
        try:
            validation.check_dtype(leaf, _TWINS[name].__name__, reduce_op=reduce_op)
        except TypeError as error:
            return str(error)
    if jax.process_count() > 1 and jax.default_backend() == "cpu":
        return f"the CPU backend runs within one process, and this program has {jax.process_count()}"
    mesh = jax.sharding.get_abstract_mesh()
    automatic = [n for n in mesh.axis_names if n not in mesh.manual_axes and mesh.shape[n] > 1]
    if automatic:
        return f"the enclosing shard_map leaves mesh axes {automatic} of size > 1 to the compiler"
    vmapped = [n for n in names if n not in mesh.axis_names]
    if vmapped and len(names) > 1 and name not in (*_REDUCTIONS, "all_to_all"):
        return f"axis_name={axis_name!r} takes the vmapped axis {vmapped[0]!r} together with other axes"
    return None
