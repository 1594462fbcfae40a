"""The benchmark scripts run end to end on CPU (--smoke) and write results whose jax_ncclx rows were checked
against XLA; timings are not judged here. The routing kernels' timer (a CUDA program) compiles, and the loopback
collectives' timer runs on one GPU."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import gpu_devices, gpu_skip_reason

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def run_smoke(script, out_dir, *extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, os.path.join(BENCHMARKS, script), "--smoke", "--out", str(out_dir),
                           *extra], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stem = os.path.splitext(script)[0]
    for suffix in (".json", ".md"):
        assert (out_dir / (stem + suffix)).exists()
    return json.loads((out_dir / (stem + ".json")).read_text())


@pytest.mark.slow  # a benchmark end to end in its own process
def test_collectives_smoke(tmp_path):
    document = run_smoke("collectives.py", tmp_path, "--sizes", "8,4K", "--impls", "xla,nx,nx-twoshot")
    rows = document["rows"]
    ops = ("all_reduce", "all_gather", "all_to_all", "reduce_scatter")
    assert {(r["op"], r["impl"]) for r in rows} == {(op, impl) for op in ops for impl in ("nx", "xla")} | {
        ("all_reduce", "nx-twoshot")}
    assert all(r["status"] == "ok" and r["verified"] and r["median_us"] > 0 for r in rows)
    assert all(r["path"] == ("xla" if r["impl"] == "xla" else "cpu") for r in rows)


@pytest.mark.slow  # a benchmark end to end in its own process
def test_all_to_allv_smoke(tmp_path):
    document = run_smoke("all_to_allv.py", tmp_path, "--tokens", "8", "--capacity-factor", "3",
                         "--variants", "nx_padded,nx_packed,nx_ragged,xla_all_to_all")
    assert document["sizes"][0]["capacity"] >= 3 * 8 * 4 // 8  # F times T * k / N (smoke: top-4, 8 devices)
    rows = {r["variant"]: r for r in document["rows"]}
    assert set(rows) == {"nx_padded", "nx_packed", "nx_ragged", "xla_all_to_all"}
    assert all(r["status"] == "ok" and r["median_us"] > 0 for r in rows.values())
    assert rows["nx_padded"]["verified"] and rows["nx_packed"]["verified"] and rows["nx_ragged"]["verified"]


@pytest.mark.slow  # a benchmark end to end in its own process
def test_all_to_allv_moe_smoke(tmp_path):
    """The moe variants and the XLA moe layer are verified before timing, and each moe round trip or dispatch
    carries its ratio to the XLA layer's."""
    moe_variants = ("nx_moe", "nx_moe_dispatch", "xla_moe", "xla_moe_dispatch")
    document = run_smoke("all_to_allv.py", tmp_path, "--tokens", "8", "--variants", ",".join(moe_variants))
    rows = {r["variant"]: r for r in document["rows"]}
    assert set(rows) == set(moe_variants)
    assert all(r["status"] == "ok" and r["verified"] and r["median_us"] > 0 for r in rows.values())
    assert rows["xla_moe"]["path"] == rows["xla_moe_dispatch"]["path"] == "xla"
    for variant, baseline in (("nx_moe", "xla_moe"), ("nx_moe_dispatch", "xla_moe_dispatch")):
        assert rows[variant]["vs_xla_moe"] == pytest.approx(rows[baseline]["median_us"] / rows[variant]["median_us"])


def import_common():
    sys.path.insert(0, BENCHMARKS)
    try:
        import common
    finally:
        sys.path.remove(BENCHMARKS)
    return common


