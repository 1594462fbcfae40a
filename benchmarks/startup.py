"""Start-up cost of jax_ncclx against XLA's own collectives: time to the first collective and GPU memory.

Every case runs in fresh processes (start-up only happens once per process): one process driving every GPU,
or one process per GPU (bootstrapped through jax.distributed). Per case and process:

- ``first_s``: from the first device use (after ``import jax``; with several processes, from before
  ``jax.distributed.initialize``) until the first all_reduce of 8 floats has completed, compilation included;
  xla = ``jax.lax.psum``, nx = ``nx.all_reduce`` (which makes its communicator while it compiles);
  ``first_call_s``: that first collective call alone (compile, communicator, run), after a warm-up program
  without collectives (CUDA context, XLA's allocator);
- ``init_s`` and ``idle_mib`` (case ``nx-init``): ``nx.init(mesh)`` alone, the communicators of every axis,
  and the device memory it added (an idle communicator; ``nccl_init_mib``: the part ``nx.memory_stats()``
  attributes to ``ncclCommInitRank``); ``second_idle_mib``: what a second idle
  communicator over the same GPUs (in reverse order) adds, i.e. the per-communicator part;
- ``comm_mib``: device memory the first collective added, per GPU, measured from after the warm-up
  (cudaMemGetInfo, so NCCL's own buffers count along with XLA's); for nx also the total after the first call
  of each other op (``after_<op>_mib``) and what jax_ncclx's symmetric memory holds (``nx_held_mib``,
  ``nx.memory_stats()``).

    python benchmarks/startup.py                  # every GPU; one process, and one process per GPU
    python benchmarks/startup.py --modes one      # one process only
    python benchmarks/startup.py --from-json benchmarks/results/startup_4gpu.json   # redo the .md / .png

Results go to benchmarks/results/startup_<N>gpu.{json,md,png}. GPU only.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import common

CASES = ("xla", "nx", "nx-init")
MODES = ("one", "per-gpu")
OPS_AFTER = ("all_gather", "reduce_scatter", "all_to_all", "ppermute", "all_to_allv_dynamic")
COLUMNS = [
    ("case", "case", 8, ""), ("mode", "processes", 9, ""), ("gpus", "GPUs", 4, "d"),
    ("first_s", "first s", 8, ".2f"), ("first_call_s", "1st call s", 10, ".2f"), ("init_s", "init s", 7, ".2f"),
    ("idle_mib", "idle MiB", 8, ".1f"), ("nccl_init_mib", "NCCL init MiB", 13, ".1f"),
    ("second_idle_mib", "2nd idle MiB", 12, ".1f"),
    ("comm_mib", "comm MiB", 9, ".1f"),
    ("nx_held_mib", "nx MiB", 7, ".2f"),
] + [(f"after_{op}_mib", f"+{op} MiB", 10, ".1f") for op in OPS_AFTER]


def worker(case: str, process_id: int, num_processes: int, port: int):
    """One process of one case: prints one JSON line with its measurements."""
    import jax

    started = time.perf_counter()
    if num_processes > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id,
                                   local_device_ids=[process_id])
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ncclx as nx
    from jax_ncclx._src import lib

    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.asarray(devices), ("x",))
    n = len(devices)
    cuda = lib.cuda_module()
    local = [d.local_hardware_id for d in jax.local_devices()]
    used = lambda: [cuda.device_memory_used(d) for d in local]  # noqa: E731
    mib = lambda after, before: max(a - b for a, b in zip(after, before)) / 2**20  # noqa: E731

    def run(fn, *shapes_dtypes):
        arrays = [jax.make_array_from_callback(shape, NamedSharding(mesh, P("x")),
                                               lambda i, s=shape, d=dtype: np.ones(s, d)[i])
                  for shape, dtype in shapes_dtypes]
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * len(arrays), out_specs=P("x"),
                                  check_vma=False))
        return jax.block_until_ready(f(*arrays))

    result = dict(case=case, process=process_id, gpus=n)
    run(lambda v: v * 2, ((n, 8), np.float32))  # CUDA context, XLA's allocator and kernels: not the collective's
    before = used()
    if case == "nx-init":
        t = time.perf_counter()
        nx.init(mesh)
        result["init_s"] = time.perf_counter() - t
        result["idle_mib"] = mib(used(), before)
        result["nccl_init_mib"] = max(s["nccl_init_bytes"] for s in nx.memory_stats()) / 2**20
        # A second communicator (the same GPUs in reverse order): what each further communicator costs,
        # apart from what NCCL spends once per process (its device code, its first communicator's set-up).
        after_first = used()
        nx.init(jax.sharding.Mesh(np.asarray(devices[::-1]), ("x",)))
        result["second_idle_mib"] = mib(used(), after_first)
    reduce = (lambda v: jax.lax.psum(v, "x")) if case == "xla" else (lambda v: nx.all_reduce(v, "x"))
    t = time.perf_counter()
    run(reduce, ((n, 8), np.float32))
    result["first_call_s"] = time.perf_counter() - t
    result["first_s"] = time.perf_counter() - started
    result["comm_mib"] = mib(used(), before)
    if case == "nx":
        ops = {
            "all_gather": ((lambda v: nx.all_gather(v, "x", tiled=True)), ((n, 8), np.float32)),
            "reduce_scatter": ((lambda v: nx.reduce_scatter(v, "x", tiled=True)), ((n * n, 8), np.float32)),
            "all_to_all": ((lambda v: nx.all_to_all(v, "x", 0, 0, tiled=True)), ((n * n, 8), np.float32)),
            "ppermute": ((lambda v: nx.ppermute(v, "x", [(i, (i + 1) % n) for i in range(n)])),
                         ((n, 8), np.float32)),
            "all_to_allv_dynamic": ((lambda v: nx.all_to_allv_dynamic(
                v, jnp.ones((n,), jnp.int32), "x", max_recv_per_peer=4)[0]), ((n * 4 * n, 1024), np.float32)),
        }
        for op, (fn, shape_dtype) in ops.items():
            run(fn, shape_dtype)
            result[f"after_{op}_mib"] = mib(used(), before)
        held = [s for s in nx.memory_stats() if s["device"] in local]
        result["nx_held_mib"] = max((s["symmetric_data_bytes"] + s["control_bytes"] for s in held), default=0) / 2**20
    print("RESULT " + json.dumps(result), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(case: str, mode: str, gpus: int, log) -> dict:
    """Runs one case in fresh processes; returns the slowest process's times and the largest memory."""
    processes = gpus if mode == "per-gpu" else 1
    port = free_port()
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", NCCL_NVLINK_MULTICAST_ENABLE="0",
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", case, str(pid), str(processes), str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for pid in range(processes)]
    results = []
    for pid, proc in enumerate(procs):
        out = proc.communicate(timeout=600)[0]
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{case} ({mode}) process {pid} failed:\n{out[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    row = dict(case=case, mode=mode, gpus=gpus, processes=processes)
    for key in results[0]:
        if key.endswith("_s") or key.endswith("_mib"):
            row[key] = max(r[key] for r in results if key in r)
    log(f"{case} ({mode}): first collective after {row['first_s']:.2f} s, {row['comm_mib']:.1f} MiB")
    return row


def plot(plt, rows):
    figure, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['case']}\n{r['mode']}" for r in rows]
    ax.bar(range(len(rows)), [r["first_s"] for r in rows])
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("seconds to the first completed collective")
    ax.grid(True, axis="y", alpha=0.3)
    return figure


def main(argv=None):
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        case, pid, processes, port = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        return worker(case, pid, processes, port)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma separated subset of {','.join(MODES)}")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma separated subset of {','.join(CASES)}")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    parser.add_argument("--from-json", type=Path, help="rewrite the .md and .png of an earlier run's JSON")
    args = parser.parse_args(argv)
    if args.from_json:
        document = json.loads(args.from_json.read_text())
        return write(document["name"], document["rows"], document["meta"], args.out, common.Progress())
    import jax

    try:
        gpus = len(jax.devices("gpu"))
    except RuntimeError:
        gpus = 0
    if gpus < 2:
        parser.error("needs at least 2 GPUs")
    log = common.Progress()
    table = common.TablePrinter(COLUMNS)
    rows = []
    for mode in args.modes.split(","):
        for case in args.cases.split(","):
            row = launch(case, mode, gpus, log)
            rows.append(row)
            table.row(row)
    xla = {r["mode"]: r["first_s"] for r in rows if r["case"] == "xla"}
    for r in rows:
        if r["case"] != "xla" and r["mode"] in xla:
            r["first_vs_xla"] = r["first_s"] / xla[r["mode"]]
    write(f"startup_{gpus}gpu", rows, common.metadata(), args.out, log)


def write(name, rows, meta, out_dir, log):
    common.write_results(
        name, rows, meta, plot, out_dir=out_dir,
        columns=[(k, h, f) for k, h, _, f in COLUMNS] + [("first_vs_xla", "first / xla", ".2f")],
        title="jax_ncclx start-up vs XLA", notes=__doc__.split("\n\n")[1], log=log)


if __name__ == "__main__":
    sys.exit(main())
