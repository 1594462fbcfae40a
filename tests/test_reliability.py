"""Timeouts that name the missing rank, injected faults, collective tracing and checksum mode.

Each test runs on the CPU backend and, where GPUs exist, on GPU (marked ``gpu``). A CPU collective whose peer
does not arrive fails inside the program; a GPU one stops waiting on the device (NVLink kernels) or is aborted
by the watchdog (NCCL), and the host reports it through ``nx.check_errors()`` and every later call.
"""

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ncclx as nx
from jax_ncclx._src import comm
from jax_ncclx._src import config
from jax_ncclx._src import health
from jax_ncclx._src import lib

from conftest import gpu_devices, gpu_skip_reason, run_command_buffer_worker
from helpers import SPECIAL_DTYPES, assert_bits_equal, random_array


@pytest.fixture(params=["cpu", pytest.param("gpu-nvlink", marks=pytest.mark.gpu),
                        pytest.param("gpu-nccl", marks=pytest.mark.gpu)])
def line(request, monkeypatch):
    """A one-axis mesh "x" of 4 CPU devices, or of every GPU with the NVLink kernels or with NCCL. Afterwards
    GPU communicators are destroyed (a fault leaves them unusable) and CPU call numbers restart (a rank that a
    fault sent on alone runs one ahead)."""
    monkeypatch.delenv("JAX_NCCLX_FAULT", raising=False)
    monkeypatch.setenv("JAX_NCCLX_TRACE", "1")
    if request.param == "cpu":
        yield jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:4]), ("x",))
        nx.shutdown()
        return
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", request.param.removeprefix("gpu-"))
    comm.destroy_all()
    yield jax.sharding.Mesh(np.asarray(gpu_devices()), ("x",))
    comm.destroy_all()


def on_gpu(mesh):
    return mesh.devices.flat[0].platform == "gpu"


def per_shard(mesh, fn, n_in=1, n_out=1):
    out = P("x") if n_out == 1 else (P("x"),) * n_out
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * n_in, out_specs=out, check_vma=False))


def next_seq(mesh, rank: int) -> int:
    """The sequence number ``rank``'s next call on ``mesh``'s axis gets: runs a traced all_reduce and reads it
    back. (Per rank: after a call that some ranks never joined, the ranks' numbers differ.)"""
    nx.trace.reset()
    # One call of each pattern the tests fault: NCCL connects its peers on first use, on the host, and a
    # missing peer there blocks the launch itself (reported, not aborted: see xla_ffi/common/watchdog.h).
    # ppermute always takes NCCL's point-to-point path, which the others may not have connected (NVLink).
    def warm_up(v):
        n = jax.lax.axis_size("x")
        v = nx.all_to_all(nx.all_gather(nx.all_reduce(v, "x"), "x", tiled=True), "x", 0, 0, tiled=True)
        return nx.ppermute(v, "x", [(i, (i + 1) % n) for i in range(n)])

    jax.block_until_ready(per_shard(mesh, warm_up)(jnp.ones((mesh.size * mesh.size, 4))))
    return max(r["seq"] for r in nx.trace.records() if r["rank"] == rank) + 1


def expect_fault(mesh, f, args, match):
    """Runs f(*args): on CPU it must raise matching `match`; on GPU it completes and the host reports it."""
    if not on_gpu(mesh):
        with pytest.raises(Exception, match=match):
            jax.block_until_ready(f(*args))
        return
    try:
        jax.block_until_ready(f(*args))
    except Exception as error:  # a late rank's handler may already see the fault
        assert re.search(match, str(error)), error
    with pytest.raises(nx.CollectiveError, match=match):
        nx.check_errors()
    with pytest.raises(Exception, match="unusable"):  # and every later call on the communicator fails
        jax.block_until_ready(f(*args))


def test_skipped_rank_is_named(line, monkeypatch):
    last = line.size - 1
    seq = next_seq(line, last)
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", "2")
    monkeypatch.setenv("JAX_NCCLX_FAULT", f"skip:rank={last},seq={seq}")
    f = per_shard(line, lambda v: nx.all_reduce(v, "x"))
    started = time.monotonic()
    expect_fault(line, f, (jnp.ones((line.size, 4)),), rf"rank\(s\) {last}\b")
    assert time.monotonic() - started < 60