@pytest.mark.slow  # a benchmark end to end in its own process
def test_a_terminated_run_writes_the_rows_it_measured(tmp_path):
    """SIGTERM (what `timeout` sends) mid-run: the rows measured so far are written, marked incomplete."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.Popen([sys.executable, os.path.join(BENCHMARKS, "all_to_allv.py"), "--smoke", "--sweep",
                            "--out", str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    line = ""
    deadline = threading.Timer(300, run.kill)  # a run that hangs without output ends the loop below
    deadline.start()
    try:
        for line in run.stdout:  # the first timed row, with most of the sweep still to run
            if line.rstrip().endswith(" ok"):
                break
        run.send_signal(signal.SIGTERM)
        output = line + run.communicate(timeout=300)[0]
    finally:
        deadline.cancel()
        run.kill()
    assert run.returncode != 0 and "ABORTED" in output, output[-3000:]
    document = json.loads((tmp_path / "all_to_allv.json").read_text())
    assert document["aborted"] == "SystemExit: stopped by SIGTERM"
    assert any(r["status"] == "ok" for r in document["rows"])
    assert len({r["tokens"] for r in document["rows"]}) < len(document["config"]["tokens"])
    assert "**Incomplete run**: it stopped early (SystemExit: stopped by SIGTERM)" in (
        tmp_path / "all_to_allv.md").read_text()


def test_run_then_write_writes_what_an_error_left():
    common = import_common()
    written = []
    common.run_then_write(lambda: None, lambda **extra: written.append(extra), lambda message: None)
    assert written == [{}]

    def measure():
        raise ValueError("out of memory\nmore lines")

    with pytest.raises(ValueError):
        common.run_then_write(measure, lambda **extra: written.append(extra), lambda message: None)
    assert written[1:] == [{"aborted": "ValueError: out of memory"}]
    with pytest.raises(ValueError):  # a process other than 0 writes nothing
        common.run_then_write(measure, lambda **extra: written.append(extra), lambda message: None, writer=False)
    assert len(written) == 2


@pytest.mark.slow  # three processes
def test_processes_launcher_passes_sigterm_on(tmp_path):
    """SIGTERM to the --processes launcher reaches every process, which then writes its rows and ends."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import argparse, pathlib, sys, time
        sys.path.insert(0, {BENCHMARKS!r})
        import common
        out = pathlib.Path({str(tmp_path)!r})
        if "--process-id" in sys.argv:
            pid = sys.argv[sys.argv.index("--process-id") + 1]
            common.stop_on_sigterm()
            (out / f"started{{pid}}").write_text("")
            try:
                time.sleep(120)
            except SystemExit:
                (out / f"stopped{{pid}}").write_text("")
                raise
        else:
            sys.exit(common.run_processes(argparse.Namespace(processes=2), []))
    """))
    run = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(600):  # both started, their handlers set
            if (tmp_path / "started0").exists() and (tmp_path / "started1").exists():
                break
            time.sleep(0.1)
        run.send_signal(signal.SIGTERM)
        output = run.communicate(timeout=60)[0]
    finally:
        run.kill()
    assert (tmp_path / "stopped0").exists() and (tmp_path / "stopped1").exists(), output[-3000:]
    assert run.returncode != 0


def test_sigterm_raises_system_exit_once_asked():
    common = import_common()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        common.stop_on_sigterm()
        with pytest.raises(SystemExit, match="stopped by SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode, long before this ends
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_results_header_names_the_commit_and_its_note():
    common = import_common()
    meta = {"num_devices": 2, "git": {"commit": "0123456789abcdef", "dirty": False}}
    assert "commit 0123456789ab," in common._meta_line(meta)
    meta["git"]["note"] = "a scratch build"
    assert "commit 0123456789ab (a scratch build)," in common._meta_line(meta)


@pytest.mark.slow  # a benchmark end to end in its own process
def test_launch_floor_smoke(tmp_path):
    rows = run_smoke("launch_floor.py", tmp_path, "--bytes", "8")["rows"]
    assert [r["impl"] for r in rows] == ["xla-kernel", "nx", "psum"]  # ffi-kernel and nx-watched are CUDA only
    assert all(r["median_us"] > 0 and r["x_psum"] > 0 and r["dispatch_us"] > 0 for r in rows)
    assert [r["ffi_targets"] for r in rows] == [[], ["ncclx_all_reduce"], []]


def nvcc_or_skip():
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, /usr/local/cuda/bin)")
    return nvcc


def build_cuda_tool(name, out_dir):
    root = os.path.dirname(BENCHMARKS)
    binary = str(out_dir / name)
    done = subprocess.run([nvcc_or_skip(), "-std=c++17", "-O3", "-arch=sm_90", "-I", os.path.join(root, "xla_ffi"),
                           os.path.join(root, "tools", name + ".cu"), "-o", binary],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return binary


@pytest.mark.slow  # nvcc, a minute each
@pytest.mark.parametrize("name", ["time_routing_kernels", "time_copy_rates", "time_decode_signal"])
def test_cuda_diagnostics_compile(tmp_path, name):
    """The CUDA diagnostics in tools/ include the kernels' sources or headers: they must keep compiling as those
    change (they run only on a GPU machine)."""
    build_cuda_tool(name, tmp_path)


@pytest.mark.gpu
def test_decode_signal_timer_runs(tmp_path):
    """tools/time_decode_signal.cu times every scheme at 16 and 128 rows and checks each copies the rows out
    whole (it exits non-zero otherwise)."""
    done = subprocess.run([build_cuda_tool("time_decode_signal", tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = [line.split() for line in done.stdout.splitlines()[1:]]
    assert {(int(r[0]), r[1]) for r in table} == {(rows, scheme) for rows in (16, 128)
                                                   for scheme in ("empty", "local", "flags.sys", "flags.gpu", "lines")}
    assert all(float(r[2]) > 0 for r in table)


@pytest.mark.gpu
def test_loopback_collectives_timer_runs(tmp_path):
    """tools/time_loopback_collectives.py (a diagnostic on one GPU) times every case on 2 logical ranks, each
    call healthy and traced, and writes its JSON."""
    reason = gpu_skip_reason(minimum=1)
    if reason:
        pytest.skip(reason)
    tool = os.path.join(os.path.dirname(BENCHMARKS), "tools", "time_loopback_collectives.py")
    done = subprocess.run([sys.executable, tool, str(tmp_path / "loopback.json"), "--ranks", "2", "--calls", "60"],
                          env=dict(os.environ, NCCL_NVLS_ENABLE="0"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads((tmp_path / "loopback.json").read_text())
    assert document["meta"]["platform"] == "gpu"
    results = document["results"]
    assert len(results) == 8 and all(r["ranks"] == 2 for r in results)
    assert all(0 < r["after_last_us"] <= r["span_us"] for r in results)


@pytest.mark.gpu
def test_loopback_moe_timer_times_both_layouts(tmp_path):
    """--moe with both layouts times dispatch and combine of each (the masked layout's combine both ways) on 2
    logical ranks, with the handshake split off every call's own time."""
    reason = gpu_skip_reason(minimum=1)
    if reason:
        pytest.skip(reason)
    tool = os.path.join(os.path.dirname(BENCHMARKS), "tools", "time_loopback_collectives.py")
    done = subprocess.run([sys.executable, tool, str(tmp_path / "moe.json"), "--ranks", "2", "--calls", "60",
                           "--moe", "16", "--moe-layout", "packed,masked", "--moe-calls", "20"],
                          env=dict(os.environ, NCCL_NVLS_ENABLE="0"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    moe = [r for r in json.loads((tmp_path / "moe.json").read_text())["results"] if r["op"].startswith("moe.")]
    assert sorted((r["layout"], r["op"]) for r in moe) == [
        ("masked", "moe.combine"), ("masked", "moe.combine (weights at combine)"), ("masked", "moe.dispatch"),
        ("packed", "moe.combine"), ("packed", "moe.dispatch")]
    assert all(0 < r["own_us"] <= r["after_last_us"] and r["handshake_us"] >= 0 for r in moe)


def test_ab_summary_lines_up_rows_across_runs(tmp_path):
    """tools/ab_summary.py (the end of tools/ab_trees.sh) pairs each row of A's runs with B's by its name, in
    run order, and leaves a row that did not finish out of the means."""
    def write(name, medians):
        xla_status = "ok" if medians[1] is not None else "timeout"
        rows = [{"tokens": 16, "variant": "nx_padded", "transport": "auto", "status": "ok", "median_us": medians[0]},
                {"tokens": 16, "variant": "xla_all_to_all", "transport": "xla", "status": xla_status,
                 "median_us": medians[1]}]
        (tmp_path / f"all_to_allv_{name}.json").write_text(json.dumps({"rows": rows}))

    write("a1", (10.0, 20.0))
    write("b1", (12.0, 21.0))
    write("a2", (11.0, 22.0))
    write("b2", (13.0, None))
    tool = os.path.join(os.path.dirname(BENCHMARKS), "tools", "ab_summary.py")
    done = subprocess.run([sys.executable, tool, str(tmp_path), "all_to_allv"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = {line.split(" | ")[0]: line for line in done.stdout.splitlines() if line.startswith("| 16")}
    assert lines["| 16, nx_padded, auto"] == "| 16, nx_padded, auto | 10.0 / 11.0 | 12.0 / 13.0 | 10.5 | 12.5 | 1.190 |"
    assert lines["| 16, xla_all_to_all, xla"] == ("| 16, xla_all_to_all, xla | 20.0 / 22.0 | 21.0 / - | 21.0 | 21.0 "
                                                  "| 1.000 |")


def run_one_process_per_gpu(script, out_dir, *extra):
    """benchmarks/<script> --processes N (one process per GPU) with few samples; the JSON process 0 wrote."""
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    n = len(gpu_devices())
    done = subprocess.run([sys.executable, os.path.join(BENCHMARKS, script), "--processes", str(n), "--unroll", "2",
                           "--pipeline", "2", "--iters", "2", "--out", str(out_dir), *extra],
                          env=dict(os.environ, NCCL_NVLS_ENABLE="0"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads((out_dir / (os.path.splitext(script)[0] + ".json")).read_text())
    assert document["meta"]["process_count"] == n and document["config"]["processes"] == n
    assert all(len(r["median_us_by_process"]) == n and min(r["median_us_by_process"]) > 0
               for r in document["rows"] if r["status"] == "ok")
    return document


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_collectives_one_process_per_gpu(tmp_path):
    """collectives.py --processes N: N processes, one GPU each, measure the same chains (NVLink kernels over CUDA
    IPC, the NCCL path plain and in command buffers) after checking each against jax.lax; process 0 writes."""
    rows = run_one_process_per_gpu("collectives.py", tmp_path, "--ops", "all_reduce,all_to_all", "--sizes", "8,64K",
                                   "--impls", "xla,nx,nx-nccl,nx-nccl-cmdbuf")["rows"]
    assert len(rows) == 2 * 2 * 4
    assert all(r["status"] == "ok" and r["verified"] and r["reps"] == 2 for r in rows)
    paths = {r["impl"]: r["path"] for r in rows if r["bytes"] == 8}
    assert paths == {"xla": "xla", "nx": "nvlink-1shot", "nx-nccl": "nccl", "nx-nccl-cmdbuf": "nccl"}, paths


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_all_to_allv_one_process_per_gpu(tmp_path):
    """all_to_allv.py --processes N: each process checks its own ranks' results, and all stop or go on together;
    the NVLink kernel reaches its peers through CUDA IPC."""
    rows = run_one_process_per_gpu("all_to_allv.py", tmp_path, "--tokens", "16", "--hidden", "256",
                                   "--variants", "nx_padded,nx_packed,xla_all_to_all,nx_moe")["rows"]
    outcome = {r["variant"]: (r["status"], r.get("path"), r.get("message")) for r in rows}
    assert outcome == {"nx_padded": ("ok", "nvlink", None), "nx_packed": ("ok", "nvlink", None),
                       "xla_all_to_all": ("ok", "xla", None), "nx_moe": ("ok", "nvlink", None)}, outcome
    assert all(r["verified"] for r in rows if r["variant"] != "xla_all_to_all")


@pytest.mark.slow  # a benchmark end to end in its own process
def test_processes_launcher_reports_a_failing_process(tmp_path):
    """--processes N starts N copies and ends with the first failure's exit code, printing the other processes'
    last lines: here on CPU every copy stops at once, as the run needs GPUs."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "collectives.py"), "--processes", "2",
                           "--sizes", "8", "--out", str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]  # whichever failed first: both exit 2
    assert "needs at least 2 GPUs" in output
    assert "---- process 1 (exit " in done.stdout  # its log, whether it failed or was stopped after process 0
    assert not list(tmp_path.iterdir())
