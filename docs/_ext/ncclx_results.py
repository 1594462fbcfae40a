"""The ``results-table`` directive: a table read from ``benchmarks/results/<name>.json`` at build time.

The performance pages show the numbers of the committed results, not copies of them: rerunning a benchmark
and committing its files updates the tables. Three layouts, by what the JSON holds:

``all_to_allv`` results (rows with ``tokens`` and ``variant``)::

    :::{results-table} all_to_allv_2gpu
    :rows: xla_all_to_all, nx_padded, nx_moe
    :versus: nx_padded=xla_all_to_all
    :::

  one row per variant, one column per token count, the median µs per op; ``:versus:`` adds the baseline's
  time over the row's in brackets (> 1: jax_ncclx is faster).

``collectives`` results (rows with ``op``, ``bytes`` and ``impl``)::

    :::{results-table} collectives_2gpu
    :ops: all_reduce, all_to_all
    :impl: nx
    :::

  one row per size, per op the impl's median µs per op and ``jax.lax``'s time over it in brackets.

one op's implementations side by side (``:ops:`` one op, ``:impls:`` the columns): median µs per op by size.

anything else (``:columns:``, optionally ``:where: key=value`` and ``:headers:``): the chosen keys of the
chosen rows.

A caption names the file and where it ran (devices, processes, JAX and NCCL versions); the commit and date
stay in the file.
"""

import json
import pathlib

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"

LABELS = {  # all_to_allv variants, as benchmarks/all_to_allv.py's plot names them
    "xla_all_to_all": "`lax.all_to_all` (rows padded beforehand)",
    "xla_ragged": "`lax.ragged_all_to_all` (sizes from the host)",
    "xla_ragged_counts": "`lax.ragged_all_to_all` + a count exchange",
    "nx_padded": "`nx.all_to_allv_dynamic`, padded",
    "nx_padded_recv": "the same, chained by its `recv_counts`",
    "nx_packed": "`nx.all_to_allv_dynamic`, packed",
    "nx_ragged": "`nx.ragged_all_to_all`",
    "xla_moe_dispatch": "MoE dispatch in XLA's ops",
    "xla_moe": "MoE dispatch + combine in XLA's ops",
    "nx_moe_dispatch": "`moe.dispatch`",
    "nx_moe_combine": "`moe.combine`",
    "nx_moe": "`moe.dispatch` + `moe.combine`",
    "nx_moe_pairs": "the same, weights given to `combine`",
    "nx_moe_dispatch_fp8": "`moe.dispatch`, FP8 wire",
    "nx_moe_fp8": "`moe.dispatch` + `moe.combine`, FP8 wire",
    "nx_moe_masked_dispatch": "`moe.dispatch`, masked layout",
    "nx_moe_masked": "`moe.dispatch` + `moe.combine`, masked layout",
    "nx_moe_masked_dispatch_fp8": "`moe.dispatch`, masked layout, FP8 wire",
    "nx_moe_masked_fp8": "`moe.dispatch` + `moe.combine`, masked layout, FP8 wire",
}


def _size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _us(value) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value:,.0f}".replace(",", " ") if value >= 10000 else f"{value:.1f}"


def _ratio(x: float) -> str:
    return f"{x:.2f}×" if x < 10 else f"{x:.0f}×"