def test_a_fault_past_the_ranks_is_a_warning(line, monkeypatch, caplog):
    """A fault whose rank the call's communicator lacks never applies: the lowering says so, and the call runs."""
    monkeypatch.setenv("JAX_NCCLX_FAULT", f"skip:rank={line.size + 5},seq=0")
    f = per_shard(line, lambda v: nx.all_reduce(v, "x"))
    with caplog.at_level(logging.WARNING, logger="jax_ncclx"):
        out = jax.block_until_ready(f(jnp.ones((line.size, 4))))
    np.testing.assert_array_equal(np.asarray(out), line.size)
    assert any(f"names rank {line.size + 5}, but all_reduce's communicator has ranks 0 to {line.size - 1}"
               in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_message_names_op_sequence_and_axis(line, monkeypatch):
    seq = next_seq(line, 0)
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", "2")
    monkeypatch.setenv("JAX_NCCLX_FAULT", f"skip:rank=0,seq={seq}")
    f = per_shard(line, lambda v: nx.all_gather(v, "x"))
    if on_gpu(line):
        match = r"(NVLink call #\d+|call #\d+) on communicator \d+ \(all_gather, axis 'x', call site \d+\)"
    else:
        match = r"all_gather: call #\d+ \(axis 'x', call site \d+, replica group 0\): .*rank\(s\) 0\b"
    expect_fault(line, f, (jnp.ones((line.size, 4)),), match)


def test_per_op_timeout_overrides_the_default(line, monkeypatch):
    seq = next_seq(line, 1)
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", "600")
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S_ALL_TO_ALL", "1")
    monkeypatch.setenv("JAX_NCCLX_FAULT", f"skip:rank=1,seq={seq}")
    f = per_shard(line, lambda v: nx.all_to_all(v, "x", 0, 0, tiled=True))
    started = time.monotonic()
    expect_fault(line, f, (jnp.ones((line.size * line.size, 2)),), r"rank\(s\) 1")
    assert time.monotonic() - started < 60


def _ragged_one_row_each(v):
    """ragged_all_to_all: every member sends row j of its [N, F] operand to member j, at row (sender) there."""
    n, me = jax.lax.axis_size("x"), jax.lax.axis_index("x")
    ones = jnp.ones((n,), jnp.int32)
    return nx.ragged_all_to_all(v, jnp.zeros_like(v), jnp.arange(n, dtype=jnp.int32), ones, ones * me, ones,
                                axis_name="x")


# The ops whose timeouts the tests above leave out, each with the per-op variables that govern it.
TIMED_ELSEWHERE = {
    "ppermute": (lambda v: nx.ppermute(v, "x", [(i, (i + 1) % jax.lax.axis_size("x"))
                                                for i in range(jax.lax.axis_size("x"))]), ("PPERMUTE",)),
    "reduce_scatter": (lambda v: nx.reduce_scatter(v, "x", scatter_dimension=0, tiled=True), ("REDUCE_SCATTER",)),
    "all_to_allv_dynamic": (lambda v: nx.all_to_allv_dynamic(v, jnp.ones((jax.lax.axis_size("x"),), jnp.int32),
                                                             "x", max_recv_per_peer=1)[0], ("ALL_TO_ALLV_DYNAMIC",)),
    "ragged_all_to_all": (_ragged_one_row_each, ("RAGGED_ALL_TO_ALL", "ALL_TO_ALL")),
    "moe.dispatch": (lambda v: nx.moe.dispatch(v, jnp.zeros((v.shape[0], 1), jnp.int32) + jax.lax.axis_index("x"),
                                               num_experts=jax.lax.axis_size("x"), axis_name="x",
                                               capacity=v.shape[0])[0], ("ALL_TO_ALLV_DYNAMIC",)),
}


# A 1 s timeout as each path reports it: the CPU rendezvous, the NVLink kernels' fault record, NCCL's watchdog
# (a peer that gave up first may make a member abandon the call instead).
ONE_SECOND_TIMEOUT = (r"did not arrive within 1 s|timed out after 1 s|has not finished 1 s after it could start|"
                      r"abandoned because a peer timed out")


@pytest.mark.parametrize("op", sorted(TIMED_ELSEWHERE))
def test_per_op_timeouts_govern_every_op(line, monkeypatch, op):
    """With a 60 s default, the op's own variables (docs/configuration.md names them) make a
    missing rank an error after their 1 s, well before the default. (Which rank an error names depends on the
    op: where it has two collectives, the skipped rank goes on to the second and may find its peers missing
    there; a member whose peer gave up first abandons the call.)"""
    fn, names = TIMED_ELSEWHERE[op]
    seq = next_seq(line, 1)
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", "60")
    for name in names:
        monkeypatch.setenv(f"JAX_NCCLX_TIMEOUT_S_{name}", "1")
    monkeypatch.setenv("JAX_NCCLX_FAULT", f"skip:rank=1,seq={seq}")
    f = per_shard(line, fn)
    started = time.monotonic()
    expect_fault(line, f, (jnp.ones((line.size * line.size, 2)),), ONE_SECOND_TIMEOUT)
    assert time.monotonic() - started < 30


def test_shutdown_restarts_call_numbers_after_a_fault(line, monkeypatch):
    """A rank that skipped ragged_all_to_all's first collective goes on to its second, which its peers never
    reach, so its call numbers on the group run one ahead of theirs. nx.shutdown(), the way out of a fault,
    starts every rank's numbers at 0 again (on GPU the fresh communicators do; on CPU it restarts them)."""
    seq = next_seq(line, 1)
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", "1")
    monkeypatch.setenv("JAX_NCCLX_FAULT", f"skip:rank=1,seq={seq}")
    f = per_shard(line, _ragged_one_row_each)
    expect_fault(line, f, (jnp.ones((line.size * line.size, 2)),), ONE_SECOND_TIMEOUT)
    monkeypatch.delenv("JAX_NCCLX_FAULT")
    nx.shutdown()
    nx.trace.reset()
    jax.block_until_ready(per_shard(line, lambda v: nx.all_reduce(v, "x"))(jnp.ones((line.size, 4))))
    assert sorted((r["rank"], r["seq"]) for r in nx.trace.records()) == [(rank, 0) for rank in range(line.size)]


@pytest.mark.parametrize("op", ["all_gather", "ragged_all_to_all"])
def test_cpu_program_runs_again_after_a_skipped_rank(monkeypatch, op):
    """On CPU the participants of a call meet per execution of the program (XLA's run id), so a rank that
    skipped a call, and in ragged_all_to_all went on to its second collective alone, leaves the next executions
    of the same jitted function intact: no nx.shutdown() needed, unlike a GPU communicator."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:4]), ("x",))
    n = mesh.size
    monkeypatch.setenv("JAX_NCCLX_TRACE", "1")
    seq = next_seq(mesh, 1)
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", "1")
    monkeypatch.setenv("JAX_NCCLX_FAULT", f"skip:rank=1,seq={seq}")
    x = np.arange(2.0 * n * n, dtype=np.float32).reshape(n * n, 2)
    if op == "all_gather":
        f, expected = per_shard(mesh, lambda v: nx.all_gather(v, "x", tiled=True)), np.tile(x, (n, 1))
    else:  # member i's row j lands on member j at row i
        f, expected = per_shard(mesh, _ragged_one_row_each), x.reshape(n, n, 2).transpose(1, 0, 2).reshape(n * n, 2)
    expect_fault(mesh, f, (x,), ONE_SECOND_TIMEOUT)
    for _ in range(2):
        np.testing.assert_array_equal(f(x), expected)
    nx.shutdown()  # rank 1's call numbers (not its meetings) ran one ahead after ragged_all_to_all: restart them


# Copies that outlast a 1 ms timeout (8 MiB per member, gathered through send_rows): a call may fail for a late
# arrival, but no member may leave while a peer still reads its buffers.
_SLOW_READS = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_ncclx as nx
mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:4]), ("x",))
rows = 1 << 19
@jax.jit
@jax.shard_map(mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x"))
def f(x, counts, index):
    return nx.all_to_allv_dynamic(x, counts[0], "x", max_recv_per_peer=rows // 4, send_rows=index[0])[0][None]
put = lambda a: jax.device_put(a, NamedSharding(mesh, P("x")))
args = (put(jnp.ones((4 * rows, 4))), put(jnp.full((4, 4), rows // 4, jnp.int32)),
        put(jnp.tile(jnp.arange(rows, dtype=jnp.int32), (4, 1))))
for _ in range(6):
    try:
        jax.block_until_ready(f(*args))
        print("completed", flush=True)
    except Exception as error:
        assert "did not arrive" in str(error) or "abandoned" in str(error), error
        print("timed out", flush=True)
"""


def test_cpu_members_never_leave_while_peers_read():
    """With a timeout shorter than the copies, the CPU rendezvous used to let a member that finished first
    give up waiting for the others to finish reading, and XLA freed buffers they still read (a segfault)."""
    env = dict(os.environ, JAX_NCCLX_TIMEOUT_S="0.001", JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    done = subprocess.run([sys.executable, "-c", _SLOW_READS], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.count("\n") == 6, done.stdout[-2000:] + done.stderr[-3000:]


def test_delay_past_the_timeout_names_the_late_rank(line, monkeypatch):
    seq = next_seq(line, 1)
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", "1")
    monkeypatch.setenv("JAX_NCCLX_FAULT", f"delay:rank=1,seq={seq},ms=3000")
    f = per_shard(line, lambda v: nx.all_reduce(v, "x"))
    expect_fault(line, f, (jnp.ones((line.size, 4)),), r"rank\(s\) 1")


@pytest.mark.gpu
def test_abort_waits_for_the_handler_queueing_on_the_communicator(monkeypatch):
    """An abort (the watchdog's, or check_errors' for a call another process found hung) that comes while a
    handler is between looking its NCCL communicator up and queueing work on it stops that rank only once the
    handler has returned, so NCCL never frees a communicator under a launch; other ranks stop at once. The
    handler is held there by a host delay; NCCL's memory shows whether its rank was freed yet."""
    reason = gpu_skip_reason(minimum=1)
    if reason:
        pytest.skip(reason)
    module = lib.cuda_module_if_available()
    monkeypatch.delenv("JAX_NCCLX_FAULT", raising=False)
    monkeypatch.setenv("JAX_NCCLX_TRACE", "1")
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "nccl")
    comm.destroy_all()
    mesh = jax.sharding.Mesh(np.asarray(gpu_devices()), ("x",))
    seq = next_seq(mesh, 0)
    comm_id = comm.communicator_for(mesh, "x")
    device_of = {rank: device for device, rank, _ in module.comm_info(comm_id)}

    def nccl_bytes(rank):
        return sum(s["nccl_init_bytes"] for s in nx.memory_stats()
                   if s["comm_id"] == comm_id and s["device"] == device_of[rank])

    assert all(nccl_bytes(rank) > 0 for rank in device_of)
    monkeypatch.setenv("JAX_NCCLX_FAULT", f"delay:rank=0,seq={seq},ms=3000")
    f = per_shard(mesh, lambda v: nx.all_reduce(v, "x")).lower(jnp.ones((mesh.size, 4))).compile()
    outcome = []

    def run():
        try:
            jax.block_until_ready(f(jnp.ones((mesh.size, 4))))
            outcome.append(None)
        except Exception as error:
            outcome.append(error)

    caller = threading.Thread(target=run)
    caller.start()
    time.sleep(1.0)  # rank 0's handler holds its communicator, asleep in the injected delay
    assert caller.is_alive(), outcome
    module.abort_comm(comm_id, "aborted by the test while rank 0 was queueing")
    assert nccl_bytes(0) > 0, "rank 0's communicator was freed while its handler was inside its call"
    assert all(nccl_bytes(rank) == 0 for rank in device_of if rank != 0)
    caller.join(timeout=60)
    assert not caller.is_alive()
    assert nccl_bytes(0) == 0, "the handler's end did not carry out the deferred abort"
    assert outcome and re.search("unusable: aborted by the test", str(outcome[0])), outcome
    with pytest.raises(nx.CollectiveError, match="aborted by the test"):
        nx.check_errors()
    comm.destroy_all()


def test_stall_on_cpu_acts_as_a_delay(monkeypatch):
    """``stall`` holds a GPU rank's stream; on CPU, where the host runs the call, it is a delay."""
    monkeypatch.delenv("JAX_NCCLX_FAULT", raising=False)
    monkeypatch.setenv("JAX_NCCLX_TRACE", "1")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:4]), ("x",))
    seq = next_seq(mesh, 2)
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", "1")
    monkeypatch.setenv("JAX_NCCLX_FAULT", f"stall:rank=2,seq={seq},ms=3000")
    f = per_shard(mesh, lambda v: nx.all_reduce(v, "x"))
    expect_fault(mesh, f, (jnp.ones((mesh.size, 4)),), r"rank\(s\) 2")


