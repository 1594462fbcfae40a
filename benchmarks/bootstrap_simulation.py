"""How jax_ncclx's communicator bootstrap scales, simulated on the CPU for up to 100,000 ranks.

Every simulated process runs the same code ``jax_ncclx._src.comm`` runs (``jax_ncclx._src.bootstrap``): it
works out from the mesh shape which axis groups its devices are in, and the process holding each group's rank 0
(for a large group, each of its roots) makes a (fake) NCCL unique id and publishes it in a (counting)
key-value store that the other members read.
Afterwards the simulation checks that every group's members got the same id and ranks 0..G-1 exactly once.

It reports, per mesh and process layout: key-value operations per process (max and mean), the store's total,
and how many mesh positions a process had to look at (its own devices, once per axis), against what a
membership all-gather would move per rank (``ncclCommSplit`` exchanges every rank's colour and key: N entries).
Only the bootstrap logic is simulated: ``ncclCommInitRank`` itself (NCCL's own bootstrap inside a group) is not.

    python benchmarks/bootstrap_simulation.py                      # 8 .. 100,000 ranks, JSON/MD/PNG in results/
    python benchmarks/bootstrap_simulation.py --ranks 8,1024 --out /tmp/sim
"""

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import common

from jax_ncclx._src import bootstrap
from jax_ncclx._src import config

NAME = "bootstrap_simulation"
ONE_ROOT = config.Config(init_ranks_per_root=0)  # ncclCommInitRank for every group, for comparison
COLUMNS = [
    ("ranks", "ranks", 8, "d"), ("mesh", "mesh", 14, ""), ("per_process", "dev/proc", 8, "d"),
    ("processes", "processes", 9, "d"), ("roots_max", "roots", 5, "d"), ("kv_ops_max", "kv ops max", 10, "d"),
    ("kv_ops_max_one_root", "1-root kv ops", 13, "d"),
    ("kv_ops_mean", "kv ops mean", 11, ".2f"), ("kv_total", "kv total", 9, "d"),
    ("positions_max", "positions max", 13, "d"), ("allgather_entries", "split a-g/rank", 14, "d"),
    ("groups", "groups", 7, "d"), ("seconds", "sim s", 7, ".2f"),
]


class CountingStore(bootstrap.KeyValueStore):
    """A key-value store that counts each process's operations; ``get`` of a missing key is an error (the
    simulation runs every group's root before its readers, as the blocking get would wait for it)."""

    def __init__(self):
        self.values = {}
        self.ops = {}
        self.caller = None

    def set(self, key, value):
        assert key not in self.values, f"{key} set twice"
        self.values[key] = value
        self.ops[self.caller] = self.ops.get(self.caller, 0) + 1

    def get(self, key):
        self.ops[self.caller] = self.ops.get(self.caller, 0) + 1
        return self.values[key]


