"""The house's import rules (docs/design.md): no import circles between flowrl_jax's modules, every arrow points down
the rooms' order (`ROOMS`: no infrastructure module imports a job, no model imports the RL loop, ...), no job imports
another job, and the math rooms (sampling, credit, objectives, models) import no plotting or I/O module. Read from the
source with `ast` (every import statement, at module level or inside a function), so the check needs no import."""
import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "flowrl_jax")
MATH_ROOMS = ("flowrl_jax.sampling", "flowrl_jax.credit", "flowrl_jax.objectives", "flowrl_jax.models")
NOT_FOR_MATH = ("flowrl_jax.metrics", "flowrl_jax.checkpoint", "matplotlib", "PIL", "tensorboardX")
# The rooms, bottom up: a module may import its own level and the levels below it, never above (docs/design.md).
ROOMS = (
    ("flowrl_jax", "flowrl_jax.parallel", "flowrl_jax.paths", "flowrl_jax.compiler", "flowrl_jax.options", "flowrl_jax.config_lib",
     "flowrl_jax.keys",
     "flowrl_jax.checkpoint", "flowrl_jax.metrics"),                                   # infrastructure
    ("flowrl_jax.models",),                                                            # networks and their weights
    ("flowrl_jax.sampling", "flowrl_jax.data"),                                        # kernels, rollouts; prompt data
    ("flowrl_jax.rewards", "flowrl_jax.objectives", "flowrl_jax.credit"),              # rewards, losses, advantages
    ("flowrl_jax.worlds",),                                                            # settings: shapes, sd3
    ("flowrl_jax.rl",),                                                                # the RL loop's programs, state, plan
    ("flowrl_jax.jobs",),                                                              # what a user runs
    ("flowrl_jax.main",),                                                              # the one entry
)


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, f)
    return out