@pytest.mark.gpu
@pytest.mark.parametrize("mode, gpus", [("healthy", 1), ("stall", 1), ("eager", 1), ("skip", 2)])
def test_replayed_nccl_calls_are_watched(mode, gpus):
    """JAX_NCCLX_WATCH_REPLAYS=1: NCCL calls replayed from CUDA graphs are timed like eager ones. Replays
    queued back to back past the timeout are not mistaken for a hang; a replay stalled past it is named, its
    communicator revoked and the next execution refused; a rank that left the call out of its graph is named
    as missing (tests/replay_watch_worker.py)."""
    run_command_buffer_worker("replay_watch_worker.py", mode, minimum=gpus)


@pytest.mark.gpu
@pytest.mark.parametrize("watch", [False, True])
@pytest.mark.parametrize("target", ["ncclx_all_reduce_nvlink", "ncclx_all_reduce_cmdbuf"])
def test_watch_replays_gives_graph_handlers_their_prepare_stage(monkeypatch, target, watch):
    """JAX_NCCLX_WATCH_REPLAYS=1 lowers the calls that XLA may record into CUDA graphs (NVLink; NCCL with command
    buffers) to the targets with a prepare stage (it costs host time in every execution, so only then); either
    target computes the same."""
    reason = gpu_skip_reason(minimum=1)
    if reason:
        pytest.skip(reason)
    monkeypatch.delenv("JAX_NCCLX_FAULT", raising=False)
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "nvlink" if target.endswith("_nvlink") else "nccl")
    monkeypatch.setenv("JAX_NCCLX_NCCL_COMMAND_BUFFERS", "1")
    monkeypatch.setenv("JAX_NCCLX_WATCH_REPLAYS", "1" if watch else "0")
    mesh = jax.sharding.Mesh(np.asarray(gpu_devices()), ("x",))
    f = per_shard(mesh, lambda v: nx.all_reduce(v, "x"))
    x = jnp.arange(mesh.size * 4, dtype=jnp.float32).reshape(mesh.size, 4)
    suffix = "_watched" if watch else ""
    assert set(re.findall(r"ncclx_\w+", f.lower(x).as_text())) == {target + suffix}
    np.testing.assert_allclose(np.asarray(f(x)), np.tile(np.asarray(x).sum(0), (mesh.size, 1)))


