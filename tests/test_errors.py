"""Misuse gets a clear error at trace time; a peer that never arrives gets a timeout naming it."""

import logging
import os
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ncclx as nx
from jax_ncclx._src import contract
from jax_ncclx._src import lowering


@pytest.fixture
def line():
    return jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:4]), ("x",))


def per_shard(mesh, fn, *args):
    specs = tuple(P("x") for _ in args)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("x")))(*args)


def test_unbound_axis_outside_shard_map():
    with pytest.raises(NameError, match="shard_map"):
        nx.all_reduce(jnp.ones(4), "nowhere")


def test_eager_primitive_outside_mapped_context():
    from jax_ncclx._src.ops.all_reduce import all_reduce_p

    with pytest.raises(RuntimeError, match="must run inside jax.shard_map"):
        all_reduce_p.bind(jnp.ones(2), axis_name="x", op="sum")


def test_shard_map_must_make_every_axis_manual():
    """A shard_map whose axis_names leave a mesh axis of size > 1 to the compiler gets a jax_ncclx error naming
    it (XLA cannot partition the custom calls over it); one of size 1 may stay automatic."""
    x = jnp.arange(16.0).reshape(4, 4)
    for shape, automatic in (((2, 2), "'b'"), ((4, 1), None)):
        mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:4]).reshape(shape), ("a", "b"))
        f = jax.jit(jax.shard_map(lambda v: nx.all_reduce(v, "a"), mesh=mesh, in_specs=P("a"), out_specs=P(),
                                  axis_names={"a"}))
        if automatic is None:
            np.testing.assert_array_equal(f(x), np.asarray(x).reshape(4, 1, 4).sum(0))
            continue
        with pytest.raises(NotImplementedError, match=rf"jax_ncclx\.all_reduce: .*axis_names leave {automatic} "):
            f(x)


