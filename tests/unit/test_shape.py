"""The package's shape, checked on its source: sizes (no module over 450 lines, no class over 150, no
function over 80) and the one door for collectives (nothing in ``grads/`` issues one but through the
dispatcher, or the control exchanges of ``backends/agreement.py``)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "collgrad"

MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 450, 150, 80


def _too_long(path: pathlib.Path, root: pathlib.Path = PACKAGE) -> list[str]:
    text = path.read_text()
    where = path.relative_to(root).as_posix()
    out = []
    if len(text.splitlines()) > MAX_MODULE:
        out.append(f"{where}: {len(text.splitlines())} lines")
    for node in ast.walk(ast.parse(text, filename=str(path))):
        limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                out.append(f"{where}: {node.name} {lines} lines")
    return out


def test_no_module_class_or_function_over_its_size():
    found = [item for path in sorted(PACKAGE.rglob("*.py")) for item in _too_long(path)]
    assert not found, "\n".join(found)


#: Calls that issue a collective: torch.distributed's functions, ProcessGroup's methods, and the
#: _compat wrappers the channels use. ``grads/`` reaches none of them except through the Dispatcher.
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "all_to_all",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "allreduce",
    "allgather",
    "allreduce_coalesced",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "all_gather_single_coalesced",
    "all_gather_flat",
    "all_gather_list",
    "all_gather_coalesced",
    "wait_work",
}
#: Receivers through which a collective could be reached without the dispatcher.
DIRECT = {"dist", "distributed", "_compat", "pg", "group", "process_group"}


def _direct_collectives(path: pathlib.Path, root: pathlib.Path = PACKAGE) -> list[str]:
    where = path.relative_to(root).as_posix()
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            receiver = node.value
            name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
            if name in DIRECT:
                out.append(f"{where}:{node.lineno}: {name}.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module in {"torch.distributed", "collgrad._compat"}:
            out += [f"{where}:{node.lineno}: imports {a.name}" for a in node.names if a.name in COLLECTIVES]
        elif isinstance(node, ast.ImportFrom) and node.module == "collgrad.backends.waits":
            out += [f"{where}:{node.lineno}: imports {a.name}" for a in node.names]
    return out


def test_grads_issues_no_collective_but_through_the_dispatcher():
    found = [item for path in sorted((PACKAGE / "grads").rglob("*.py")) for item in _direct_collectives(path)]
    assert not found, "\n".join(found)


def test_the_shape_checks_see_what_they_should(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text(
        "from collgrad._compat import all_gather_coalesced\n"
        "def f(pg, dispatcher):\n"
        "    _compat.all_gather_coalesced(pg, [], [])\n"
        "    torch.distributed.all_reduce(x)\n"
        "    pg.allgather([], [])\n"
        "    dispatcher.all_reduce([x])\n"
    )
    found = sorted(line.split(": ", 1)[1] for line in _direct_collectives(sample, tmp_path))
    assert found == [
        "_compat.all_gather_coalesced",
        "distributed.all_reduce",
        "imports all_gather_coalesced",
        "pg.allgather",
    ]
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION + "class C:\n    pass\n")
    assert [line.split(": ", 1)[1] for line in _too_long(long, tmp_path)] == [f"f {MAX_FUNCTION + 1} lines"]