@pytest.mark.gpu
def test_nvlink_hang_in_a_replay_fails_the_next_execution():
    """JAX_NCCLX_WATCH_REPLAYS=1: an NVLink kernel replayed from a CUDA graph that gives up waiting for a
    stalled rank names that rank, and the next execution fails before it runs (the NVLink handlers' prepare
    stage) instead of replaying on the aborted communicator (tests/replay_watch_worker.py nvlink)."""
    run_command_buffer_worker("replay_watch_worker.py", "nvlink", minimum=2)


def _late_peer_warnings(text):
    return [line for line in text.splitlines() if line.startswith("jax_ncclx: warning:")]


def test_late_peer_is_warned_about_once_and_the_call_completes(line, monkeypatch, capfd):
    """A rank later than the grace (JAX_NCCLX_WARN_AFTER_S) but well within the timeout: while its peers wait,
    one warning on stderr names the op, the call and the missing rank; the call then completes. With the
    grace at 0 nothing is printed. (The last rank is the late one: on GPU, ranks launched after a late one
    could be late too.)"""
    late = line.size - 1
    seq = next_seq(line, late)
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", "60")
    monkeypatch.setenv("JAX_NCCLX_WARN_AFTER_S", "0.3")
    monkeypatch.setenv("JAX_NCCLX_FAULT", f"delay:rank={late},seq={seq},ms=1500")
    f = per_shard(line, lambda v: nx.all_reduce(v, "x"))
    x = jnp.arange(line.size * 4, dtype=jnp.float32).reshape(line.size, 4)
    capfd.readouterr()
    np.testing.assert_array_equal(np.asarray(f(x))[0], np.asarray(x).sum(0))
    warnings = _late_peer_warnings(capfd.readouterr().err)
    if on_gpu(line):
        expected = (rf"call #{seq} on communicator \d+ \(all_reduce, axis 'x', call site \d+\) has not finished "
                    rf"0\.3 s after it could start on rank \d+ of {line.size}: rank\(s\) {late} never reached it; "
                    r"still waiting, until the timeout of 60 s")
    else:
        expected = (rf"all_reduce: call #{seq} \(axis 'x', call site \d+, replica group 0\): rank\(s\) {late} of "
                    rf"{line.size} have not arrived after 0\.3 s; still waiting, until the timeout of 60 s")
    assert len(warnings) == 1 and re.search(expected, warnings[0]), warnings

    monkeypatch.setenv("JAX_NCCLX_WARN_AFTER_S", "0")
    monkeypatch.setenv("JAX_NCCLX_FAULT", f"delay:rank={late},seq={seq + 1},ms=1000")
    f = per_shard(line, lambda v: nx.all_reduce(v, "x"))  # lowered anew: the grace is read at lowering
    np.testing.assert_array_equal(np.asarray(f(x))[0], np.asarray(x).sum(0))
    assert _late_peer_warnings(capfd.readouterr().err) == []


