"""The package's shape: no import circles, the layering of docs/architecture.md, and a tree that
is a manual rather than a diary (no session or issue numbers outside git history)."""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "moonep_ops"

# Lower layers never import higher ones (a module may import its own layer and below).
LAYERS = [
    {"moonep_ops.settings", "moonep_ops.geometry", "moonep_ops.runtime", "moonep_ops.native",
     "moonep_ops.registry"},
    {"moonep_ops.planner"},
    {"moonep_ops.backends"},
    {"moonep_ops.ops", "moonep_ops.gemm"},
    {"moonep_ops.comm_stream", "moonep_ops.buffer"},
    {"moonep_ops.nn"},
    {"moonep_ops.integrations", "moonep_ops.testing", "moonep_ops.build"},
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of the moonep_ops modules a file imports at module level (also inside
    functions: a lazy import is still a dependency)."""
    name = _module_name(path)
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("moonep_ops")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("moonep_ops"):
                out.add(mod)
                out |= {f"{mod}.{a.name}" for a in node.names}
    return out


def _graph() -> dict[str, set[str]]:
    files = sorted(PKG.rglob("*.py"))
    mods = {_module_name(f): f for f in files}
    g = {}
    for m, f in mods.items():
        g[m] = {d for d in _imports(f) if d in mods and d != m}
    return g


def _layer(mod: str) -> int:
    for i, layer in enumerate(LAYERS):
        for p in layer:
            if mod == p or mod.startswith(p + "."):
                return i
    return -1                                    # the package root re-exports everything


def test_no_import_cycles():
    g = _graph()
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def visit(v):                                # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            sccs.append(comp)

    for v in g:
        if v not in index:
            visit(v)
    # a package's __init__ importing its own submodules is not a circle
    cycles = [c for c in sccs if len(c) > 1
              and not all(x == min(c, key=len) or x.startswith(min(c, key=len) + ".") for x in c)]
    assert not cycles, f"import circles: {cycles}"


def test_layering():
    bad = []
    for mod, deps in _graph().items():
        lm = _layer(mod)
        if lm < 0:
            continue
        for d in deps:
            ld = _layer(d)
            if ld > lm:
                bad.append(f"{mod} (layer {lm}) imports {d} (layer {ld})")
    assert not bad, "\n".join(bad)


def test_library_never_imports_apps_or_test_helpers():
    """The library (every module but moonep_ops/testing/ itself) imports neither apps/ nor its
    testing package: test and bring-up helpers live there, the library does not lean on them."""
    testing = PKG / "testing"
    for f in PKG.rglob("*.py"):
        if testing in f.parents:
            continue
        text = f.read_text()
        assert not re.search(r"^\s*(from|import) apps\b", text, re.M), f
        deps = _imports(f)
        assert not any(d == "moonep_ops.testing" or d.startswith("moonep_ops.testing.")
                       for d in deps), f"{f.relative_to(ROOT)} imports moonep_ops.testing"


MAX_LINES = 600
# Files over MAX_LINES that their owners are splitting now (empty: none).
OVER_MAX_LINES: set[str] = set()


def test_environment_read_only_by_the_settings_module():
    """Every environment switch is declared in moonep_ops/settings.py and read through it."""
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        if f.name == "settings.py" and f.parent == PKG:
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\bos\.environ\b|\bgetenv\(|\bos\.putenv\(", code):
                bad.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "read the environment through moonep_ops.settings:\n" + "\n".join(bad)
    from moonep_ops.settings import SWITCHES
    api = (ROOT / "docs" / "api.md").read_text()
    assert not [n for n in SWITCHES if f"| `{n}` |" not in api], "docs/api.md lists every switch"


def test_no_file_over_max_lines():
    """A unit a reader can hold: no file of the package over MAX_LINES lines."""
    over = {str(f.relative_to(ROOT)): len(f.read_text().splitlines()) for f in PKG.rglob("*.py")}
    over = {f: n for f, n in over.items() if n > MAX_LINES}
    assert set(over) <= OVER_MAX_LINES, \
        f"over {MAX_LINES} lines: {sorted(set(over) - OVER_MAX_LINES)}"
    fixed = OVER_MAX_LINES - set(over)
    assert not fixed, f"no longer over {MAX_LINES} lines, remove from OVER_MAX_LINES: {sorted(fixed)}"


def test_no_history_in_the_tree():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout
    pattern = re.compile(r"\bsession ?[0-9]+|\bissue ?#?[0-9]+", re.I)
    hits = []
    for rel in files.split():
        if rel.endswith((".json", ".png")):
            continue
        try:
            text = (ROOT / rel).read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        hits += [f"{rel}: {m.group(0)}" for m in pattern.finditer(text)]
    assert not hits, "history belongs in commit messages:\n" + "\n".join(hits[:20])
