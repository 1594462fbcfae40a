"""The ``ncclx-config`` directive: the configuration page, generated from the code that defines the variables.

Runtime variables come from ``jax_ncclx/_src/config.py``: ``current()`` reads each ``JAX_NCCLX_*`` variable
into a field of ``Config``, and ``Config``'s docstring documents each field under ``Attributes:``. The
directive walks ``current()``'s source, so every variable it reads gets a row, with the field's default, the
values its parser accepts and the first sentence of the field's documentation; the full text follows the
table. Build variables come from ``pyproject.toml`` (``[tool.scikit-build.cmake.define]``) and the ``CACHE``
descriptions of ``CMakeLists.txt``.

So the page cannot drift: a variable added to ``current()`` appears by itself, and the build warns (an error
under ``-W``) when a ``JAX_NCCLX_*`` name in the package's Python source is on neither list, or a field read
by ``current()`` has no ``Attributes:`` entry.
"""

import ast
import importlib
import inspect
import pathlib
import re
import tomllib

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

LOG = logging.getLogger(__name__)
ROOT = pathlib.Path(__file__).resolve().parents[2]
NAME = re.compile(r"JAX_NCCLX_[A-Z0-9_]*[A-Z0-9]_?")


def _attributes(doc: str) -> dict:
    """``{field: text}`` of a Google-style ``Attributes:`` section."""
    lines = inspect.cleandoc(doc).splitlines()
    start = lines.index("Attributes:") + 1
    fields, name = {}, None
    for line in lines[start:]:
        if line and not line.startswith(" "):
            break
        match = re.match(r"^  (\w+): (.*)$", line)
        if match:
            name = match.group(1)
            fields[name] = match.group(2).strip()
        elif name and line.strip():
            fields[name] += " " + line.strip()
    return fields


def _first_clause(text: str) -> str:
    """What a field is, in one line: its text up to the first full stop, semicolon or colon outside parentheses
    and literals, without the parentheses that name the variable (the table does), capitalized."""
    depth, literal, end, groups, opened = 0, False, len(text), [], 0
    for i, char in enumerate(text):
        if text.startswith("``", i) and (i == 0 or text[i - 1] != "`"):
            literal = not literal
        elif literal:
            continue
        elif char == "(":
            depth += 1
            opened = i if depth == 1 else opened
        elif char == ")":
            depth -= 1
            if depth == 0:
                groups.append((opened, i + 1))
        elif depth == 0 and char in ".;:" and (i + 1 == len(text) or text[i + 1] == " "):
            end = i
            break
    clause = text[:end]
    for start, stop in reversed([g for g in groups if g[1] <= end]):
        if "JAX_NCCLX_" in clause[start:stop]:
            clause = clause[:start].rstrip() + clause[stop:]
    clause = re.sub(r",? see :\w+:`[^`]+`", "", clause).strip()
    first = clause.split(" ", 1)[0]
    return clause[:1].upper() + clause[1:] if first.isalpha() and first.islower() else clause


def _render(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 20} MiB"
    return str(value)


