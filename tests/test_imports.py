"""The house's import rules (DESIGN.md "Rooms"): no import circles between flowrl_jax's modules, and the math
rooms (sampling, credit, objectives, models) import no job, plotting or I/O module. Read from the source with
`ast` (every import statement, at module level or inside a function), so the check needs no import."""
import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "flowrl_jax")
MATH_ROOMS = ("flowrl_jax.sampling", "flowrl_jax.credit", "flowrl_jax.objectives", "flowrl_jax.models")
NOT_FOR_MATH = ("flowrl_jax.metrics", "flowrl_jax.train", "flowrl_jax.steps", "flowrl_jax.main", "flowrl_jax.assets",
                "flowrl_jax.checkpoint", "flowrl_jax.evaluate", "flowrl_jax.pretrain", "matplotlib", "PIL", "tensorboardX")


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


def _parents(module: str) -> set[str]:
    """Importing `a.b.c` runs `a/__init__` and `a/b/__init__` first: they are part of its import."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))} & set(MODULES)


def test_no_import_circles():
    edges = {m: {t for t in deps if t in MODULES} | (_parents(m) - {m}) for m, deps in GRAPH.items()}
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(edges[m]):
            if state.get(t) == "open" and not m.startswith(t + "."):  # a package importing its own submodule is no circle
                cycle = stack[stack.index(t):] + [t] if t in stack else [m, t]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])


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
