"""The package's shape, checked on its source: the one door for collectives (nothing in ``state/`` issues
one but through the dispatcher, or the control exchanges of ``backends/agreement.py``)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "collgrad"

#: Calls that issue a collective: torch.distributed's functions, ProcessGroup's methods, and the
#: _compat wrappers the channels use. ``state/`` reaches none of them except through the Dispatcher.
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


def test_state_issues_no_collective_but_through_the_dispatcher():
    found = [item for path in sorted((PACKAGE / "state").rglob("*.py")) for item in _direct_collectives(path)]
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