@pytest.mark.parametrize("call, error, message", [
    (lambda v: nx.all_reduce(v, "x", op="prod"), ValueError, "op must be one of"),
    (lambda v: nx.all_reduce(v, ("x", "x")), ValueError, r"names an axis twice: \('x', 'x'\)"),
    (lambda v: nx.all_reduce(v, ()), ValueError, "at least one mesh axis"),
    (lambda v: nx.all_gather(v, ("x", "nowhere")), NameError, r"unbound axis name \('x', 'nowhere'\)"),
    (lambda v: nx.all_reduce(v.astype(jnp.float8_e4m3fn), "x"), TypeError, "cannot reduce 8-bit float"),
    (lambda v: nx.all_gather(jax.random.key(0), "x"), TypeError, r"unsupported dtype key<fry>; use a number or "
                                                                  "boolean dtype"),
    (lambda v: nx.all_reduce(v.astype(jnp.complex64), "x", "max"), TypeError, "complex numbers have no order"),
    (lambda v: nx.all_gather(v.astype(jnp.int4), "x"), TypeError, r"dtype int4 \(4 bits\): values of under a byte"),
    (lambda v: nx.all_reduce(v.astype(jnp.float4_e2m1fn), "x", "max"), TypeError, r"float4_e2m1fn \(4 bits\)"),
    (lambda v: nx.all_to_allv_dynamic(v.astype(jnp.uint2), jnp.ones(4, jnp.int32), "x", max_recv_per_peer=2),
     TypeError, r"pack 4 values into each byte"),
    (lambda v: nx.all_gather(v, "x", axis=5), ValueError, "out of range"),
    (lambda v: nx.reduce_scatter(v, "x", scatter_dimension=1), ValueError, "must be the axis size 4"),
    (lambda v: nx.reduce_scatter(v[:, :3], "x", scatter_dimension=1, tiled=True), ValueError, "multiple of"),
    (lambda v: nx.reduce_scatter(v, "x", scatter_dimension=True), TypeError,
     "reduce_scatter: scatter_dimension must be a static Python int, got True"),
    (lambda v: nx.reduce_scatter(v, "x", scatter_dimension=1.0), TypeError,
     "reduce_scatter: scatter_dimension must be a static Python int, got 1.0"),
    (lambda v: nx.all_gather(v, "x", axis=v.sum().astype(int)), TypeError,
     "all_gather: axis must be a static Python int"),
    (lambda v: nx.all_to_all(v, "x", 1, 0), ValueError, "split_axis 1 has size 8"),
    (lambda v: nx.all_to_all(v, "x", "1", 0), TypeError, "all_to_all: split_axis must be a static Python int"),
    (lambda v: nx.all_to_all(v, "x", 0, 1.0), TypeError, "all_to_all: concat_axis must be a static Python int"),
    (lambda v: nx.ppermute(v, "x", [(0, 1), (2, 1)]), ValueError, "destination appears twice"),
    (lambda v: nx.ppermute(v, "x", [(0.7, 1.9)]), TypeError, r"perm must be a sequence of \(src, dst\) int pairs"),
    (lambda v: nx.ppermute(v, "x", [(True, 2)]), TypeError, r"perm must be a sequence of \(src, dst\) int pairs"),
    (lambda v: nx.ppermute(v, "x", [(0, 4)]), ValueError, "outside the axis"),
    (lambda v: nx.all_to_allv_dynamic(v, jnp.ones(3, jnp.int32), "x", max_recv_per_peer=2), ValueError,
     r"\[N\] or \[N, K\] with N = 4"),
    (lambda v: nx.all_to_allv_dynamic(v, jnp.ones(4), "x", max_recv_per_peer=2), TypeError, "must be integers"),
    (lambda v: nx.all_to_allv_dynamic(v, [1, 1, 1, 1], "x", max_recv_per_peer=2), TypeError,
     r"all_to_allv_dynamic: send_counts must be an array .*got a list"),
    (lambda v: nx.all_to_allv_dynamic(v, jnp.ones(4, jnp.int32), "x", max_recv_per_peer=-1), ValueError, ">= 0"),
    (lambda v: nx.all_to_allv_dynamic(v, jnp.ones(4, jnp.int32), "x", max_recv_per_peer=2**31), ValueError,
     "max_recv_per_peer must be <= 2147483647"),
    (lambda v: nx.all_to_allv_dynamic(v, jnp.ones(4, jnp.int32), "x", max_recv_per_peer=2, layout="dense"),
     ValueError, "layout must be one of"),
    (lambda v: nx.all_to_allv_dynamic(v, jnp.ones(4, jnp.int32), "x", max_recv_per_peer=v.sum().astype(int)),
     TypeError, "static Python int"),
    (lambda v: nx.all_to_allv_dynamic(v, jnp.ones(4, jnp.int32), "x", max_recv_per_peer=True), TypeError,
     "max_recv_per_peer must be a static Python int"),
    (lambda v: nx.all_to_allv_dynamic(v, jnp.ones(4, jnp.int32), "x", max_recv_per_peer=2, suffix=v[:, :2] > 0),
     ValueError, r"suffix \[S, G\] with x's dtype and S = 2 \(the send rows\), got x float32\[2, 8\] and suffix "
     r"bool\[2, 2\]"),
    (lambda v: nx.all_to_allv_dynamic(v, jnp.ones(4, jnp.int32), "x", max_recv_per_peer=2, suffix=v[:1]),
     ValueError, r"S = 2 \(the send rows\)"),
    (lambda v: nx.all_to_allv_dynamic(v, jnp.ones(4, jnp.int32), "x", max_recv_per_peer=2, suffix=v,
                                      send_rows=jnp.zeros(3, jnp.int32)), ValueError, r"S = 3 \(the send rows\)"),
    (lambda v: nx.all_to_allv_dynamic(v[:, :, None], jnp.ones(4, jnp.int32), "x", max_recv_per_peer=2, suffix=v),
     ValueError, r"needs x \[X, F\]"),
])
def test_misuse_inside_shard_map(line, call, error, message):
    with pytest.raises(error, match=message):
        per_shard(line, call, jnp.ones((4 * 2, 8)))


def _bound(name, **params):
    """``v -> primitive(v)`` for the primitive ``ncclx_<name>``, bound without the public function's checks."""
    import importlib

    prim = getattr(importlib.import_module(f"jax_ncclx._src.ops.{name}"), f"{name}_p")
    return lambda v: jnp.abs(prim.bind(v, axis_name="x", **params)).astype(jnp.float32)


@pytest.mark.parametrize("dtype, call, message", [
    (jnp.complex64, _bound("all_reduce", op="max"),
     "cannot take the max or min of dtype c64: complex numbers have no order"),
    (jnp.bool_, _bound("all_reduce", op="sum"), "cannot sum dtype pred into pred"),
    (jnp.float32, _bound("ppermute", sources=(5, -1, -1, -1), targets=(-1, -1, -1, -1)),
     r"sources\[0\] = 5 and targets\[0\] = -1 must each be -1 or a rank below 4"),
    (jnp.float32, _bound("ppermute", sources=(1, -1, -1, -1), targets=(-1, -1, -1, -1)),
     r"sources\[0\] = 1 but targets\[1\] = -1, expected 0"),
])
def test_handlers_refuse_what_the_python_checks_refuse(line, dtype, call, message):
    """Bound without the public functions' checks, the CPU handlers refuse as the GPU ones do: an error, never
    an out-of-bounds read or wrong bits."""
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        np.asarray(per_shard(line, lambda v: call(v.astype(dtype)), jnp.ones((4 * 2, 8))))


