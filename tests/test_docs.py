"""The docs are a manual that can be trusted: every file, folder and section they point to exists,
the long manuals stay within their line budgets, and the README's headline figures are the ones
docs/benchmarks.md measured.

Pointers are checked in docs/*.md and README.md, and in the comments and docstrings of
moonep_ops/, csrc/, cutlass_kernels/, benchmarks/ and scripts/:

- a path with a known file extension (``tests/test_moe.py``, ``prep.cu``, ``zoo_2026-12-04.json``)
  or, inside backticks or a markdown link, a folder (``diagnostics/models/``);
- a path with a slash resolves against the repository root, the pointing file's folder or one of
  its parents, or the package folder (``gemm/tuning.py``); a bare name (``configs.h``) names a
  file that exists somewhere in the tree; a glob or template (``calibration/*.json``,
  ``kernel_<kind>.cu``) matches at least one file; git-ignored build outputs (``*.so``,
  ``build/``) count as existing;
- a markdown link ``[text](file.md#anchor)`` resolves relative to the doc, and its anchor to a
  heading of the target (GitHub's slugs);
- a named section, ``benchmarks.md, "Device planner"``, is a heading (or a bold paragraph label)
  of that doc.

``NOT_REPO_PATHS`` lists the few path-like names that are not in this repository, each with its
reason.
"""
from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "moonep_ops"
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SOURCE_DIRS = ("moonep_ops", "csrc", "cutlass_kernels", "benchmarks", "scripts")

LINE_LIMITS = {"docs/benchmarks.md": 600, "docs/grouped_gemm.md": 300, "docs/fp8.md": 300}

# Path-like names that are not files of this repository (pointer -> reason).
NOT_REPO_PATHS = {
    "aten/src/ATen/native/cuda/GroupMM.cu": "PyTorch's source: torch._grouped_mm's kernels",
    "GroupMM.cu": "PyTorch's source: torch._grouped_mm's kernels",
    "models/common/token_dispatcher.py": "torchtitan's source",
    "config.json": "a Hugging Face checkpoint's file",
    "generation_config.json": "a Hugging Face checkpoint's file",
    "model.safetensors.index.json": "a Hugging Face checkpoint's file",
    "_cuda.py": "a file-name suffix (the CUDA test files), not a file",
    "*.hpp": "a header pattern the build watches (moonep_ops/build.py)",
    "fit.json": "an example output name in a command line (--report-out fit.json)",
    "sweep.md": "written by python -m apps.job into its --out folder",
    "load_per_rank.png": "written by python -m apps.job into its --out folder",
    "step_time.png": "written by python -m apps.job into its --out folder",
    "loss.png": "written by python -m apps.job into its --out folder",
    "profile_moonep.txt": "written by python -m apps.job --profile",
    "profile_baseline.txt": "written by python -m apps.job --profile",
    "gemm_zoo.json": "written by benchmarks/bench_gemm_zoo.py into its --out folder",
    "gemm_zoo.md": "written by benchmarks/bench_gemm_zoo.py into its --out folder",
    "bench_grouped_gemm.json": "written by benchmarks/bench_grouped_gemm.py",
    "bench_grouped_gemm.md": "written by benchmarks/bench_grouped_gemm.py",
    "fp8_zoo.json": "written by benchmarks/bench_fp8_gemm.py into its --out folder",
    "calibration_grouped_gemm.json": "written by benchmarks/calibrate_grouped_gemm.py",
}

# Broken pointers in files that other work owns right now, each with its fix: (file, pointer)
# -> fix.  Strict: an entry whose pointer resolves again (or is gone) must be removed.
PENDING = {
    ("moonep_ops/backends/base.py", "moonep_ops/ops/plan.py"):
        "the dst encoding is moonep_ops/planner/op.py's (Plan.dst)",
    ("moonep_ops/ops/dispatch.py", "moonep.md"):
        "the semantics are docs/data_plane.md, \"Semantics\"",
}

