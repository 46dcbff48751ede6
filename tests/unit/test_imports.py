"""The dependency rule, enforced: each optional or private dependency is imported in one module only.

deepspeed   collgrad/state/adapters/deepspeed.py (the adapter) and deepspeed_local.py (what run_local's rank
            server changes of DeepSpeed for its ranks, imported by that server alone),
            collgrad/bench/frameworks.py (the benchmark's engines and DeepSpeed's own paths it measures against)
mpi4py      collgrad/backends/mpi.py
torch._C    collgrad/_compat.py (private bindings change between torch versions)
FSDP2       collgrad/state/adapters/fsdp2.py (its internals tell an unreduced micro-step),
            collgrad/bench/frameworks.py (the benchmark's fully_shard model and its anchors)
transformers, accelerate   collgrad/integrations/transformers.py (accelerate: read by attribute only)
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "collgrad"

HOMES = {
    "deepspeed": {"state/adapters/deepspeed.py", "state/adapters/deepspeed_local.py", "bench/frameworks.py"},
    "mpi4py": {"backends/mpi.py"},
    "torch._C": {"_compat.py"},
    "torch.distributed.fsdp": {"state/adapters/fsdp2.py", "bench/frameworks.py"},
    "transformers": {"integrations/transformers.py"},
    "accelerate": set(),
}


def _imports(path: pathlib.Path) -> set[str]:
    """Every module name imported anywhere in the file (top level, in functions, relative ones resolved
    far enough to tell collgrad's own modules apart)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _offenders(dependency: str) -> set[str]:
    out = set()
    for path in PACKAGE.rglob("*.py"):
        names = _imports(path)
        if any(n == dependency or n.startswith(dependency + ".") for n in names):
            out.add(path.relative_to(PACKAGE).as_posix())
    return out


@pytest.mark.parametrize("dependency", sorted(HOMES))
def test_each_dependency_is_imported_in_its_one_module_only(dependency):
    assert _offenders(dependency) == HOMES[dependency]


def test_the_rule_sees_imports_inside_functions_and_from_imports(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("def f():\n    from deepspeed.utils import x\n    import mpi4py.MPI\nfrom torch import _C\n")
    names = _imports(sample)
    assert "deepspeed.utils" in names and "mpi4py.MPI" in names and "torch._C" in names


# --- the package's own imports: layers and cycles ---------------------------------------------------
#: Lower layers first; a module may import its own layer and the ones below it, never one above.
#: ``errors`` and ``_compat`` sit below all three; the top level (``collgrad/__init__``, cli, launch,
#: bench, integrations) may import any of them.
LAYERS = ("backends", "core", "state", "checkpoint")
BASE = {"collgrad.errors", "collgrad._compat"}


def _module_name(path: pathlib.Path) -> str:
    parts = ["collgrad", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _edges(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The collgrad modules ``path`` imports, anywhere in it (inside functions too): ``from a import b``
    is an edge to ``a.b`` where that is a module, else to ``a``."""
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in modules else base)
    return {m for m in out if m in modules and m != here}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _edges(path, modules) for name, path in modules.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return -1 if module in BASE else None


def test_layers_import_downwards_only():
    wrong = []
    for module, targets in _graph().items():
        mine = _layer(module)
        if mine is None:
            continue  # the top level
        for target in targets:
            theirs = _layer(target)
            if theirs is None or theirs > mine:
                wrong.append(f"{module} -> {target}")
    layering = " <- ".join(LAYERS)
    assert not wrong, f"imports against the layering ({layering}):\n" + "\n".join(sorted(wrong))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_the_package():
    assert _cycles(_graph()) == []


def test_the_layer_and_cycle_checks_see_what_they_should(tmp_path):
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert _layer("collgrad.core.dispatch") == 1 and _layer("collgrad.backends.registry") == 0
    assert _layer("collgrad.errors") == -1 and _layer("collgrad.cli") is None
    modules = _modules()
    edges = _edges(PACKAGE / "state" / "read.py", modules)
    assert "collgrad.core.dispatch" in edges and "collgrad" not in edges
