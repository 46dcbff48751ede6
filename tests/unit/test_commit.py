"""A training state's commit (collgrad.checkpoint.training.put_in_place, over commit.py) on a real
directory: the files, the index and the manifest put in place, earlier checkpoints' tensor files gone
from the directory and from training_state/, and a file another save writes under one of their names
right after the commit never taken with them. No process group."""

from __future__ import annotations

import threading

from collgrad.checkpoint.commit import temporary
from collgrad.checkpoint.training import put_in_place


def _removals_done() -> None:
    for thread in threading.enumerate():
        if thread.name == "collgrad-remove-stale":
            thread.join()


def test_an_earlier_checkpoints_files_go_and_a_file_written_after_the_commit_stays(tmp_path):
    state = tmp_path / "training_state"
    state.mkdir()
    for name in ("model.safetensors", "model-00001-of-00002.safetensors", "model-0a1b-00001-of-00001.safetensors"):
        (tmp_path / name).write_text("earlier")
    (state / "fp32-0a1b-00001-of-00001.safetensors").write_text("earlier")
    (tmp_path / ".collgrad-stale-0000-model.safetensors.removing").write_text("left by a process that ended")
    (tmp_path / ".model-0a1b-00001-of-00001.safetensors.collgrad-tmp").write_text("left by a save that was killed")
    (tmp_path / "config.json").write_text("{}")
    finals = [
        tmp_path / "model-9f9f-00001-of-00001.safetensors",
        state / "fp32-9f9f-00001-of-00001.safetensors",
        tmp_path / "model.safetensors.index.json",
        state / "manifest.json",
    ]
    for final in finals:
        with open(temporary(str(final)), "w") as f:
            f.write("this checkpoint's")
    put_in_place(str(tmp_path), [(temporary(str(final)), str(final)) for final in finals])
    (tmp_path / "model.safetensors").write_text("a save_full_model right after")  # the same name
    _removals_done()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "model-9f9f-00001-of-00001.safetensors",
        "model.safetensors",
        "model.safetensors.index.json",
        "training_state",
    ]
    assert sorted(p.name for p in state.iterdir()) == ["fp32-9f9f-00001-of-00001.safetensors", "manifest.json"]
    assert (tmp_path / "model.safetensors").read_text() == "a save_full_model right after"
    assert all(final.read_text() == "this checkpoint's" for final in finals)
