"""``python -m jax_ncclx.trace merge DUMP... [--json OUT]``: lines up the trace dumps of all ranks
(:func:`jax_ncclx.trace.dump`, one per process) and reports, per collective (group and sequence number), the
slowest rank and any rank that never started. Exits 1 when some rank never started or never finished a call.
"""

import argparse
import json
import sys

from jax_ncclx._src.trace import merge


_DESCRIPTION = ("Lines up the trace dumps of all ranks (files written by jax_ncclx.trace.dump, one per process) "
                "and reports, per collective, the slowest rank and any rank that never started. Exits 1 when some "
                "rank never started or never finished a call.")


def _rank_list(ranks):
    return ",".join(map(str, ranks)) or "-"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_ncclx.trace", description=_DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    merging = commands.add_parser("merge", help="line up the dumps of all ranks")
    merging.add_argument("dumps", nargs="+", help="files written by jax_ncclx.trace.dump")
    merging.add_argument("--json", help="also write the merged report here")
    args = parser.parse_args(argv)

    report = merge(args.dumps)
    print(f"{'group':>16} {'seq':>6} {'op':<22} {'ranks':>5} {'slowest':>7} {'late':>5} {'spread_us':>10} "
          f"{'duration_us':>11}  never started / unfinished")
    for e in report:
        spread = "-" if e["start_spread_us"] is None else f"{e['start_spread_us']:.1f}"
        duration = "-" if e["duration_us"] is None else f"{e['duration_us']:.1f}"
        slowest = "-" if e["slowest_rank"] is None else e["slowest_rank"]
        late = "-" if e["late_rank"] is None else e["late_rank"]
        problems = ""
        if e["never_started"] or e["unfinished"]:
            problems = f"NEVER STARTED: {_rank_list(e['never_started'])}  UNFINISHED: {_rank_list(e['unfinished'])}"
        print(f"{_rank_list(e['group']):>16} {e['seq']:>6} {e['op']:<22} {e['ranks']:>5} {slowest:>7} {late:>5} "
              f"{spread:>10} {duration:>11}  {problems}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if any(e["never_started"] or e["unfinished"] for e in report) else 0


if __name__ == "__main__":
    sys.exit(main())