@pytest.mark.gpu
def test_nvlink_call_held_past_the_grace_is_warned_about(monkeypatch, capfd):
    """An NVLink call that cannot finish within the grace gets the warning too, from the watchdog (its kernels
    bound their own wait but say nothing before the timeout); the call then completes. One GPU is enough: a
    stall fault holds the stream of an axis of one member."""
    reason = gpu_skip_reason(minimum=1)
    if reason:
        pytest.skip(reason)
    monkeypatch.delenv("JAX_NCCLX_FAULT", raising=False)
    monkeypatch.setenv("JAX_NCCLX_TRACE", "1")
    monkeypatch.setenv("JAX_NCCLX_TRANSPORT", "nvlink")
    comm.destroy_all()
    try:
        mesh = jax.sharding.Mesh(np.asarray(gpu_devices()[:1]), ("x",))
        seq = next_seq(mesh, 0)
        monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", "60")
        monkeypatch.setenv("JAX_NCCLX_WARN_AFTER_S", "0.3")
        monkeypatch.setenv("JAX_NCCLX_FAULT", f"stall:rank=0,seq={seq},ms=1500")
        f = per_shard(mesh, lambda v: nx.all_reduce(v, "x"))
        x = jnp.arange(4, dtype=jnp.float32).reshape(1, 4)
        assert re.findall(r"ncclx_all_reduce\w*", f.lower(x).as_text()) == ["ncclx_all_reduce_nvlink"]
        capfd.readouterr()
        np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x))
        warnings = _late_peer_warnings(capfd.readouterr().err)
        expected = (rf"call #{seq} on communicator \d+ \(all_reduce, axis 'x', call site \d+\) has not finished "
                    r"0\.3 s after it could start on rank 0 of 1: every rank reached it, but the NVLink kernel "
                    r"has not completed it; still waiting, until the timeout of 60 s")
        assert len(warnings) == 1 and re.search(expected, warnings[0]), warnings
    finally:
        comm.destroy_all()


def test_warning_grace_reaches_the_handlers(line, monkeypatch):
    """JAX_NCCLX_WARN_AFTER_S reaches every handler as warn_ms (whole milliseconds, rounded up; default 20 s);
    a value that is not a number of seconds is refused, naming the variable."""
    x = jnp.ones((line.size, 4))
    monkeypatch.delenv("JAX_NCCLX_WARN_AFTER_S", raising=False)
    f = per_shard(line, lambda v: nx.all_reduce(v, "x"))
    assert re.findall(r"warn_ms = \d+", f.lower(x).as_text()) == ["warn_ms = 20000"]
    monkeypatch.setenv("JAX_NCCLX_WARN_AFTER_S", "0.0004")
    f = per_shard(line, lambda v: nx.all_reduce(v, "x"))
    assert re.findall(r"warn_ms = \d+", f.lower(x).as_text()) == ["warn_ms = 1"]
    monkeypatch.setenv("JAX_NCCLX_WARN_AFTER_S", "soon")
    with pytest.raises(ValueError, match=r"JAX_NCCLX_WARN_AFTER_S='soon' is not valid.*\(0: no warning\)"):
        config.current()


def test_delay_within_the_timeout_shows_in_the_trace(line, monkeypatch, tmp_path):
    """A late rank only slows the call down; the merged trace names it as the late rank."""
    seq = next_seq(line, 1)
    monkeypatch.setenv("JAX_NCCLX_FAULT", f"delay:rank=1,seq={seq},ms=300")
    f = per_shard(line, lambda v: nx.all_reduce(v, "x"))
    x = jnp.arange(line.size * 4, dtype=jnp.float32).reshape(line.size, 4)
    np.testing.assert_array_equal(np.asarray(f(x))[0], np.asarray(x).sum(0))
    path = nx.trace.dump(tmp_path / "trace.json")
    merged = nx.trace.merge([json.load(open(path))["jax_ncclx"]])
    call = next(e for e in merged if e["seq"] == seq)
    assert call["late_rank"] == 1 and call["never_started"] == [] and call["start_spread_us"] > 200_000, call


def test_trace_records_every_call(line, tmp_path):
    nx.trace.reset()
    f = per_shard(line, lambda v: nx.all_gather(nx.all_reduce(v, "x"), "x"))
    jax.block_until_ready(f(jnp.ones((line.size, 16), jnp.float32)))
    calls = nx.trace.records()
    assert sorted({c["op"] for c in calls}) == ["all_gather", "all_reduce"]
    assert len(calls) == 2 * line.size
    for c in calls:
        assert c["axis"] == "x" and c["size"] == line.size and c["bytes"] in (64, 64 * line.size)
        assert 0 < c["enqueue_ns"] <= c["start_ns"] + 1_000_000 and c["start_ns"] <= c["end_ns"], c
        assert c["dtype"] == "float32" and c["transport"] in ("cpu", "nvlink", "nccl") and c["algorithm"]
    for rank in range(line.size):  # per rank: the numbers of ranks differ after a call some never joined
        seqs = {c["op"]: c["seq"] for c in calls if c["rank"] == rank}
        assert seqs["all_gather"] == seqs["all_reduce"] + 1, calls
    summary = nx.trace.summary(calls)
    assert all(s["calls"] == line.size and s["p50_us"] <= s["p99_us"] for s in summary.values()), summary
    chrome = json.load(open(nx.trace.dump(tmp_path / "t.json")))
    slices = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 2 * line.size and all(e["dur"] >= 0 for e in slices)