def test_sub_byte_dtypes_are_refused_when_bound_directly(line):
    """XLA packs int4 two to a byte; a handler sizing the buffer from its element count would overrun it."""
    from jax_ncclx._src.ops.all_gather import all_gather_p

    with pytest.raises(TypeError, match=r"jax_ncclx.all_gather: cannot take dtype int4"):
        per_shard(line, lambda v: all_gather_p.bind(v.astype(jnp.int4), axis_name="x")[0].astype(jnp.float32),
                  jnp.ones((4 * 2, 8)))


# The CPU handlers' call attributes for a group of one, as a lowering passes them (tests calling jax.ffi).
_ONE_MEMBER = dict(groups=np.array([0], np.int64), group_size=np.int64(1),
                   call=dict(site=np.int64(987654), timeout_ms=np.int64(5000), warn_ms=np.int64(0),
                             trace=np.int64(0)))


def _ffi(target, results, *operands, **attrs):
    return jax.jit(lambda *a: jax.ffi.ffi_call(target, results)(*a, **attrs))(*operands)


@pytest.mark.parametrize("place_shape,output_shape,message", [
    ((1, 3), (1, 4, 2), r"place has shape \[1, 3\], expected \[1, 2\]"),
    ((1, 2), (1, 4, 3), r"output has shape \[1, 4, 3\] \(48 bytes\), expected \[1, rows, ...\] of 8 bytes per row"),
])
def test_ragged_handler_refuses_a_place_table_or_output_that_does_not_fit(place_shape, output_shape, message):
    """ragged_all_to_all's exchange straight from jax.ffi: the place table must hold N * C entries per batch
    element and the output whole rows of x's."""
    x, counts, send_rows = jnp.ones((1, 2, 2), jnp.float32), jnp.ones((1, 1, 1), jnp.int32), jnp.zeros((1, 2),
                                                                                                    jnp.int32)
    output = jnp.zeros(output_shape, jnp.float32)
    outs = (jax.ShapeDtypeStruct(output_shape, jnp.float32), jax.ShapeDtypeStruct((1, 1, 1), jnp.int32),
            jax.ShapeDtypeStruct((1, 1), jnp.int32))
    with pytest.raises(jax.errors.JaxRuntimeError, match="jax_ncclx.ragged_all_to_all: " + message):
        _ffi("ncclx_ragged_all_to_all", outs, jnp.uint32(0), x, counts, send_rows, jnp.zeros(place_shape, jnp.int32),
             output, **_ONE_MEMBER, capacity=np.int64(2))


def test_handlers_refuse_sizes_that_overflow():
    """Attributes straight from jax.ffi (no jax_ncclx lowering): a capacity whose y size wraps around int64
    (y of 4 bytes passed for 2^62 + 1 rows: the copy ran 16 MiB past it) or past the kernels' int32 indices."""
    rows = 1 << 10
    x, counts = jnp.ones((1, rows, 1), jnp.float32), jnp.full((1, 1, 1), rows, jnp.int32)
    outs = (jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32), jax.ShapeDtypeStruct((1, 1, 1), jnp.int32),
            jax.ShapeDtypeStruct((1, 1), jnp.int32))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"capacity is 4611686018427387905, expected 0 to 2\^31 - 1"):
        _ffi("ncclx_all_to_allv_dynamic", outs, jnp.uint32(0), x, counts, **_ONE_MEMBER,
             exchange=dict(capacity=np.int64((1 << 62) + 1), packed=np.bool_(False)))
    from jax_ncclx._src.ops import moe_routing

    ids = jnp.zeros((1, 2, 1), jnp.int32)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"capacity is 4611686018427387905, expected 1 to 2\^31 - 1"):
        jax.jit(lambda i: moe_routing.plan_sends_p.bind(i, num_experts=4, num_members=4, capacity=(1 << 62) + 1))(ids)


def test_a_result_larger_than_the_device_is_refused_when_compiled(line):
    """max_recv_per_peer=2**31-1 sizes y past any device: the error names the op, the result, its bytes and the
    argument, not XLA's bare RESOURCE_EXHAUSTED when it runs."""
    n = line.size
    message = (r"jax_ncclx\.all_to_allv_dynamic: result 0 per device \(float32\[1, \d+, 2147483647, 1024\]\) "
               r"needs \d+ bytes, more than .*max_recv_per_peer")
    with pytest.raises(ValueError, match=message):
        per_shard(line, lambda v, c: nx.all_to_allv_dynamic(v, c, "x", max_recv_per_peer=2**31 - 1)[0],
                  jnp.ones((n * 4, 1024)), jnp.ones((n * n,), jnp.int32))