EXTENSIONS = ("py", "md", "cu", "cuh", "h", "hpp", "cpp", "json", "sh", "txt", "toml", "cfg",
              "yaml", "yml", "png", "so", "whl", "ipynb")
_EXT = "|".join(EXTENSIONS)
# a file pointer: optional ./ or ../, folders, a name with a known extension
FILE_RE = re.compile(
    r"(?<![\w/.$<>{}*-])((?:\.\.?/)?(?:[\w.<>{}*-]+/)*[\w<>{}*-][\w.<>{}*,-]*\.(?:" + _EXT +
    r"))(?![\w/])")
# a folder pointer (only inside backticks or link targets): names ending in /
DIR_RE = re.compile(r"^(?:\.\.?/)?(?:[\w.-]+/)+$")
BACKTICK_RE = re.compile(r"`([^`\n]+)`")
LINK_RE = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
SECTION_RE = re.compile(r"([\w./-]*\b[\w-]+\.md)\b(?:'s)?,?\s+(?:section\s+)?\"([^\"\n]{2,80})\"")


@lru_cache(maxsize=None)
def _tree() -> tuple[frozenset, frozenset]:
    """(files, folders) of the working tree that git tracks or would track."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = {f for f in out.split("\n") if f and (ROOT / f).exists()}
    dirs = set()
    for f in files:
        p = Path(f).parent
        while str(p) != ".":
            dirs.add(str(p))
            p = p.parent
    return frozenset(files), frozenset(dirs)


@lru_cache(maxsize=None)
def _basenames() -> frozenset:
    files, dirs = _tree()
    return frozenset(Path(x).name for x in files | dirs)


@lru_cache(maxsize=None)
def _ignored(rel: str) -> bool:
    r = subprocess.run(["git", "check-ignore", "-q", "--no-index", rel], cwd=ROOT)
    return r.returncode == 0


def _is_placeholder(tok: str) -> bool:
    """DIR/results.json, $OUT/x, FIT.json: names a reader substitutes."""
    first = tok.split("/")[0]
    stem = Path(tok).name.split(".")[0]
    return "$" in tok or (first.isupper() and len(first) > 1 and "/" in tok) or (
        stem.isupper() and len(stem) > 1)


def _bases(src: Path) -> list[Path]:
    out = [ROOT, PKG]
    p = src.parent
    while ROOT in p.parents or p == ROOT:
        out.append(p)
        p = p.parent
    return out


def resolves(tok: str, src: Path) -> bool:
    tok = tok.rstrip(",.")
    if tok in NOT_REPO_PATHS or _is_placeholder(tok) or tok.startswith("/"):
        return True
    files, dirs = _tree()
    glob = re.sub(r"<[^>]*>|\{[^}]*\}", "*", tok)
    name = glob.rstrip("/")
    if "/" not in name:                      # a bare name: somewhere in the tree
        if "*" in name:
            return any(Path(f).match(name) for f in files)
        # a directory's ignore rule (``/.whl/``) matches only with the slash where it is absent
        return name in _basenames() or _ignored(name + ("/" if tok.endswith("/") else ""))
    for base in _bases(src):
        target = (base / name).resolve()
        try:
            rel = str(target.relative_to(ROOT))
        except ValueError:
            continue
        if "*" in rel:
            if any(Path(f).match(rel) for f in files):
                return True
            continue
        if rel in files or rel in dirs or _ignored(rel + ("/" if tok.endswith("/") else "")):
            return True
    return False


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


@lru_cache(maxsize=None)
def _headings(doc: Path) -> tuple[list[str], list[str]]:
    """(headings, bold paragraph labels) of a markdown file, outside code blocks."""
    heads, bold, fence = [], [], False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            heads.append(m.group(1).strip())
        bold += re.findall(r"\*\*([^*]+)\*\*", line)
        m = re.match(r"\s*[-*] \*([^*]+)\*", line)       # an italic list label: - *Caps.*
        if m:
            bold.append(m.group(1))
    return heads, bold


def _section_exists(doc: Path, title: str) -> bool:
    heads, bold = _headings(doc)
    t = title.lower().strip(" .")
    strip = lambda h: re.sub(r"[`*]", "", h).lower()       # noqa: E731
    return any(strip(h).startswith(t) or t in strip(h) for h in heads) or any(
        strip(b).startswith(t) for b in bold)


def _doc_path(name: str, src: Path) -> Path | None:
    for base in _bases(src) + [ROOT / "docs"]:
        p = (base / name).resolve()
        if p.exists():
            return p
    return None


# ---------------------------------------------------------------------------------------------
# what the sources say: doc text, comments and docstrings
# ---------------------------------------------------------------------------------------------

def _py_comments(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                out.append((tok.start[0], tok.string))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.append((body[0].lineno, body[0].value.value))
    return out


def _c_comments(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    out = []
    for m in re.finditer(r"//[^\n]*|/\*.*?\*/", text, re.S):
        out.append((text.count("\n", 0, m.start()) + 1, m.group(0)))
    return out


def _sh_comments(path: Path) -> list[tuple[int, str]]:
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        m = re.search(r"(?:^|\s)(#(?!!).*)$", line)
        if m:
            out.append((i, m.group(1)))
    return out


@lru_cache(maxsize=None)
def _tracked() -> frozenset:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return frozenset(f for f in out.split("\n") if f and (ROOT / f).exists())


def _source_files() -> list[Path]:
    """The committed sources (a file another change is still writing is checked once committed)."""
    out = []
    for f in sorted(_tracked()):
        if f.split("/")[0] in SOURCE_DIRS and Path(f).suffix in (".py", ".cu", ".cuh", ".h",
                                                                  ".cpp", ".sh"):
            out.append(ROOT / f)
    return out


def _texts(path: Path) -> list[tuple[int, str, bool]]:
    """(line, text, is_markdown) pieces of one file that may point somewhere."""
    if path.suffix == ".md":
        lines = path.read_text().splitlines()
        return [(i, line, True) for i, line in enumerate(lines, 1)]
    if path.suffix == ".py":
        return [(i, t, False) for i, t in _py_comments(path)]
    if path.suffix == ".sh":
        return [(i, t, False) for i, t in _sh_comments(path)]
    return [(i, t, False) for i, t in _c_comments(path)]


def pointers(path: Path) -> list[tuple[int, str, str]]:
    """(line, kind, pointer) for every file / folder / section / link pointer in one file."""
    out = []
    for line, text, md in _texts(path):
        seen = set()
        for m in LINK_RE.finditer(text):
            tgt = m.group(1)
            if re.match(r"[a-z]+:", tgt):
                continue
            out.append((line, "link", tgt))
            seen.add(tgt.split("#")[0])
        for m in FILE_RE.finditer(text):
            tok = m.group(1)
            if tok not in seen:
                out.append((line, "file", tok))
        for m in BACKTICK_RE.finditer(text):
            for word in m.group(1).split():
                if DIR_RE.match(word) and not word.startswith("/"):
                    out.append((line, "dir", word))
        for m in SECTION_RE.finditer(text):
            out.append((line, "section", f"{m.group(1)}#{m.group(2)}"))
    return out


def broken_pointers(path: Path) -> list[str]:
    bad = []
    rel = path.relative_to(ROOT)
    for line, kind, p in pointers(path):
        where = f"{rel}:{line}: {kind} {p!r}"
        if kind == "link":
            target, _, anchor = p.partition("#")
            doc = (path.parent / target).resolve() if target else path
            if not doc.exists():
                bad.append(where + " (no such file)")
            elif anchor and doc.suffix == ".md":
                if anchor not in {_slug(h) for h in _headings(doc)[0]}:
                    bad.append(where + " (no such heading)")
        elif kind == "section":
            name, _, title = p.partition("#")
            doc = _doc_path(name, path)
            if doc is None:
                bad.append(where + " (no such file)")
            elif not _section_exists(doc, title):
                bad.append(where + " (no such section)")
        elif not resolves(p, path):
            bad.append(where + " (no such path)")
    return bad


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_pointers_exist(doc):
    bad = broken_pointers(doc)
    assert not bad, "broken pointers:\n" + "\n".join(bad)


def _pending_hit(line: str) -> tuple | None:
    rel, _, rest = line.partition(":")
    for (f, ptr) in PENDING:
        if rel == f and repr(ptr) in rest:
            return (f, ptr)
    return None


def test_source_comment_pointers_exist():
    bad, pending_seen = [], set()
    for f in _source_files():
        for line in broken_pointers(f):
            hit = _pending_hit(line)
            if hit:
                pending_seen.add(hit)
            else:
                bad.append(line)
    assert not bad, "broken pointers in comments and docstrings:\n" + "\n".join(bad)
    fixed = set(PENDING) - pending_seen
    assert not fixed, f"no longer broken, remove from PENDING: {sorted(fixed)}"


@pytest.mark.parametrize("rel,limit", sorted(LINE_LIMITS.items()))
def test_doc_line_limits(rel, limit):
    n = len((ROOT / rel).read_text().splitlines())
    assert n <= limit, f"{rel} has {n} lines (at most {limit}): a manual, not a log"


# ---------------------------------------------------------------------------------------------
# the README's figures are benchmarks.md's
# ---------------------------------------------------------------------------------------------

def _md_tables(text: str) -> list[list[list[str]]]:
    """Every markdown table of a text: rows of stripped cells, the header first, no separator."""
    tables, cur = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                cur.append(cells)
        elif cur:
            tables.append(cur)
            cur = []
    return tables


def _table(text: str, *header_cells: str) -> list[dict]:
    """The rows (as header -> cell) of the one table whose header starts with header_cells."""
    found = [t for t in _md_tables(text) if tuple(t[0][:len(header_cells)]) == header_cells]
    assert len(found) == 1, f"{len(found)} tables start with {header_cells}"
    head = found[0][0]
    return [dict(zip(head, row)) for row in found[0][1:]]


def _num(cell: str) -> float:
    return float(re.match(r"[-−]?[\d,]*\.?\d+", cell).group(0).replace(",", "").replace("−", "-"))


def _readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    i = text.index(title)
    j = text.find("\n## ", i + 1)
    return text[i:] if j < 0 else text[i:j]


def _grab(pattern: str, text: str) -> tuple:
    m = re.search(pattern, re.sub(r"\s+", " ", text))
    assert m, f"the README no longer says {pattern!r}: update it and this check together"
    return m.groups()


def _agrees(shown: str, value: float, table_digits: int = 3) -> bool:
    """A README figure rounded from a table's value (itself rounded to table_digits)."""
    digits = len(shown.split(".")[1]) if "." in shown else 0
    return abs(float(shown) - value) <= 0.5 * 10 ** -digits + 0.5 * 10 ** -table_digits + 1e-9