def test_merge_tool_names_the_rank_that_never_started(line, monkeypatch, tmp_path):
    if not on_gpu(line):  # devices no other test groups this way: every rank's call numbers start equal
        line = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[4:8][::-1]), ("x",))
    skipped = 2 if line.size > 2 else 1
    seq = next_seq(line, skipped)
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", "1")
    monkeypatch.setenv("JAX_NCCLX_FAULT", f"skip:rank={skipped},seq={seq}")
    f = per_shard(line, lambda v: nx.all_reduce(v, "x"))
    try:
        jax.block_until_ready(f(jnp.ones((line.size, 4))))
    except Exception:  # CPU: the call fails; the trace still holds every rank's record
        pass
    path = nx.trace.dump(tmp_path / "rank_dump.json")
    proc = subprocess.run([sys.executable, "-m", "jax_ncclx.trace", "merge", path, "--json", str(tmp_path / "m.json")],
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(rf"NEVER STARTED: {skipped}\b", proc.stdout), proc.stdout
    report = json.load(open(tmp_path / "m.json"))
    assert next(e for e in report if e["seq"] == seq)["never_started"] == [skipped]


def test_summary_counts_a_timed_out_call_as_failed(monkeypatch):
    """CPU: the members that waited in vain end failed, left out of the percentiles; the skipped one never
    started. A call that completes counts as done."""
    monkeypatch.setenv("JAX_NCCLX_TRACE", "1")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:4]), ("x",))
    f = per_shard(mesh, lambda v: nx.all_reduce(v, "x"))
    nx.shutdown()  # call numbers from 0 on these devices
    nx.trace.reset()
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", "0.2")
    monkeypatch.setenv("JAX_NCCLX_FAULT", "skip:rank=3,seq=1")
    jax.block_until_ready(f(jnp.ones((4, 4))))
    with pytest.raises(Exception, match="DEADLINE_EXCEEDED"):
        jax.block_until_ready(f(jnp.ones((4, 4))))
    calls = nx.trace.records()
    assert sorted((c["seq"], c["rank"], c["failed"]) for c in calls if c["start_ns"]) == \
        [(0, r, False) for r in range(4)] + [(1, r, True) for r in range(3)], calls
    summary = nx.trace.summary(calls)["all_reduce/cpu/rendezvous"]
    assert (summary["calls"], summary["unfinished"], summary["failed"]) == (8, 1, 3), summary
    assert summary["max_us"] < 200_000, summary  # the percentiles are the finished call's, not the timeout's
    nx.shutdown()


def test_merge_takes_a_dump_file_its_json_or_its_part(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("JAX_NCCLX_TRACE", "1")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:4]), ("x",))
    nx.trace.reset()
    jax.block_until_ready(per_shard(mesh, lambda v: nx.all_reduce(v, "x"))(jnp.ones((4, 4))))
    path = nx.trace.dump(tmp_path / "dump.json")
    whole = json.load(open(path))
    merged = nx.trace.merge([path])
    assert [(e["op"], e["ranks"], e["never_started"]) for e in merged] == [("all_reduce", 4, [])]
    assert nx.trace.merge([whole]) == nx.trace.merge([whole["jax_ncclx"]]) == merged
    with caplog.at_level(logging.WARNING, logger="jax_ncclx"):
        nx.trace.merge([path, path])  # one dump twice: each rank's call twice
    assert any("hold two records of one rank" in r.getMessage() for r in caplog.records), caplog.records
    with pytest.raises(TypeError, match="trace.merge: expected a file written by jax_ncclx.trace.dump"):
        nx.trace.merge([{"traceEvents": []}])


