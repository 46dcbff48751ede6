"""The dependency rule, enforced: each optional or private dependency is imported in one module only.

deepspeed   collgrad/grads/sources/deepspeed.py (the adapter; the benchmark reaches it through there)
mpi4py      collgrad/backends/mpi.py
torch._C    collgrad/_compat.py (private bindings change between torch versions)
FSDP2       collgrad/grads/sources/fsdp2.py (its internals tell an unreduced micro-step)
transformers, accelerate   collgrad/integrations/transformers.py (accelerate: read by attribute only)
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "collgrad"

HOMES = {
    "deepspeed": {"grads/sources/deepspeed.py"},
    "mpi4py": {"backends/mpi.py"},
    "torch._C": {"_compat.py"},
    "torch.distributed.fsdp": {"grads/sources/fsdp2.py"},
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