def test_handlers_refuse_sub_byte_dtypes_and_a_non_scalar_partition_id():
    """Through jax.ffi: int4 elements are packed two to a byte, which a size in elements would overrun; the
    partition id must be the scalar a lowering passes."""
    x = jnp.zeros((1 << 10,), jnp.int4)
    with pytest.raises(jax.errors.JaxRuntimeError, match="x has dtype s4, expected whole-byte elements"):
        _ffi("ncclx_all_gather", jax.ShapeDtypeStruct(x.shape, x.dtype), jnp.uint32(0), x, **_ONE_MEMBER)
    x = jnp.ones((4,), jnp.float32)
    with pytest.raises(jax.errors.JaxRuntimeError, match="Wrong buffer rank: expected 0 but got 1"):
        _ffi("ncclx_all_gather", jax.ShapeDtypeStruct(x.shape, x.dtype), jnp.zeros((0,), jnp.uint32), x,
             **_ONE_MEMBER)


@pytest.mark.parametrize("op, call", [
    ("all_gather", lambda u, axes: nx.all_gather(u, axes)),
    ("all_to_allv_dynamic", lambda u, axes: nx.all_to_allv_dynamic(u, jnp.ones(12, jnp.int32), axes,
                                                                   max_recv_per_peer=1)),
])
def test_vmapped_axis_with_mesh_axes_is_refused_but_for_all_reduce(line, op, call):
    with pytest.raises(NotImplementedError, match=rf"{op}: axis_name \('x', 'i'\) takes the vmapped axis 'i'"):
        per_shard(line, lambda v: jax.vmap(lambda u: call(u, ("x", "i")), axis_name="i")(v), jnp.ones((4 * 3, 2)))


def test_peer_that_never_arrives_is_named(line, monkeypatch):
    """Only rank 0 enters the collective: it fails after the timeout and names ranks 1, 2, 3."""
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", "1")

    def body(v):
        return jax.lax.cond(jax.lax.axis_index("x") == 0, lambda u: nx.all_reduce(u, "x"), lambda u: u, v)

    f = jax.jit(jax.shard_map(body, mesh=line, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    with pytest.raises(Exception, match=r"rank\(s\) 1, 2, 3 did not arrive within 1 s"):
        jax.block_until_ready(f(jnp.ones((4, 2))))


@pytest.mark.parametrize("value", ["soon", "-1", "inf", "nan", "1e10"])
def test_bad_timeout_setting(monkeypatch, value):
    from jax_ncclx._src import config

    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=rf"JAX_NCCLX_TIMEOUT_S='{value}' is not valid: it must be a number of "
                                         r"seconds from 0 to 1e\+09"):
        config.current()


def test_a_bad_setting_fails_the_import():
    """The environment is read once at import: a bad value fails there, naming its variable."""
    env = dict(os.environ, JAX_NCCLX_TRANSPORT="nvlnk", PYTHONPATH=os.pathsep.join(sys.path))  # this jax_ncclx
    run = subprocess.run([sys.executable, "-c", "import jax_ncclx"], env=env, capture_output=True, text=True)
    assert run.returncode != 0 and "JAX_NCCLX_TRANSPORT='nvlnk' is not valid: it must be one of" in run.stderr


TWO_CPU_PROCESSES = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 1)
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
import numpy as np
import jax_ncclx as nx
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2,), ("x",))
x = jax.make_array_from_callback((2, 3), NamedSharding(mesh, P("x")), lambda i: np.ones((1, 3), np.float32))
psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
with nx.route_lax():
    print("routed", np.asarray(psum(x).addressable_shards[0].data).ravel().tolist(), flush=True)