def _range_agrees(shown: str, values, table_digits: int = 1) -> bool:
    lo, hi = shown.split("–")
    return _agrees(lo, min(values), table_digits) and _agrees(hi, max(values), table_digits)


def test_readme_figures_are_the_benchmarks():
    readme = (ROOT / "README.md").read_text()
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    flat = re.sub(r"\s+", " ", bench)

    # CI and make demo: the Test suites table
    suites = {r["suite"]: r for r in _table(bench, "suite", "command", "result")}
    ci = suites["CPU suite (CI, fresh clone, fresh venv)"]
    total, skipped, passed = _grab(
        r"the suite has ([\d,]+) tests, (\d+) of which skip without a GPU \((\d+) passed", readme)
    pytest_s, = _grab(r"pytest (\d+) s of it", readme)
    make_s, = _grab(r"install and tests (\d+) s", readme)
    commit, = _grab(r"a CI run of `(\w+)`", readme)
    assert f"{passed} passed, {skipped} skipped" in ci["result"]
    assert int(total.replace(",", "")) == int(passed) + int(skipped)
    assert f"pytest {pytest_s} s" in ci["result"] and f"`make test` {make_s} s" in ci["result"]
    assert ci["commit"] == f"`{commit}`"
    demo = suites["`make demo` (fresh clone, new venv)"]
    minutes, demo_commit, job_s = _grab(
        r"`make demo` about ([\d.]+) minutes in all \(commit `(\w+)`, [\d-]+: the install, then "
        r"the job's (\d+) s\)", readme)
    assert demo["commit"] == f"`{demo_commit}`"
    assert f"the job's {job_s} s" in demo["result"] and f"about {minutes} minutes" in demo["result"]

    # make demo's sweep: plain EP's hottest rank at maxvio 20, MoonEP at exactly s*K
    job = _table(bench, "maxvio", "model", "recv max")
    ratio, copies = _grab(r"plain EP's hottest rank gets ([\d.]+)× that", readme)[0], \
        _grab(r"exactly s·K = (\d+) token copies", readme)[0]
    hottest = max(job, key=lambda r: _num(r["maxvio"]) if r["maxvio"] else -1)
    assert hottest["model"] == "plain EP" and hottest["max/mean"] == ratio
    assert all(r["recv max"] == copies for r in job if r["model"] == "MoonEP")

    # grouped GEMM: the model zoo
    gemm = _readme_section("## What it measures now")
    zoo = {r["kind"]: r for r in _table(bench, "kind", "ours/torch gm")}
    n_cases, zoo_commit = _grab(r"bench_gemm_zoo\.py`, ([\d,]+) cases, commit `(\w+)`", gemm)
    assert f"{n_cases} cases" in flat and f"Tree and library of commit `{zoo_commit}`" in flat
    fwd, dgrad, wgrad, skewed = _grab(
        r"forward ([\d.]+)×, dgrad ([\d.]+)×, wgrad ([\d.]+)× \(([\d.]+)× on skewed", gemm)
    for kind, v in (("fwd", fwd), ("dgrad", dgrad), ("wgrad_lp", wgrad)):
        assert _agrees(v, _num(zoo[kind]["ours/torch gm"])), kind
    assert _agrees(skewed, _num(zoo["wgrad_lp"]["skewed gm"]))
    below = _grab(r"(\d+) / (\d+) / (\d+) of (\d+) calls below 0\.98×", gemm)
    assert [zoo[k]["< 0.98"] for k in ("fwd", "dgrad", "wgrad_lp")] == [
        f"{b}/{below[3]}" for b in below[:3]]
    worst = _grab(r"the worst ([\d.]+)× / ([\d.]+)×", gemm)
    assert all(_agrees(w, _num(zoo[k]["min"])) for w, k in zip(worst, ("fwd", "dgrad")))
    assert _agrees(_grab(r"one wgrad mis-pick at ([\d.]+)×", gemm)[0], _num(zoo["wgrad_lp"]["min"]))
    dense = _grab(r"same FLOPs ([\d.]+)× / ([\d.]+)× / ([\d.]+)×", gemm)
    assert all(_agrees(d, _num(zoo[k]["ours/dense gm >= 32k rows"]))
               for d, k in zip(dense, ("fwd", "dgrad", "wgrad_lp")))
    within = float(_grab(r"the device's pick within ([\d.]+) % of the best", gemm)[0])
    held = [float(re.search(r"\(([\d.]+)\)", zoo[k]["ours/oracle gm (held out)"]).group(1))
            for k in ("fwd", "dgrad", "wgrad_lp")]
    assert _agrees(str(within), 100 * max(1 - h for h in held), 1)

    # device planner
    dev = _table(bench, "R", "E", "s", "routing", "group kernel best / median (µs)")
    med = lambda r, col: _num(r[col].split("/")[1].strip())        # noqa: E731
    ep8 = [r for r in dev if (r["R"], r["E"]) == ("8", "384")]
    ep64 = [r for r in dev if (r["R"], r["E"]) == ("64", "1024")]
    plan8, group8, plan64, torch_ms = _grab(
        r"in ([\d–]+) µs at EP 8, E = 384, s = 8192 \(the group kernel ([\d–]+) µs\), ([\d–]+) µs "
        r"at EP 64, E = 1024; the torch planner on the same GPU takes ([\d–]+) ms", gemm)
    whole = "whole plan best / median (µs)"
    assert _range_agrees(plan8, [med(r, whole) for r in ep8])
    assert _range_agrees(group8, [med(r, "group kernel best / median (µs)") for r in ep8])
    assert _range_agrees(plan64, [med(r, whole) for r in ep64])
    assert _range_agrees(torch_ms, [_num(r["torch planner, eager (µs)"]) / 1000
                                    for r in ep8 + ep64], 3)
    assert "Commit `%s`" % _grab(r"bench_plan_device\.py`, commit `(\w+)`", gemm)[0] in flat

    # soak
    soak_ms, soak_commit = _grab(r"([\d.]+) ms per step.*?soak_cuda\.py`, commit `(\w+)`", gemm)
    soak = _table(bench, "steps", "ms/step")
    assert soak[0]["ms/step"] == soak_ms and f"Commit `{soak_commit}`" in flat

    # policy "cost" on the device planner
    lo, hi = _grab(r"([\d.]+)–([\d.]+)× the exact policy's latency", readme)
    ratios = [_num(r["plan ratio"]) for r in _table(bench, "R", "E", "s", "routing", "level")]
    assert _agrees(lo, min(ratios), 2) and _agrees(hi, max(ratios), 2)

    # FP8: the GEMM, the training run, the layer step
    fp8 = {r["cases"]: r for r in _table(bench, "cases", "n", "ours / bf16 ours")}
    speed, n = _grab(r"Its GEMM is ([\d.]+)× our bf16 one \(geometric mean over (\d+) model-zoo",
                     readme)
    assert _agrees(speed, _num(fp8["all"]["ours / bf16 ours"])) and fp8["all"]["n"] == n
    loss = _grab(r"training run ends within ([\d.]+) % of bf16's loss", readme)[0]
    assert f"relative difference {loss} %" in flat
    fp8_ms, bf16_ms = _grab(r"slower than bf16 \(([\d.]+) against ([\d.]+) ms", readme)
    step = _table(bench, "experts a rank", "library", "bf16 captured")[0]     # the latest row
    assert _agrees(fp8_ms, _num(step["fp8 captured"]), 2)
    assert _agrees(bf16_ms, _num(step["bf16 captured"]), 2)


