"""The docs are checked: every measured table is what its results file renders now, no heading is written twice,
everything the docs name exists, and the README stays short. Pure Python (no JAX): a second or two.

    python -m pytest -q -o addopts='' tests/test_docs.py
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import report  # noqa: E402  (benchmarks/report.py)

README_MAX_LINES = 250


def doc_paths() -> list[str]:
    return report.doc_files(ROOT)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def docs() -> dict[str, str]:
    return {os.path.relpath(p, ROOT): read(p) for p in doc_paths()}


# ----------------------------------------------------------------------------------------------------------------------
# The report blocks

def test_every_report_block_is_current():
    problems = report.check(ROOT)
    assert not problems, "stale report blocks (run `python benchmarks/report.py`):\n" + "\n".join(problems)


def test_every_renderer_is_used_exactly_once():
    used = [name for text in docs().values() for name, _ in report.blocks(text)]
    assert sorted(set(used)) == sorted(used), f"a report block appears twice: {sorted(n for n in set(used) if used.count(n) > 1)}"
    assert set(report.REPORTS) <= set(used), f"renderers no doc uses: {sorted(set(report.REPORTS) - set(used))}"


def _copy_source(rel: str, root: str) -> None:
    """The results file (or every JSON under the results folder) at the same relative path under `root`."""
    src = os.path.join(ROOT, rel)
    files = glob.glob(os.path.join(src, "**", "*.json"), recursive=True) if os.path.isdir(src) else [src]
    for f in files:
        dst = os.path.join(root, os.path.relpath(f, ROOT))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(f, dst)


def _mutate(x):
    """Every number changed (floats x 1.37, ints 3 n + 1), booleans and strings kept."""
    if isinstance(x, dict):
        return {k: _mutate(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_mutate(v) for v in x]
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return x
    return 3 * x + 1 if isinstance(x, int) else x * 1.37


def _undated(text: str) -> str:
    return report.DATE_FIELD.sub("date: ?", text)


@pytest.mark.parametrize("name", sorted(report.REPORTS))
def test_a_changed_result_changes_its_table(name, tmp_path):
    """On a copy outside git: the same data renders the same table (dates aside); changed numbers render another."""
    rel = report.REPORTS[name][0]
    _copy_source(rel, str(tmp_path))
    same = report.render(name, str(tmp_path))
    assert _undated(same) == _undated(report.render(name, ROOT))
    assert "date: date not recorded" in same or "(recorded in the file)" in same  # no git here: never an invented date
    for f in glob.glob(os.path.join(str(tmp_path), "**", "*.json"), recursive=True):
        with open(f) as fh:
            data = json.load(fh)
        with open(f, "w") as fh:
            json.dump(_mutate(data), fh)
    assert _undated(report.render(name, str(tmp_path))) != _undated(same)


def test_check_finds_a_stale_block_and_update_mends_it(tmp_path):
    """`report.py --check` on a copy of the docs and results (outside git, so dates are not compared): current, then
    stale after one value changes, then current again after `report.py` rewrites the block."""
    root = str(tmp_path)
    for rel in {rel for rel, _ in report.REPORTS.values()}:
        _copy_source(rel, root)
    for path in doc_paths():
        dst = os.path.join(root, os.path.relpath(path, ROOT))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(path, dst)
    assert report.check(root) == []
    results = os.path.join(root, report.REPORTS["compare_torch"][0])
    with open(results) as f:
        data = json.load(f)
    data["results"][0]["sides"]["flowrl_jax"]["iteration_s"] *= 2
    with open(results, "w") as f:
        json.dump(data, f)
    stale = report.check(root)
    assert len(stale) == 1 and "report:compare_torch" in stale[0], stale
    assert report.main(["--check", "--root", root]) == 1
    report.update(root)
    assert report.check(root) == []


# ----------------------------------------------------------------------------------------------------------------------
# One topic in one place; a short README

def test_no_heading_is_written_twice():
    """As the stop hook greps it: lines starting with 1-4 '#' and a space, code blocks included, trailing spaces cut."""
    lines = [line.rstrip() for text in docs().values() for line in text.splitlines() if re.match(r"#{1,4} ", line)]
    dup = sorted({line for line in lines if lines.count(line) > 1})
    assert not dup, f"headings written twice across README.md and docs/*.md: {dup}"


def test_readme_is_short_and_keeps_the_quickstart():
    text = read(os.path.join(ROOT, "README.md"))
    n = len(text.splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}: move the rest to docs/)"
    assert "## Quickstart" in text
    assert "python -m flowrl_jax.main --config configs/quickstart.py --workdir /tmp/q" in text
    assert "-r requirements-test.txt -e . && python -m pytest -q" in text


# ----------------------------------------------------------------------------------------------------------------------
# Everything the docs name exists

TOP = ("flowrl_jax", "configs", "benchmarks", "tpu_scripts", "tests", "docs")
PATH = re.compile(r"(?<![\w/.-])((?:%s)/[\w/.{},*+-]*)" % "|".join(TOP))
MODULE = re.compile(r"python3? -m (flowrl_jax[\w.]*)|from (flowrl_jax[\w.]*) import")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
TABLE_CONFIG = re.compile(r"^\| `(\w+\.py)`(?: / `(\w+\.py)`)? \|", re.M)


def expand(path: str) -> list[str]:
    """Brace groups expanded: 'a/{b,c}.py' -> ['a/b.py', 'a/c.py']."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in expand(path[:m.start()] + alt + path[m.end():])]