def _imports(name: str, path: str, known: set[str]) -> set[str]:
    """The modules `name` imports (flowrl_jax ones resolved to a known module, others by top-level package)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    resolved = set()
    for target in found:
        if target.startswith("flowrl_jax"):
            while target not in known:  # `from flowrl_jax.credit import spatial` -> flowrl_jax.credit.spatial
                target = target.rsplit(".", 1)[0]
            if target != name:
                resolved.add(target)
        else:
            resolved.add(target.split(".")[0])
    return resolved


MODULES = _modules()
GRAPH = {m: _imports(m, p, set(MODULES)) for m, p in MODULES.items()}


def test_no_import_circles():
    """Tarjan's strongly connected components of the import graph: every component is one module. `from pkg import mod`
    inside `pkg` names `pkg`, whose `__init__` Python has run already: an arrow to a module's own package is no circle."""
    edges = {m: {t for t in deps if t in MODULES and not m.startswith(t + ".")} for m, deps in GRAPH.items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(m):
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for t in sorted(edges[m]):
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in on_stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            component = []
            while True:
                component.append(stack.pop())
                on_stack.discard(component[-1])
                if component[-1] == m:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for m in sorted(edges):
        if m not in index:
            visit(m)
    assert not circles, f"import circles: {circles}"


def _level(module: str) -> int:
    matches = [(len(room), level) for level, rooms in enumerate(ROOMS) for room in rooms
               if module == room or module.startswith(room + ".")]
    assert matches, f"{module} is in no room of ROOMS: add it"
    return max(matches)[1]  # the most specific room


def test_every_import_points_down_the_rooms():
    up = sorted(f"{m} ({_level(m)}) -> {t} ({_level(t)})" for m, deps in GRAPH.items() for t in deps
                if t in MODULES and _level(t) > _level(m))
    assert not up, "imports that point up the rooms:\n" + "\n".join(up)


def test_no_job_imports_another_job():
    jobs = {m for m in MODULES if m.startswith("flowrl_jax.jobs.")}
    across = sorted(f"{m} -> {t}" for m in jobs for t in GRAPH[m] if t in jobs)
    assert not across, across


def test_the_package_root_holds_at_most_twelve_modules():
    root_modules = sorted(f for f in os.listdir(ROOT) if f.endswith(".py"))
    assert len(root_modules) <= 12, root_modules


def _room(module: str) -> str:
    """docs/design.md's room of a module: `infrastructure` for the first level of ROOMS, else its package under flowrl_jax."""
    return "infrastructure" if module in ROOMS[0] else module.split(".")[1]


def room_graph(graph: dict) -> dict[str, set[str]]:
    """{room: the other rooms its modules import}."""
    out = {_room(m): set() for m in graph}
    for m, deps in graph.items():
        out[_room(m)] |= {_room(t) for t in deps if t in MODULES and _room(t) != _room(m)}
    return out


def design_table(text: str) -> dict[str, set[str]]:
    """{room: the rooms it imports} from the table of docs/design.md's "Rooms" section (first and last columns)."""
    section = text.split("## Rooms", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| `")]
    return {cells[0].strip().strip("`"): {r.strip() for r in cells[-1].split(",") if r.strip() not in ("", "—")} for cells in rows}


def test_the_design_doc_draws_the_house_the_imports_draw():
    """docs/design.md's rooms table names every room and, for each, exactly the rooms its modules import."""
    with open(os.path.join(os.path.dirname(ROOT), "docs", "design.md")) as f:
        declared = design_table(f.read())
    actual = room_graph(GRAPH)
    assert declared == actual, {r: (sorted(declared.get(r, ())), sorted(actual.get(r, ()))) for r in declared.keys() | actual.keys()
                                if declared.get(r) != actual.get(r)}


def test_the_checks_see_a_circle_and_an_upward_arrow():
    """The rules on a graph with a planted circle, an arrow up and an arrow the design doc lacks (no check passes vacuously)."""
    global GRAPH
    saved = GRAPH
    try:
        GRAPH = {**saved, "flowrl_jax.parallel": saved["flowrl_jax.parallel"] | {"flowrl_jax.jobs.train"}}
        with pytest.raises(AssertionError, match="point up"):
            test_every_import_points_down_the_rooms()
        GRAPH = {**saved, "flowrl_jax.sampling.kernels": saved["flowrl_jax.sampling.kernels"] | {"flowrl_jax.sampling.rollout"}}
        with pytest.raises(AssertionError, match="import circles"):
            test_no_import_circles()
        GRAPH = {**saved, "flowrl_jax.models.lora": saved["flowrl_jax.models.lora"] | {"flowrl_jax.data.shapes"}}
        with pytest.raises(AssertionError, match="models"):  # an arrow the design doc does not draw
            test_the_design_doc_draws_the_house_the_imports_draw()
    finally:
        GRAPH = saved


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(MATH_ROOMS)))
def test_math_modules_import_no_job_plotting_or_io(module):
    bad = sorted(t for t in GRAPH[module] if t.startswith(NOT_FOR_MATH))
    assert not bad, f"{module} imports {bad}"


HIDE_TORCH = """
import importlib.abc, importlib.util, sys
class _NoTorch(importlib.abc.MetaPathFinder):  # a machine without PyTorch, as the quickstart's install is
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("no torch here")
sys.meta_path.insert(0, _NoTorch())
_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name.split(".")[0] == "torch" else _find(name, *a, **k)
"""


@pytest.mark.parametrize("module, advised", [("transformers", True), ("flowrl_jax.models.text", False)])
def test_no_pytorch_advisory_from_our_tokenizer_imports(module, advised):
    """Without PyTorch, transformers opens with "PyTorch was not found. Models won't be available ..."; flowrl_jax uses
    it for tokenizers only and silences that advisory (flowrl_jax/__init__.py). The bare import shows that the check
    sees the warning when it is there."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}  # this process imported flowrl_jax
    out = subprocess.run([sys.executable, "-c", HIDE_TORCH + f"import {module}"], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(ROOT), env=env)
    assert out.returncode == 0, out.stderr
    assert ("PyTorch was not found" in out.stderr) == advised, out.stderr