class _Reads(ast.NodeVisitor):
    """The environment variables one keyword argument of ``current()``'s ``Config(...)`` reads."""

    def __init__(self, module, tree):
        self.module = module
        self.functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        self.reads = []  # (variable, parser name, the parser call's node)
        self.seen = set()

    def constant(self, node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and isinstance(getattr(self.module, node.id, None), str):
            return getattr(self.module, node.id)
        return None

    def visit_Call(self, node):
        name = node.func.id if isinstance(node.func, ast.Name) else None
        arg = node.args[0] if node.args else None
        reader = getattr(arg.func, "id", getattr(arg.func, "attr", "")) if isinstance(arg, ast.Call) else ""
        reads_env = reader in ("get", "_env")
        if name and reads_env:
            node, arg = arg, arg.args[0] if arg.args else None  # parse_faults(_env("JAX_NCCLX_FAULT", ""))
        value = self.constant(arg) if arg is not None else None
        if value and value.startswith("JAX_NCCLX_") and not value.endswith("_"):
            self.reads.append((value, name, node))
            return
        if name in self.functions and name not in self.seen:  # a helper of config.py: read its body too
            self.seen.add(name)
            self.generic_visit(self.functions[name])
        self.generic_visit(node)

    def visit_Name(self, node):
        value = self.constant(node)
        if value and value.startswith("JAX_NCCLX_") and value.endswith("_"):  # a prefix: JAX_NCCLX_TIMEOUT_S_
            self.reads.append((value, "prefix", node))


def runtime_variables():
    """[(variable, default, accepted values, [fields])] in the order ``current()`` reads them."""
    module = importlib.import_module("jax_ncclx._src.config")
    source = pathlib.Path(module.__file__).read_text()
    tree = ast.parse(source)
    current = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "current")
    call = next(n for n in ast.walk(current) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Config")
    namespace = vars(module)
    local = {target.id: node.value for node in ast.walk(current) if isinstance(node, ast.Assign)
             for target in node.targets if isinstance(target, ast.Name)}  # e.g. op_timeouts = _op_timeouts()
    rows = {}
    for keyword in call.keywords:
        reader = _Reads(module, tree)
        value = keyword.value
        reader.visit(local[value.id] if isinstance(value, ast.Name) and value.id in local else value)
        for variable, parser, node in reader.reads:
            if parser == "prefix":
                ops = "`, `".join(op.upper() for op in getattr(module, "TIMED_OPS", ()))
                variable, default, accepted = variable + "<OP>", "unset", f"seconds; `<OP>` one of `{ops}`"
            else:
                default = eval(compile(ast.Expression(node.args[1]), "config.py", "eval"), namespace) \
                    if len(node.args) > 1 else None
                if parser == "_choice":
                    choices = eval(compile(ast.Expression(node.args[2]), "config.py", "eval"), namespace)
                    accepted = ", ".join(f"`{c}`" for c in choices)
                elif parser == "_seconds":
                    zero = next((k.value.value for k in node.keywords if k.arg == "zero"), "no timeout")
                    accepted = f"seconds, 0 to {module._MAX_TIMEOUT_S:.0e} (0: {zero})".replace("e+0", "e")
                elif parser == "_non_negative_int":
                    accepted = "an integer ≥ 0"
                elif parser == "parse_faults":
                    accepted = "`kind:rank=R,seq=S[,ms=M]`, `;`-separated"
                    default = ""
                else:
                    accepted = ""
                if isinstance(default, str) and default == "" or default is None:
                    field_default = getattr(module.Config, keyword.arg, None)
                    default = field_default if field_default not in ((), None) else default
            row = rows.setdefault(variable, [variable, default, accepted, []])
            if keyword.arg not in row[3]:
                row[3].append(keyword.arg)
    return list(rows.values()), module


def build_variables():
    """[(variable, default, description)] of the build, from pyproject.toml and CMakeLists.txt."""
    defines = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]["cmake"]["define"]
    cmake = (ROOT / "CMakeLists.txt").read_text()
    rows = []
    for name, spec in defines.items():
        if not name.startswith("JAX_NCCLX_"):
            continue
        variable = spec.get("env", name) if isinstance(spec, dict) else name
        default = spec.get("default", "") if isinstance(spec, dict) else spec
        match = (re.search(rf'set\({name}\s+"[^"]*"\s+CACHE\s+\w+\s+"([^"]*)"\)', cmake)
                 or re.search(rf'option\({name}\s+"([^"]*)"', cmake))
        rows.append((variable, default, match.group(1) if match else ""))
    return rows


def _check_coverage(documented):
    """Warns about JAX_NCCLX_* names in the package's Python source that the page does not list."""
    prefixes = [v[: -len("<OP>")] for v in documented if v.endswith("<OP>")]
    for path in sorted((ROOT / "jax_ncclx").rglob("*.py")):
        for match in NAME.finditer(path.read_text()):
            name = match.group(0)
            if name in documented or any(name.startswith(p) for p in prefixes) or name.rstrip("_") + "_" in prefixes:
                continue
            if any(d.startswith(name) for d in documented):  # a prefix written in prose, e.g. JAX_NCCLX_NVLINK_
                continue
            LOG.warning("%s names %s, which jax_ncclx/_src/config.py's current() does not read and the build "
                        "does not define: read it there, so the configuration page lists it",
                        path.relative_to(ROOT), name, type="ncclx", subtype="config")