def test_dump_with_tracing_off_warns(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("JAX_NCCLX_TRACE", raising=False)
    nx.trace.reset()
    with caplog.at_level("WARNING", logger="jax_ncclx"):
        path = nx.trace.dump(tmp_path / "empty.json")
    assert json.load(open(path))["jax_ncclx"]["calls"] == []
    assert any("tracing is off" in r.getMessage() and "JAX_NCCLX_TRACE=1" in r.getMessage()
               for r in caplog.records), caplog.records


def test_merge_tool_help_is_plain_text():
    proc = subprocess.run([sys.executable, "-m", "jax_ncclx.trace", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "Lines up the trace dumps" in proc.stdout, proc.stdout + proc.stderr
    assert "``" not in proc.stdout and ":func:" not in proc.stdout, proc.stdout


def test_tracing_off_records_nothing(line, monkeypatch):
    monkeypatch.setenv("JAX_NCCLX_TRACE", "0")
    nx.trace.reset()
    jax.block_until_ready(per_shard(line, lambda v: nx.all_reduce(v, "x"))(jnp.ones((line.size, 4))))
    assert nx.trace.records() == []


def test_corrupt_counts_are_clamped_and_reported(line, monkeypatch):
    """Rank 1's counts become huge negative and positive values: nothing lands out of place, and its dropped
    output reports the damage."""
    n, capacity, rows = line.size, 3, 8
    seq = next_seq(line, 1)
    monkeypatch.setenv("JAX_NCCLX_FAULT", f"corrupt_counts:rank=1,seq={seq}")
    x = jnp.arange(n * rows * 2, dtype=jnp.float32).reshape(n * rows, 2) + 1
    counts = jnp.ones((n * n,), jnp.int32)
    f = per_shard(line, lambda v, c: nx.all_to_allv_dynamic(v, c, "x", max_recv_per_peer=capacity), n_in=2,
                  n_out=3)
    y, recv, dropped = (np.asarray(a) for a in f(x, counts))
    y = y.reshape(n, n, capacity, 2)
    recv = recv.reshape(n, n)
    dropped = dropped.reshape(n, n)
    assert (dropped[1] >= 1 << 28).all() and (dropped[np.arange(n) != 1] == 0).all(), dropped
    assert ((0 <= recv) & (recv <= capacity)).all(), recv
    for dest in range(n):
        for source in range(n):
            got = recv[dest, source]
            assert (y[dest, source, got:] == 0).all()
            if source != 1:  # a healthy source's one row for dest, whole
                assert got == 1, recv
                np.testing.assert_array_equal(y[dest, source, 0], np.asarray(x)[source * rows + dest])


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_counts_stay_bounded_after_a_skipped_rank(line, monkeypatch, layout):
    """NVLink path: the senders write recv_counts into their peers, so a source that never joins a call wrote
    nothing there. After a call where every source sent capacity rows, the timed-out call's recv_counts must
    not keep those: the missing source's counts are zero and every count stays within [0, C]. (Whether the
    timed-out call's buffer still held the earlier counts is up to XLA's allocator; the kernel zeroes the
    missing source's counts either way.)"""
    if line.devices.flat[0].platform != "gpu" or config.current().transport != "nvlink":
        pytest.skip("a property of the NVLink all_to_allv kernel (CPU raises; NCCL outputs are undefined)")
    n, capacity, skipped = line.size, 3, line.size - 1

    def exchange(v, c):
        return nx.all_to_allv_dynamic(v, c, "x", max_recv_per_peer=capacity, layout=layout)[:2]

    x = jnp.ones((n * n * capacity, 2), jnp.float32)
    full = jnp.full((n * n,), capacity, jnp.int32)
    assert (np.asarray(per_shard(line, exchange, n_in=2, n_out=2)(x, full)[1]) == capacity).all()
    seq = next_seq(line, skipped)
    monkeypatch.setenv("JAX_NCCLX_TIMEOUT_S", "2")
    monkeypatch.setenv("JAX_NCCLX_FAULT", f"skip:rank={skipped},seq={seq}")
    faulted = per_shard(line, exchange, n_in=2, n_out=2)  # faults apply to programs compiled from now on
    recv = np.asarray(faulted(x, full)[1]).reshape(n, n)[:skipped]  # the skipped rank wrote no outputs
    assert ((0 <= recv) & (recv <= capacity)).all(), recv
    assert (recv[:, skipped] == 0).all(), recv
    with pytest.raises(nx.CollectiveError, match=rf"rank\(s\) {skipped}\b"):
        nx.check_errors()


CHECKSUMMED = {
    "all_gather": (lambda v: nx.all_gather(v, "x"), (4, 8)),
    "all_to_all": (lambda v: nx.all_to_all(v, "x", 0, 0, tiled=True), (16, 8)),
    "ppermute": (lambda v: nx.ppermute(v, "x", [(i, (i + 1) % jax.lax.axis_size("x"))
                                                  for i in range(jax.lax.axis_size("x"))]), (4, 8)),
    "all_reduce": (lambda v: nx.all_reduce(v, "x"), (4, 8)),
    "all_to_allv_dynamic": (lambda v: nx.all_to_allv_dynamic(v, jnp.full((jax.lax.axis_size("x"),), 2, jnp.int32),
                                                             "x", max_recv_per_peer=2)[0], (16, 8)),
    # Rows gathered on the way, in reverse, one index outside x: the checksum covers the gathered rows.
    "all_to_allv_dynamic[send_rows]": (
        lambda v: nx.all_to_allv_dynamic(v, jnp.full((jax.lax.axis_size("x"),), 2, jnp.int32), "x",
                                         max_recv_per_peer=2, send_rows=jnp.arange(v.shape[0])[::-1] - 1)[0],
        (16, 8)),
    # Every clamp of the plan at once: negative counts, two chunks per peer, more than capacity, past the end.
    "all_to_allv_dynamic[clamped]": (
        lambda v: nx.all_to_allv_dynamic(v, _clamped_counts(jax.lax.axis_size("x")), "x", max_recv_per_peer=3)[0],
        (16, 8)),
}


def _clamped_counts(size):
    """int32 [size, 2] that differ from rank to rank: -2 ... 6 rows per chunk."""
    rank = jax.lax.axis_index("x")
    return (jnp.arange(2 * size, dtype=jnp.int32).reshape(size, 2) * 5 + 3 * rank) % 9 - 2


@pytest.mark.parametrize("dtype", [jnp.float32, *SPECIAL_DTYPES])
@pytest.mark.parametrize("op", sorted(CHECKSUMMED))
def test_checksum_mode_passes_clean_data(line, monkeypatch, op, dtype):
    """Checksum mode finds nothing wrong with clean data and leaves the results as they are without it."""
    fn, shape = CHECKSUMMED[op]
    if op == "all_reduce" and dtype == jnp.bool_:
        fn = lambda v: nx.all_reduce(v, "x", "max")  # noqa: E731 - a sum of booleans is int32, no longer bool
    x = random_array((line.size * shape[0] // 4 * 4, shape[1]), dtype)
    monkeypatch.delenv("JAX_NCCLX_CHECKSUM", raising=False)
    plain = np.asarray(per_shard(line, fn)(x))
    monkeypatch.setenv("JAX_NCCLX_CHECKSUM", "1")
    assert_bits_equal(per_shard(line, fn)(x), plain)
    nx.check_errors()


@pytest.mark.parametrize("op", sorted(CHECKSUMMED))
def test_checksum_mode_catches_a_corrupted_payload(line, monkeypatch, op):
    seq = next_seq(line, 1)
    monkeypatch.setenv("JAX_NCCLX_CHECKSUM", "1")
    monkeypatch.setenv("JAX_NCCLX_FAULT", f"corrupt_payload:rank=1,seq={seq}")
    fn, shape = CHECKSUMMED[op]
    x = jnp.asarray(np.random.default_rng(0).normal(size=(line.size * shape[0] // 4 * 4, shape[1])), jnp.float32)
    jax.block_until_ready(per_shard(line, fn)(x))
    culprit = (r"rank \d+ sees a result different from the majority on rank\(s\) \[1\]" if op == "all_reduce"
               else r"rank 1 received corrupted data from rank\(s\) \[\d+\]")
    name = op.split("[")[0]
    with pytest.raises(nx.CollectiveError, match=rf"checksum mismatch in {name} on axis 'x': {culprit}"):
        nx.check_errors()
    nx.check_errors()  # reported once


def test_bad_fault_spec_is_refused(monkeypatch):
    monkeypatch.setenv("JAX_NCCLX_FAULT", "explode:rank=1")
    with pytest.raises(ValueError, match="JAX_NCCLX_FAULT: cannot parse 'explode:rank=1'"):
        config.current()
    assert config.parse_faults("skip:rank=2,seq=3; delay:rank=0,seq=5,ms=20") == (
        config.Fault("skip", 2, 3), config.Fault("delay", 0, 5, 20))
    assert config.parse_faults("stall:rank=1,seq=4,ms=300") == (config.Fault("stall", 1, 4, 300),)
    for bad in ("skip:rank=1,seq=5-3", "skip:rank=1,seq=-3", "skip:rank=1,seq=2-", "skip:rank=1,seq=0-9999"):
        with pytest.raises(ValueError, match="JAX_NCCLX_FAULT: (cannot parse|more than)"):
            config.parse_faults(bad)


def test_fault_ranges_cover_every_call_and_read_back_compactly():
    spec = "stall:rank=0,seq=1-63,ms=300;skip:rank=2,seq=3;delay:rank=0,seq=5-6,ms=20"
    faults = config.parse_faults(spec)
    assert [f.seq for f in faults if f.kind == "stall"] == list(range(1, 64))
    assert faults[63:] == (config.Fault("skip", 2, 3), config.Fault("delay", 0, 5, 20), config.Fault("delay", 0, 6, 20))
    assert config.describe_faults(faults) == spec
    assert config.describe_faults(config.parse_faults("skip:rank=1,seq=4;skip:rank=1,seq=6")) == \
        "skip:rank=1,seq=4;skip:rank=1,seq=6"


class _FakeStore:
    """JAX's distributed client as _check_late_calls uses it: a dict with directory reads."""

    def __init__(self, entries=()):
        self.values = dict(entries)

    def key_value_set(self, key, value):
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


class _FakeWatchdogModule:
    """The CUDA module's watchdog bindings, with one call (#5 on communicator 7) that finished late."""

    def __init__(self):
        self.aborted = {}

    def watch_now(self):
        pass

    def faults(self):
        return list(self.aborted.items())

    def watchdog_state(self):
        return [(7, 1, 5)], [], [(7, 5, "call #5 on communicator 7 (all_reduce) finished only 2.9 s after ...")]

    def abort_comm(self, comm_id, message):
        self.aborted[comm_id] = message


@pytest.mark.parametrize("peer_reported", [True, False])
def test_late_call_is_checked_with_the_other_processes(monkeypatch, peer_reported):
    """A call that finished only near its timeout (a peer's abort can end an NCCL kernel early without any
    error) fails here when another process published its progress for it, and passes when none did; either
    way this process publishes how far it got, once."""
    group = (0, 1, 2, 3)
    store = _FakeStore({health._progress_key(group, 5) + "0": json.dumps({0: 5})} if peer_reported else {})
    module = _FakeWatchdogModule()
    monkeypatch.setattr(health.compat, "distributed_client", lambda: store)
    monkeypatch.setattr(health.jax, "process_index", lambda: 1)
    monkeypatch.setattr(health, "_PROGRESS_WAIT_S", 0.2)
    monkeypatch.setattr(health.comm, "group_devices", {7: group}.get)
    monkeypatch.setattr(health, "_late_calls_checked", set())
    monkeypatch.setattr(health, "_progress_published", set())
    assert health._check_late_calls(module) == ({7: 5} if peer_reported else {})
    assert json.loads(store.values[health._progress_key(group, 5) + "1"]) == {"1": 5}
    if peer_reported:
        assert re.search(r"call #5 on communicator 7 .*process\(es\) 0 found it hung", module.aborted[7])
    assert module.aborted == {} or peer_reported
    assert health._check_late_calls(module) == {}  # asked once