def meshes(ranks: int):
    """(name, shape) of the meshes simulated at this size: data x tensor parallel, and, where it divides,
    pipeline x expert x tensor."""
    yield "dp x tp", (ranks // 8, 8)
    if ranks % 32 == 0:
        yield "pp x ep x tp", (ranks // 32, 4, 8)


def simulate(shape: tuple[int, ...], per_process: int, settings: config.Config = config.Config()) -> dict:
    """Runs every process's bootstrap of every axis of a mesh of ``shape`` whose devices are laid out
    ``per_process`` to a process in mesh order, with ``settings``' roots per communicator (default: the
    defaults, one root up to 1024 ranks, then one per 1024 ranks up to 32)."""
    ranks = 1
    for extent in shape:
        ranks *= extent
    processes = ranks // per_process
    process_of = lambda position: position // per_process  # noqa: E731
    store = CountingStore()
    ids = itertools.count()
    positions_seen = [0] * processes
    joined = {}  # (axis, group key) -> {rank: ids}
    groups_total = 0
    for axis in range(len(shape)):
        plans = []
        for process in range(processes):
            local = range(process * per_process, (process + 1) * per_process)
            positions_seen[process] += len(local)
            plans.append(bootstrap.axis_groups(shape, axis, local, process_of, settings.init_roots(shape[axis])))
        # Every process publishes before any reads: what comm.py does, and what the blocking get orders.
        made = []
        for process, groups in enumerate(plans):
            store.caller = process
            made.append([bootstrap.publish_ids(f"sim/{group.key}", group, process, store,
                                               lambda: next(ids).to_bytes(8, "little")) for group in groups])
        for process, groups in enumerate(plans):
            store.caller = process
            for group, own in zip(groups, made[process]):
                group_ids = tuple(bootstrap.read_ids(f"sim/{group.key}", group, store, own))
                seen = joined.setdefault((axis, group.key), {})
                for rank, _ in group.members:
                    assert rank not in seen, f"rank {rank} of {group.key} joined twice"
                    seen[rank] = group_ids
        groups_total += sum(1 for key in joined if key[0] == axis)
    for (axis, key), members in joined.items():
        assert sorted(members) == list(range(shape[axis])), f"{key}: ranks {sorted(members)}"
        assert len(set(members.values())) == 1, f"{key}: members got different ids"
        roots = settings.init_roots(shape[axis])
        assert len(next(iter(members.values()))) == roots, f"{key}: expected {roots} root id(s)"
    ops = [store.ops.get(p, 0) for p in range(processes)]
    return dict(ranks=ranks, per_process=per_process, processes=processes, kv_ops_max=max(ops),
                kv_ops_mean=statistics.fmean(ops), kv_total=sum(ops), positions_max=max(positions_seen),
                allgather_entries=ranks, groups=groups_total)


def plot(plt, rows):
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (mesh, per_process), group in itertools.groupby(sorted(rows, key=lambda r: (r["mesh"], r["per_process"],
                                                                                  r["ranks"])),
                                                        key=lambda r: (r["mesh"], r["per_process"])):
        group = list(group)
        label = f"{mesh}, {per_process} dev/proc"
        axes[0].plot([r["ranks"] for r in group], [r["kv_ops_max"] for r in group], marker="o", label=label)
        axes[1].plot([r["ranks"] for r in group], [r["positions_max"] for r in group], marker="o", label=label)
    ranks = sorted({r["ranks"] for r in rows})
    axes[1].plot(ranks, ranks, "k--", label="membership all-gather (N per rank)")
    for ax, title in zip(axes, ("key-value operations per process (max)", "mesh positions examined per process")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7)
    return figure


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="8,64,512,4096,32768,100000",
                        help="mesh sizes, comma separated (multiples of 8)")
    parser.add_argument("--per-process", default="8,1", help="devices per process, comma separated")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    log = common.Progress()
    table = common.TablePrinter(COLUMNS)
    rows = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        if ranks % 8:
            parser.error(f"--ranks: {ranks} is not a multiple of 8")
        for name, shape in meshes(ranks):
            for per_process in (int(p) for p in args.per_process.split(",")):
                started = time.perf_counter()
                row = dict(simulate(shape, per_process), mesh=name, shape=list(shape),
                           roots_max=max(config.Config().init_roots(extent) for extent in shape),
                           kv_ops_max_one_root=simulate(shape, per_process, ONE_ROOT)["kv_ops_max"])
                row["seconds"] = time.perf_counter() - started
                rows.append(row)
                table.row(row)
    meta = common.metadata()  # the simulation runs on the CPU; no device is used
    common.write_results(
        NAME, rows, meta, plot, out_dir=args.out, columns=[(k, h, f) for k, h, _, f in COLUMNS],
        title="jax_ncclx bootstrap at scale (simulated)", log=log,
        notes="Every process of every mesh runs jax_ncclx's bootstrap code (`jax_ncclx/_src/bootstrap.py`) for "
              "every mesh axis against a counting key-value store; the groups' ids and ranks are checked "
              "afterwards. **roots**: unique ids of the largest communicator (one per 1024 ranks above 1024, "
              "at most 32: NCCL's multi-root `ncclCommInitRankScalable`). **kv ops**: key-value operations per "
              "process (one per root of each axis group it is in whose members span processes, none when a "
              "group is inside one process); **1-root kv ops**: the same with one root per communicator. "
              "**positions max**: mesh positions a process examines (its own devices, once per axis). "
              "**split a-g/rank**: entries a membership all-gather moves per rank (what `ncclCommSplit` "
              "exchanges), for comparison. NCCL's own bootstrap inside each group (`ncclCommInitRank`) is not "
              "simulated.")
    log(f"done in {log.elapsed():.1f} s")


if __name__ == "__main__":
    sys.exit(main())