try:
    jax.jit(jax.shard_map(lambda v: nx.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)
except Exception as error:
    print("refused", error, flush=True)
"""


def test_cpu_collectives_across_processes_are_refused_at_compile_time(tmp_path):
    """On CPU the rendezvous is in-process: a group spanning two processes is refused when compiled (it would
    wait for peers until the timeout), and route_lax leaves jax.lax's collectives on jax.lax there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), XLA_FLAGS="", JAX_PLATFORMS="cpu",
               JAX_NCCLX_TIMEOUT_S="20")
    procs = [subprocess.Popen([sys.executable, "-c", TWO_CPU_PROCESSES, address, str(i)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for out in outputs:
        assert "routed [2.0, 2.0, 2.0]" in out, out
        assert "refused jax_ncclx.all_reduce: on CPU the collectives run within one process" in out, out


def test_a_misspelled_variable_is_a_warning_naming_the_nearest(monkeypatch, caplog):
    from jax_ncclx._src import config

    monkeypatch.setenv("JAX_NCCLX_TRANSPOR", "nccl")
    monkeypatch.setenv("JAX_NCCLX_CUDA", "OFF")  # a build variable: no warning
    with caplog.at_level(logging.WARNING, logger="jax_ncclx"):
        config.current()
        config.current()  # once per name
    warnings = [r.getMessage() for r in caplog.records if "is not a jax_ncclx variable" in r.getMessage()]
    assert warnings == ["JAX_NCCLX_TRANSPOR is not a jax_ncclx variable and is ignored; did you mean "
                        "JAX_NCCLX_TRANSPORT? (docs/configuration.md lists them)"], warnings


@pytest.mark.parametrize("value, timeout_ms", [("0.0004", 1), ("0.0015", 2), ("2.5", 2500)])
def test_timeouts_round_up_to_whole_milliseconds(line, monkeypatch, value, timeout_ms):
    """The handlers take whole milliseconds, 0 meaning no deadline: a timeout under 1 ms must not become 0."""
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", value)
    f = jax.jit(jax.shard_map(lambda v: nx.all_reduce(v, "x"), mesh=line, in_specs=P("x"), out_specs=P("x")))
    assert re.findall(r"timeout_ms = \d+", f.lower(jnp.ones((4, 2))).as_text()) == [f"timeout_ms = {timeout_ms}"]


def test_zero_timeout_compiles_calls_without_a_deadline(line, monkeypatch):
    """JAX_NCCLX_TIMEOUT_S=0 (wait forever) reaches the handlers as timeout_ms = 0, per op too, and the calls
    run as usual."""
    x = jnp.arange(8.0).reshape(4, 2)

    def compiled():  # a new jit each time: settings are read when a program is lowered
        return jax.jit(jax.shard_map(lambda v: nx.all_reduce(v, "x"), mesh=line, in_specs=P("x"), out_specs=P("x")))

    monkeypatch.delenv("JAX_NCCLX_TIMEOUT_S", raising=False)
    assert re.findall(r"timeout_ms = \d+", compiled().lower(x).as_text()) == ["timeout_ms = 600000"]
    for name in ("JAX_NCCLX_TIMEOUT_S", "JAX_NCCLX_TIMEOUT_S_ALL_REDUCE"):
        with monkeypatch.context() as env:
            env.setenv(name, "0")
            f = compiled()
            assert re.findall(r"timeout_ms = \d+", f.lower(x).as_text()) == ["timeout_ms = 0"]
            np.testing.assert_array_equal(f(x), np.tile(x.reshape(4, 1, 2).sum(0), (4, 1)))


def test_per_op_timeouts_name_ops_that_have_them(monkeypatch):
    """Every op that communicates can have its own timeout, and a name that is none of them is an error, not
    silently the default."""
    from jax_ncclx._src import config

    assert set(config.TIMED_OPS) == lowering.COLLECTIVE_OPS
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S_ALL_TO_ALLV_DYNAMIC", "30")
    assert config.current().timeout_s_for("all_to_allv_dynamic") == 30
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S_ALLREDUCE", "2")
    with pytest.raises(ValueError, match=r"JAX_NCCLX_TIMEOUT_S_ALLREDUCE: 'allreduce' is not an op with its own "
                                         r"timeout; set one of JAX_NCCLX_TIMEOUT_S_ALL_GATHER, "):
        config.current()


def test_nvlink_thresholds_by_gpu_count_and_op(monkeypatch):
    """The measured defaults per GPU count and op (a count between two entries takes the one above), and the
    environment overriding every op."""
    from jax_ncclx._src import config

    for name in ("JAX_NCCLX_NVLINK_ONESHOT_MAX_BYTES", "JAX_NCCLX_NVLINK_MAX_BYTES"):
        monkeypatch.delenv(name, raising=False)
    assert config.nvlink_thresholds(4, "all_gather") == (512 << 10, 16 << 20)
    assert config.nvlink_thresholds(3, "all_reduce") == (512 << 10, 16 << 20)
    assert config.nvlink_thresholds(8, "all_gather") == (256 << 10, 4 << 20)
    assert config.nvlink_thresholds(6, "all_to_all") == (256 << 10, 16 << 20)
    assert config.nvlink_thresholds(16, "all_reduce") == (256 << 10, 16 << 20)
    monkeypatch.setenv("JAX_NCCLX_NVLINK_MAX_BYTES", "1024")
    monkeypatch.setenv("JAX_NCCLX_NVLINK_ONESHOT_MAX_BYTES", "64")
    assert config.nvlink_thresholds(8, "all_gather") == (64, 1024)


def test_kernel_route_decides_and_logs(monkeypatch, caplog):
    """nvlink.kernel_route, the MoE kernels' route: None (the exchange chain) for NCCL, a misfit (logged with its
    label), slots past the kernel's most (logged) or a communicator without NVLink; else the NVLink route with
    the blocks setting, the slots and the operands."""
    import logging

    from jax_ncclx._src import comm
    from jax_ncclx._src import nvlink

    for name in ("JAX_NCCLX_TRANSPORT", "JAX_NCCLX_NVLINK_BLOCKS"):
        monkeypatch.delenv(name, raising=False)
    reasons = {7: "", 8: "rank 1 is not an NVLink peer of rank 0"}
    monkeypatch.setattr(comm, "nvlink_reason", reasons.get)
    with caplog.at_level(logging.DEBUG, logger="jax_ncclx"):
        assert nvlink.kernel_route("moe.dispatch", 7, "top-40", 1024, label="moe.dispatch (masked)") is None
        assert nvlink.kernel_route("moe.combine", 7, None, 4096, most_slot_bytes=4095) is None
    logged = [record.getMessage() for record in caplog.records]
    assert "jax_ncclx: moe.dispatch (masked) takes the exchange chain: top-40" in logged
    assert ("jax_ncclx: moe.combine takes the exchange chain: slots of 4096 bytes (more than the kernel's 4095)"
            in logged)
    assert nvlink.kernel_route("moe.combine", 8, None, 4096) is None  # no NVLink: NCCL's chain
    route = nvlink.kernel_route("moe.combine", 7, None, 4096, most_slot_bytes=4096, operands=(0, 2))
    assert (route.transport, route.slot_bytes, route.operands) == ("nvlink", 4096, (0, 2))
    assert route.attrs == dict(blocks=np.int64(0))
    monkeypatch.setenv("JAX_NCCLX_NVLINK_BLOCKS", "16")
    assert nvlink.kernel_route("moe.dispatch", 7, None, 256).attrs == dict(blocks=np.int64(16))
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "nccl")
    assert nvlink.kernel_route("moe.dispatch", 7, None, 256) is None
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "nvlink")
    with pytest.raises(RuntimeError, match="JAX_NCCLX_TRANSPORT=nvlink but this communicator cannot use NVLink"):
        nvlink.kernel_route("moe.dispatch", 8, None, 256)


def test_nvlink_protocol_setting(monkeypatch):
    """JAX_NCCLX_NVLINK_PROTOCOL takes NCCL's protocol names or auto (LL below the measured crossover for the
    GPU count and op, or JAX_NCCLX_NVLINK_LL128_MIN_BYTES, per segment; LL128 from there)."""
    from jax_ncclx._src import config
    from jax_ncclx._src import nvlink

    for name in ("JAX_NCCLX_NVLINK_PROTOCOL", "JAX_NCCLX_NVLINK_LL128_MIN_BYTES"):
        monkeypatch.delenv(name, raising=False)
    settings = config.current()
    assert settings.nvlink_protocol == "auto" and settings.nvlink_ll128_min_bytes is None
    ll128, ll = (contract.NVLINK_PROTOCOLS.index(p) for p in ("ll128", "ll"))
    for size in (2, 4, 8):  # all_reduce: LL128 from 8 KiB on every GPU count
        assert nvlink.oneshot_protocol("all_reduce", (8 << 10) - 4, size, settings) == ll
        assert nvlink.oneshot_protocol("all_reduce", 8 << 10, size, settings) == ll128
    assert nvlink.oneshot_protocol("all_to_all", 8 << 10, 2, settings) == ll       # 4 KiB per peer
    assert nvlink.oneshot_protocol("all_to_all", 16 << 10, 2, settings) == ll128
    assert nvlink.oneshot_protocol("all_gather", 4 << 10, 2, settings) == ll
    for size in (3, 4, 8):  # all_gather and all_to_all: LL128 at every size from 3 GPUs on
        assert nvlink.oneshot_protocol("all_to_all", 4 * size, size, settings) == ll128
        assert nvlink.oneshot_protocol("all_gather", 4, size, settings) == ll128
    monkeypatch.setenv("JAX_NCCLX_NVLINK_LL128_MIN_BYTES", "0")
    assert nvlink.oneshot_protocol("all_gather", 8, 2, config.current()) == ll128
    monkeypatch.setenv("JAX_NCCLX_NVLINK_LL128_MIN_BYTES", "1024")
    assert config.ll128_min_bytes(4, "all_to_all") == 1024
    assert nvlink.oneshot_protocol("all_to_all", 4 * 1020, 4, config.current()) == ll
    monkeypatch.setenv("JAX_NCCLX_NVLINK_PROTOCOL", "LL")
    assert config.current().nvlink_protocol == "ll"
    assert nvlink.oneshot_protocol("all_gather", 64 << 10, 4, config.current()) == ll
    monkeypatch.setenv("JAX_NCCLX_NVLINK_PROTOCOL", "ll64")
    with pytest.raises(ValueError, match="JAX_NCCLX_NVLINK_PROTOCOL='ll64' is not valid: it must be one of "
                                         "auto, ll128, ll, simple"):
        config.current()


def test_nvlink_slots_follow_the_protocol():
    """The slots a one-shot call needs follow the protocol: LL128 lines (120 payload bytes per 128) take less
    than LL words (4 per 8), and a segment past 64 KiB or of a size that is not whole 4-byte words goes simple
    whatever the setting."""
    from jax_ncclx._src import lib

    cuda = lib.cuda_module_if_available()
    if cuda is None:
        pytest.skip("the slot sizes come from the CUDA module, which is built only where nvcc is")
    ll128, ll, simple = (contract.NVLINK_PROTOCOLS.index(p) for p in ("ll128", "ll", "simple"))

    def slots(protocol, nbytes, op="all_reduce", size=4):
        return cuda.nvlink_collective_bytes(op, 1, protocol, nbytes, size, 4, False)

    words_area, lines_area = 4 * 2 * 65536, 4 * 70144  # per source: 547 lines of 128 B (65536 / 120 up)
    assert slots(ll, 8) == 4 * 256 and slots(ll, 65536) == words_area   # LL words come first
    assert slots(ll128, 120) == words_area + 4 * 256
    assert slots(ll128, 65536) == words_area + lines_area
    assert slots(simple, 8) == words_area + lines_area + 4 * 256
    assert slots(ll128, 65540) == slots(ll, 65540) == slots(simple, 65540) == words_area + lines_area + 4 * 65792
    assert slots(ll128, 6) == slots(simple, 6)
    # Direct (into the peers' outputs): two-shot keeps its 4 reduce-scatter slots (a quarter of 1 MiB each) but
    # needs no all-gather slots; simple moves need none; one-shot all_reduce reduces from its slots.
    def direct_and_not(op, algorithm, protocol, nbytes):
        return [cuda.nvlink_collective_bytes(op, algorithm, protocol, nbytes, 4, 4, d) for d in (True, False)]

    assert direct_and_not("all_reduce", 2, simple, 1 << 20) == [words_area + lines_area + 4 * (1 << 18),
                                                                 words_area + lines_area + 8 * (1 << 18)]
    for op in ("all_gather", "all_to_all"):
        assert direct_and_not(op, 1, simple, 1 << 22) == [words_area + lines_area, slots(simple, 1 << 22, op)]
        assert direct_and_not(op, 1, ll128, 4096) == [slots(ll128, 4096, op)] * 2
    assert direct_and_not("all_reduce", 1, simple, 1 << 20) == [slots(simple, 1 << 20)] * 2
    with pytest.raises(ValueError, match="protocol 3"):
        cuda.nvlink_collective_bytes("all_reduce", 1, 3, 8, 4, 4, False)


def test_nvlink_direct_setting(monkeypatch):
    """Which calls write into the peers' outputs: the two-shot all-gather always, simple moves once a receiver
    would copy JAX_NCCLX_NVLINK_DIRECT_MIN_BYTES out of slots ((N - 1) segments), nothing with DIRECT=0."""
    from jax_ncclx._src import config
    from jax_ncclx._src import nvlink

    for name in ("JAX_NCCLX_NVLINK_DIRECT", "JAX_NCCLX_NVLINK_DIRECT_MIN_BYTES"):
        monkeypatch.delenv(name, raising=False)
    settings = config.current()
    assert settings.nvlink_direct and settings.nvlink_direct_min_bytes == 4 << 20
    one, two = contract.ONE_SHOT, contract.TWO_SHOT

    def direct(op, nbytes, size, algorithm=one, settings=settings):
        return nvlink.collective_direct(op, algorithm, nbytes, size, settings)

    assert direct("all_reduce", 1 << 20, 4, two) and not direct("all_reduce", 1 << 20, 4, one)
    assert direct("all_gather", 4 << 20, 2) and not direct("all_gather", (4 << 20) - 4, 2)
    assert direct("all_gather", 2 << 20, 4) and not direct("all_gather", 1 << 20, 4)      # 6 / 3 MiB copied out
    assert direct("all_to_all", 8 << 20, 2) and not direct("all_to_all", 4 << 20, 2)      # 4 / 2 MiB per peer
    monkeypatch.setenv("JAX_NCCLX_NVLINK_DIRECT_MIN_BYTES", "0")
    assert direct("all_to_all", 16, 2, settings=config.current())
    monkeypatch.setenv("JAX_NCCLX_NVLINK_DIRECT", "0")
    assert not direct("all_reduce", 1 << 20, 4, two, settings=config.current())
    assert not direct("all_gather", 64 << 20, 4, settings=config.current())


def test_build_info():
    info = nx.build_info()
    assert info["cpu"] is True and info["jax_version"] == jax.__version__
    assert isinstance(info["cuda"], bool) and info["cuda_status"]
    assert info["ffi_api_version"][0] == 0


EMPTY_CALLS = {  # op -> (call on a [n, 0] shard, the global result's shape for n members)
    "all_reduce": (lambda v: nx.all_reduce(v, "x"), lambda n: (n * n, 0)),
    "all_gather": (lambda v: nx.all_gather(v, "x", axis=1, tiled=True), lambda n: (n * n, 0)),
    "reduce_scatter": (lambda v: nx.reduce_scatter(v, "x", scatter_dimension=0, tiled=True), lambda n: (n, 0)),
    "all_to_all": (lambda v: nx.all_to_all(v, "x", 0, 0, tiled=True), lambda n: (n * n, 0)),
    "ppermute": (lambda v: nx.ppermute(v, "x", [(0, 1), (1, 0)]), lambda n: (n * n, 0)),
    "all_to_allv_dynamic": (lambda v: nx.all_to_allv_dynamic(
        v, jnp.zeros((jax.lax.axis_size("x"),), jnp.int32), "x", max_recv_per_peer=0)[0], lambda n: (n * n, 0, 0)),
}


@pytest.mark.parametrize("op", sorted(EMPTY_CALLS))
def test_empty_arrays_are_defined(backend, op):
    """Zero-size operands run (no communication) and give zero-size results of the right shape."""
    mesh = jax.sharding.Mesh(np.asarray(backend[: min(4, len(backend))]), ("x",))
    n = mesh.size
    x = jnp.zeros((n * n, 0), jnp.float32)
    call, shape = EMPTY_CALLS[op]
    f = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    y = jax.block_until_ready(f(x))
    assert y.shape == shape(n) and y.dtype == jnp.float32


def test_both_native_modules_carry_one_contract():
    """The enums and limits Python reads come from the native modules (xla_ffi/common/contract.h): the CPU
    module's and the CUDA module's tables are the same, and every name the settings accept is one of them."""
    from jax_ncclx._src import config
    from jax_ncclx._src import lib

    native = lib.cpu_module().contract()
    assert contract.FAULT_KINDS == ("delay", "skip", "corrupt_counts", "corrupt_payload", "stall")
    assert contract.REDUCE_OPS == native["reduce_ops"] and set(contract.REDUCE_OPS) == {"sum", "max", "min"}
    assert contract.NVLINK_PROTOCOLS == ("ll128", "ll", "simple")
    assert set(contract.TRACE_KERNELS.values()) >= {"all_to_allv_dynamic", "all_reduce", "moe.combine"}
    assert (contract.MAX_CAPACITY, contract.MAX_EXPERTS, contract.MAX_NVLINK_RANKS) == (2**31 - 1, 2048, 8)
    with pytest.raises(ValueError, match="kind one of delay, skip, corrupt_counts, corrupt_payload, stall"):
        config.parse_faults("melt:rank=0,seq=1")
    cuda = lib.cuda_module_if_available()
    if cuda is not None:
        assert cuda.contract() == native


def test_cuda_handlers_are_looked_up_in_one_table():
    """The lowering finds every CUDA target in the CUDA module's handler table (no names built from parts):
    each communicating op has its NCCL handler and, where it has an NVLink kernel, a watched twin of it; the
    dense ops' NCCL handlers have command-buffer twins, watched too; and the table holds exactly the targets
    the module registers."""
    from jax_ncclx._src import lib

    module = lib.cuda_module_if_available()
    if module is None:
        pytest.skip("the handler table is the CUDA module's, which is built only where nvcc is")
    table = module.handler_table()
    assert sorted(t[4] for t in table) == sorted(module.registrations())
    assert len({t[:4] for t in table}) == len(table)
    dense = ("all_reduce", "all_gather", "all_to_all", "reduce_scatter", "ppermute")
    for op in (*dense, "all_to_allv_dynamic", "ragged_all_to_all"):
        assert lib.cuda_target(op, "nccl") == f"ncclx_{op}"
    for op in ("all_reduce", "all_gather", "all_to_all", "reduce_scatter", "all_to_allv_dynamic",
               "ragged_all_to_all", "moe_combine"):
        assert lib.cuda_target(op, "nvlink") and lib.cuda_target(op, "nvlink", watched=True)
    for op in dense:
        assert lib.cuda_target(op, "nccl", cmdbuf=True) and lib.cuda_target(op, "nccl", cmdbuf=True, watched=True)
    assert lib.cuda_target("all_to_allv_dynamic", "nccl", cmdbuf=True) is None
    assert lib.cuda_target("ppermute", "nvlink") is None