class ConfigTable(SphinxDirective):
    """``ncclx-config``: the runtime and build variables, as tables and then in full."""

    has_content = False

    def run(self):
        rows, module = runtime_variables()
        fields = _attributes(module.Config.__doc__)
        self.env.note_dependency(module.__file__)
        self.env.note_dependency(str(ROOT / "pyproject.toml"))
        self.env.note_dependency(str(ROOT / "CMakeLists.txt"))
        lines = ["(runtime-variables)=", "## Runtime", "",
                 "Read when a program is lowered (compiled); see "
                 "[When a setting applies](#when-a-setting-applies).", "",
                 "| variable | default | values | meaning |", "| --- | --- | --- | --- |"]
        details = []
        for variable, default, accepted, names in rows:
            texts = [fields.get(name) for name in names]
            for name, text in zip(names, texts):
                if text is None:
                    LOG.warning("Config.%s (read from %s) has no entry under Attributes: in Config's docstring",
                                name, variable, type="ncclx", subtype="config")
            text = next((t for t in texts if t), "")
            summary = _first_clause(text)
            if variable.endswith("_<OP>"):  # the field documents all the overrides at once
                summary = f"The timeout of one op, in place of `{variable[: -len('_<OP>')]}`"
            lines.append(f"| `{variable}` | {_render(default) if default != '' else 'unset'} | {accepted} | "
                         f"{_rst_to_md(summary)} |")
            details.append((variable, names, texts))
        lines += ["", "(build-variables)=", "## Build", "",
                  "Read by `pip install` (CMake, through `pyproject.toml`).", "",
                  "| variable | default | meaning |", "| --- | --- | --- |"]
        build = build_variables()
        for variable, default, description in build:
            lines.append(f"| `{variable}` | `{default}` | {description} |")
        lines += ["", "## In full", "",
                  "Each runtime variable's entry in the documentation of `jax_ncclx._src.config.Config`, the "
                  "settings object that `current()` builds from the environment.", ""]
        for variable, names, texts in details:
            lines.append(f"`{variable}`")
            body = " ".join(f"(`Config.{n}`) {_rst_to_md(t)}" for n, t in zip(names, texts) if t)
            lines.append(": " + body)
            lines.append("")
        _check_coverage({r[0] for r in rows} | {b[0] for b in build})
        return self.parse_markdown(lines)

    def parse_markdown(self, lines):
        container = nodes.container()
        self.state.nested_parse(StringList(lines, source="jax_ncclx/_src/config.py"), self.content_offset,
                                container)
        return container.children


def _rst_to_md(text: str) -> str:
    """The reST of a docstring as the Markdown of this page: literals, roles and the odd character."""
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    text = re.sub(r":(?:func|meth|class|data|mod|attr):`~?([^`]+)`", r"`\1`", text)
    return text.replace("|", "\\|")


class ThresholdTable(SphinxDirective):
    """``ncclx-thresholds``: the measured defaults that choose an NVLink algorithm, from config.py's tables."""

    has_content = False

    def run(self):
        module = importlib.import_module("jax_ncclx._src.config")
        self.env.note_dependency(module.__file__)
        ops = sorted({op for _, limits in module.NVLINK_THRESHOLDS.values() for op in limits})
        lines = ["| GPUs (nearest count above) | one-shot all_reduce up to | " +
                 " | ".join(f"{op} on NVLink up to" for op in ops) + " |",
                 "| --- | --- |" + " --- |" * len(ops)]
        for gpus, (oneshot, limits) in sorted(module.NVLINK_THRESHOLDS.items()):
            lines.append(f"| {gpus} | {_size(oneshot)} | " + " | ".join(_size(limits[op]) for op in ops) + " |")
        lines += ["", "LL128 replaces LL for one-shot segments (bytes one rank sends one peer) from:", "",
                  "| GPUs (nearest count above) | " + " | ".join(ops) + " |", "| --- |" + " --- |" * len(ops)]
        for gpus, limits in sorted(module.NVLINK_LL128_MIN_BYTES.items()):
            lines.append(f"| {gpus} | " + " | ".join(_size(limits[op]) for op in ops) + " |")
        container = nodes.container()
        self.state.nested_parse(StringList(lines, source=module.__file__), self.content_offset, container)
        return container.children


def _size(n: int) -> str:
    if n == 0:
        return "0 (every size)"
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def setup(app):
    app.add_directive("ncclx-config", ConfigTable)
    app.add_directive("ncclx-thresholds", ThresholdTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}