def _plain(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if value < 100 else _us(value)
    return str(value)


def _list(text):
    return [item.strip() for item in (text or "").split(",") if item.strip()]


def caption(name: str, meta: dict) -> str:
    processes = meta.get("process_count", 1)
    where = f"{meta.get('num_devices')} × {meta.get('device_kind')}"
    where += ", one process" if processes == 1 else f", {processes} processes"
    versions = ", ".join(f"{k} {meta[v]}" for k, v in (("jax", "jax"), ("NCCL", "nccl_version")) if meta.get(v))
    return f"From `benchmarks/results/{name}.json`: {where}, {versions}."


class ResultsTable(SphinxDirective):
    required_arguments = 1
    option_spec = {"rows": directives.unchanged, "versus": directives.unchanged, "ops": directives.unchanged,
                   "impl": directives.unchanged, "columns": directives.unchanged, "where": directives.unchanged,
                   "headers": directives.unchanged, "impls": directives.unchanged}

    def run(self):
        name = self.arguments[0]
        path = RESULTS / f"{name}.json"
        self.env.note_dependency(str(path))
        if not path.exists():
            raise self.error(f"results-table: {path} does not exist")
        document = json.loads(path.read_text())
        rows = document["rows"]
        if "columns" in self.options:
            lines = self.plain(rows)
        elif rows and "variant" in rows[0]:
            lines = self.all_to_allv(rows)
        elif rows and {"op", "impl"} <= set(rows[0]) and "impls" in self.options:
            lines = self.impls(rows)
        elif rows and {"op", "impl"} <= set(rows[0]):
            lines = self.collectives(rows)
        else:
            raise self.error("results-table: give :columns: for rows that are neither all_to_allv's nor "
                             "collectives'")
        lines = [caption(name, document.get("meta", {})), ""] + lines
        container = nodes.container(classes=["results-table"])
        self.state.nested_parse(StringList(lines, source=str(path)), self.content_offset, container)
        return [container]

    def all_to_allv(self, rows):
        median = {(r["variant"], r["tokens"]): r.get("median_us") for r in rows if r.get("status") == "ok"}
        tokens = sorted({r["tokens"] for r in rows})
        variants = _list(self.options.get("rows")) or list(dict.fromkeys(r["variant"] for r in rows))
        versus = dict(item.split("=") for item in _list(self.options.get("versus")))
        lines = ["| µs per op, tokens per GPU: | " + " | ".join(str(t) for t in tokens) + " |",
                 "| --- |" + " --- |" * len(tokens)]
        for variant in variants:
            if not any((variant, t) in median for t in tokens):
                raise self.error(f"results-table: no ok row of variant {variant!r}")
            if variant not in LABELS:
                raise self.error(f"results-table: variant {variant!r} has no label (LABELS in {__name__})")
            cells = []
            for t in tokens:
                value, base = median.get((variant, t)), median.get((versus.get(variant), t))
                cell = _us(value)
                if value and base:
                    cell += f" ({_ratio(base / value)})"
                cells.append(cell)
            lines.append(f"| {LABELS[variant]} | " + " | ".join(cells) + " |")
        return lines

    def collectives(self, rows):
        impl = self.options.get("impl", "nx")
        ops = _list(self.options.get("ops")) or list(dict.fromkeys(r["op"] for r in rows))
        median = {(r["op"], r["bytes"], r["impl"]): (r.get("median_us"), r.get("path"))
                  for r in rows if r.get("status") == "ok"}
        # An op may round a size up (all_to_all to a multiple of N elements): line sizes up by their rank.
        sizes = {op: sorted({r["bytes"] for r in rows if r["op"] == op and r["impl"] == impl}) for op in ops}
        if not any(sizes.values()):
            raise self.error(f"results-table: no rows of impl {impl!r} for {ops}")
        lead = max(sizes.values(), key=len)
        lines = ["| bytes per rank | " + " | ".join(f"{op} (× `jax.lax`)" for op in ops) + " |",
                 "| --- |" + " --- |" * len(ops)]
        for i, size in enumerate(lead):
            cells = []
            for op in ops:
                own = sizes[op][i] if i < len(sizes[op]) else None
                value, route = median.get((op, own, impl), (None, None))
                base = median.get((op, own, "xla"), (None, None))[0]
                notes = [f"{base / value:.1f}×"] if value and base else []
                notes += ["two-shot"] if route == "nvlink-2shot" else ["NCCL"] if route == "nccl" else []
                notes += [_size(own)] if own is not None and own != size else []
                cells.append(_us(value) + (f" ({', '.join(notes)})" if notes else ""))
            lines.append(f"| {_size(size)} | " + " | ".join(cells) + " |")
        return lines

    def impls(self, rows):
        """One op (``:ops:``), one column per implementation (``:impls:``): median µs per op by size."""
        (op,) = _list(self.options.get("ops"))
        impls = _list(self.options["impls"])
        median = {(r["bytes"], r["impl"]): r.get("median_us") for r in rows
                  if r["op"] == op and r.get("status") == "ok"}
        sizes = sorted({size for size, _ in median})
        lines = [f"| {op}, bytes per rank | " + " | ".join(f"`{i}`" for i in impls) + " |",
                 "| --- |" + " --- |" * len(impls)]
        for size in sizes:
            lines.append(f"| {_size(size)} | " + " | ".join(_us(median.get((size, i))) for i in impls) + " |")
        return lines

    def plain(self, rows):
        columns = _list(self.options.get("columns"))
        headers = _list(self.options.get("headers")) or columns
        where = dict(item.split("=") for item in _list(self.options.get("where")))
        chosen = [r for r in rows if all(str(r.get(k)) == v for k, v in where.items())]
        if not columns or not chosen:
            raise self.error("results-table: give :columns: (and a :where: that matches some rows)")
        lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(columns)]
        for r in chosen:
            cells = [_plain(r.get(c)) for c in columns]
            lines.append("| " + " | ".join(cells) + " |")
        return lines


def setup(app):
    app.add_directive("results-table", ResultsTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