def exists(rel: str) -> bool:
    rel = rel.rstrip(".,")
    if "*" in rel:
        return bool(glob.glob(os.path.join(ROOT, rel)))
    return os.path.exists(os.path.join(ROOT, rel))


def named_paths() -> dict[str, set[str]]:
    """Every repository path the docs name, by kind: configs, flowrl_jax files, benchmarks, tpu_scripts, the rest."""
    found: dict[str, set[str]] = {top: set() for top in TOP}
    for text in docs().values():
        for m in PATH.finditer(text):
            token = m.group(1).rstrip(".,")
            for p in expand(token):
                found[p.split("/")[0]].add(p)
    return found


def _missing(kind: str) -> list[str]:
    return sorted(p for p in named_paths()[kind] if not exists(p))


@pytest.mark.parametrize("kind", ["configs", "flowrl_jax", "benchmarks", "tpu_scripts", "tests"])
def test_every_named_path_exists(kind):
    """`configs/x.py`, `flowrl_jax/....py` (and folders), `benchmarks/*.py|*.sh` and results, `tpu_scripts/*.sh`, tests."""
    missing = _missing(kind)
    assert not missing, f"the docs name {kind}/ paths that do not exist: {missing}"


def test_every_config_of_the_method_table_exists():
    text = read(os.path.join(ROOT, "docs", "methods.md"))
    names = {n for m in TABLE_CONFIG.finditer(text) for n in m.groups() if n}
    assert len(names) >= 10, names
    missing = sorted(n for n in names if not exists(f"configs/{n}"))
    assert not missing, f"configs in the method table that do not exist: {missing}"


def test_every_named_module_exists():
    """`python -m flowrl_jax.x.y` and `from flowrl_jax.x import ...`: the dotted name resolves to a file or a package."""
    missing = set()
    for text in docs().values():
        for m in MODULE.finditer(text):
            dotted = m.group(1) or m.group(2)
            rel = dotted.replace(".", "/")
            if not (exists(rel + ".py") or exists(os.path.join(rel, "__init__.py"))):
                missing.add(dotted)
    assert not missing, f"modules the docs run or import that do not exist: {sorted(missing)}"


def test_every_relative_link_resolves():
    missing = set()
    for path in doc_paths():
        for m in LINK.finditer(read(path)):
            target = m.group(1).split("#")[0]
            if not target or re.match(r"[a-z]+:", target):
                continue  # an anchor in the same file, or a URL
            if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), target))):
                missing.add(f"{os.path.relpath(path, ROOT)} -> {target}")
    assert not missing, f"relative links to nothing: {sorted(missing)}"


# ----------------------------------------------------------------------------------------------------------------------
# The math the code cites

SOURCE_GLOBS = ("flowrl_jax/**/*.py", "tests/*.py", "benchmarks/*.py", "configs/*.py")
MATH_SECTION = re.compile(r"math\.md §(\d+)")


def _sources() -> dict[str, str]:
    files = sorted({f for g in SOURCE_GLOBS for f in glob.glob(os.path.join(ROOT, g), recursive=True)})
    return {os.path.relpath(f, ROOT): read(f) for f in files}


def test_every_math_section_the_code_cites_is_in_docs_math():
    sections = set(re.findall(r"^## §(\d+)\.", read(os.path.join(ROOT, "docs", "math.md")), re.M))
    cited = {(path, n) for path, text in _sources().items() for n in MATH_SECTION.findall(text)}
    assert len(cited) > 40  # the code cites it throughout: an empty set would mean the pattern broke
    assert not {(p, n) for p, n in cited if n not in sections}, sorted((p, n) for p, n in cited if n not in sections)


def test_no_reference_points_outside_the_repository():
    """The math once lived in a SPEC.md and the rooms in a DESIGN.md outside the repository; a clone has neither."""
    stale = sorted(p for p, text in _sources().items()
                   if p != os.path.join("tests", "test_docs.py") and re.search(r"\bSPEC\b|SPEC\.md|\bDESIGN\.md", text))
    assert not stale, stale


def test_the_engineering_log_stays_a_log():
    """WORKSPACE_NOTES.md holds what is in force today (<= 300 lines); the history lives in git and docs/."""
    with open(os.path.join(ROOT, "WORKSPACE_NOTES.md")) as f:
        assert len(f.read().splitlines()) <= 300


def test_a_recorded_cpu_model_reaches_the_table_and_a_missing_one_is_said():
    """Benchmarks record the CPU (`benchmarks/machine.py`); the line under a table names it, or says it was not recorded."""
    import machine  # benchmarks/machine.py
    env = machine.describe()
    assert env["cpu"] and env["cpu_count"] == os.cpu_count()
    assert report.machine(env) == f"machine: {env['cpu']}, {env['cpu_count']} cores ({env['machine']})"
    assert "CPU model not recorded" in report.machine({"machine": "x86_64", "cpu_count": 2})
