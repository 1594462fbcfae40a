"""The package's own structure, which a refactor could break without any op failing: no import cycles among
jax_ncclx's modules (function-level imports included), and every import of JAX's private ``jax._src`` in
``_src/compat.py`` alone."""

import ast
import pathlib

import jax_ncclx

PACKAGE = pathlib.Path(jax_ncclx.__file__).parent


def _modules():
    """{module name: its parsed source} of every Python file in the package."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = ast.parse(path.read_text())
    return modules


def _imports(tree, modules):
    """The package modules a module imports anywhere in it; ``from pkg import name`` counts as importing
    ``pkg.name`` where that is a module (an extension module, not Python, is left out)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jax_ncclx"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    found.add(full)
                elif node.module != "jax_ncclx":  # a name from a module; jax_ncclx.<ext> are extensions
                    found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
    return found


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(tree, modules) for name, tree in modules.items()}
    done, path = set(), []

    def visit(name):
        if name in path:
            cycle = path[path.index(name):] + [name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        path.append(name)
        for dep in sorted(graph[name]):
            if dep != "jax_ncclx":  # the package's own __init__ imports every public module by design
                visit(dep)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_jax_private_imports_only_in_compat():
    offenders = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            imported = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if any(m == "jax._src" or m.startswith("jax._src.") for m in imported) and \
                    name != "jax_ncclx._src.compat":
                offenders.append(f"{name}:{node.lineno}")
    assert offenders == [], offenders
