"""The package's layering, read from every module's imports (``ast``; nothing is imported):
kernels -> ops -> integrations, the tools wing apart, no cycles."""

import ast
import pathlib

from tests import support

ROOT = support.REPO / "hygon_attn_backend"
PKG = "hygon_attn_backend"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set:
    """Every module of ours ``path`` imports (top level or inside a function), with
    ``from X import name`` counted as ``X.name`` where that is a module of ours."""
    tree = ast.parse(path.read_text())
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(PKG))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if not target.startswith(PKG):
                continue
            found.add(target)
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:
                    found.add(f"{target}.{alias.name}")
    found.discard(me)
    return found


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}
GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def _under(name: str, area: str) -> bool:
    full = f"{PKG}.{area}"
    return name == full or name.startswith(full + ".")


def _offenders(rule):
    return sorted(f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets if rule(m, t))


def test_the_graph_is_read():
    assert f"{PKG}.ops.decode.plan" in GRAPH
    assert f"{PKG}.ops.decode.tuning" in GRAPH[f"{PKG}.ops.decode.plan"]


def test_kernels_import_only_kernels():
    assert _offenders(lambda m, t: _under(m, "kernels") and not _under(t, "kernels")) == []


def test_ops_import_no_integrations_or_tools():
    assert _offenders(lambda m, t: _under(m, "ops") and (
        _under(t, "integrations") or _under(t, "tools"))) == []


def test_launch_paths_and_heuristics_do_not_import_the_reference():
    """The oracle is reached only through ``impl="reference"``, which an op's ``api.py``
    and ``plan.py`` dispatch; the Triton and native launches and the heuristics never
    call it."""
    def rule(m, t):
        leaf = m.rsplit(".", 1)[-1]
        return _under(m, "ops") and leaf in ("triton", "native", "tuning") and \
            t == f"{PKG}.reference"
    assert _offenders(rule) == []


def test_integrations_import_no_kernels_or_tools():
    assert _offenders(lambda m, t: _under(m, "integrations") and (
        _under(t, "kernels") or _under(t, "tools"))) == []


def test_nothing_outside_tools_imports_tools():
    assert _offenders(lambda m, t: _under(t, "tools") and not _under(m, "tools")
                      and m != f"{PKG}.__main__") == []


def test_no_import_cycles():
    """No cycle among modules' imports, a package's ``__init__`` re-exports aside (it
    imports its own modules, which import their siblings through the package)."""
    def edges(m):
        return {t for t in GRAPH.get(m, ()) if t in GRAPH and not (
            MODULES[t].name == "__init__.py" and _under(m, t[len(PKG) + 1:]))}

    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for t in edges(m):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert cycles == []
