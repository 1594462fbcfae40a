"""Summary of an A/B made by tools/ab_trees.sh: every row's median µs/op in each run of each side, and B / A.

    python tools/ab_summary.py OUT_DIR BENCHMARK

Reads OUT_DIR/<BENCHMARK>_{a,b}<round>.json (the benchmarks' result files) and prints a markdown table: one
line per row of the results (a token count and variant, or an op, size and implementation), the medians of
A's runs and of B's in run order, their means, and mean B / mean A (> 1: B is slower). XLA's rows are in
every run, so they show how much the machine itself moved between runs. Rows that did not finish ("status"
other than ok) are left out of the means and shown as "-".
"""

import json
import re
import statistics
import sys
from pathlib import Path

# The fields that name a row in the benchmarks' JSON (all_to_allv.py: tokens, variant, transport;
# collectives.py: op, bytes, impl); a row has some of them.
KEY_FIELDS = ("tokens", "variant", "transport", "op", "bytes", "impl")


def load_runs(out: Path, benchmark: str) -> dict[str, list[dict]]:
    """{"a": [rows of run 1, rows of run 2, ...], "b": [...]}, runs in round order."""
    pattern = re.compile(rf"{re.escape(benchmark)}_([ab])(\d+)\.json$")
    found = []
    for path in out.iterdir():
        match = pattern.match(path.name)
        if match:
            found.append((match.group(1), int(match.group(2)), path))
    if not found:
        raise SystemExit(f"ab_summary: no {benchmark}_a<N>.json or _b<N>.json in {out}")
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    for side, _, path in sorted(found):
        runs[side].append(json.loads(path.read_text())["rows"])
    return runs


def row_key(row: dict) -> tuple:
    return tuple((field, row[field]) for field in KEY_FIELDS if field in row)


def medians(runs: list[list[dict]], key: tuple) -> list[float | None]:
    """The median µs/op of the row named `key` in each run (None where it did not finish; rows without a
    status, as launch_floor.py's, finished)."""
    values = []
    for rows in runs:
        match = next((r for r in rows if row_key(r) == key), None)
        ok = match is not None and match.get("status", "ok") == "ok" and match.get("median_us") is not None
        values.append(match["median_us"] if ok else None)
    return values


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    out, benchmark = Path(argv[1]), argv[2]
    runs = load_runs(out, benchmark)
    keys = list(dict.fromkeys(row_key(r) for rows in runs["a"] + runs["b"] for r in rows))

    def cell(values):
        return " / ".join("-" if v is None else f"{v:.1f}" for v in values)

    print(f"A/B of {benchmark}: {len(runs['a'])} runs of A, {len(runs['b'])} of B, µs/op (median of each run)\n")
    print("| row | A | B | mean A | mean B | B / A |")
    print("| --- | --- | --- | --- | --- | --- |")
    for key in keys:
        a, b = medians(runs["a"], key), medians(runs["b"], key)
        a_ok, b_ok = [v for v in a if v is not None], [v for v in b if v is not None]
        mean_a = statistics.fmean(a_ok) if a_ok else None
        mean_b = statistics.fmean(b_ok) if b_ok else None
        ratio = f"{mean_b / mean_a:.3f}" if mean_a and mean_b else "-"
        name = ", ".join(str(value) for _, value in key)
        print(f"| {name} | {cell(a)} | {cell(b)} | {cell([mean_a])} | {cell([mean_b])} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