# ---------------------------------------------------------------------------------------------
# api.md's op table is the registered ops
# ---------------------------------------------------------------------------------------------

def test_api_op_table_matches_the_schemas():
    import torch

    import moonep_ops  # noqa: F401  (registers the ops)

    rows = _table((ROOT / "docs" / "api.md").read_text(), "op", "inputs", "outputs")
    documented = {}
    for r in rows:
        m = re.fullmatch(r"`(\w+)\((.*)\)`", r["op"])
        assert m, r["op"]
        documented[m.group(1)] = [a.strip().split("=")[0] for a in m.group(2).split(",") if a.strip()]
    registered = {}
    for name in dir(torch.ops.moonep):
        op = getattr(torch.ops.moonep, name)
        if hasattr(op, "default"):
            registered[name] = [a.name for a in op.default._schema.arguments]
    missing = sorted(set(registered) - set(documented))
    assert not missing, f"ops missing from docs/api.md's table: {missing}"
    unknown = sorted(set(documented) - set(registered))
    assert not unknown, f"docs/api.md documents ops that do not exist: {unknown}"
    wrong = {n: (documented[n], registered[n]) for n in documented
             if documented[n] != registered[n]}
    assert not wrong, f"docs/api.md's arguments differ from the schemas: {wrong}"
