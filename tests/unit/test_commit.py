"""A training state's commit (collgrad.state.training.commit) on a real directory: the manifest put in
place, earlier checkpoints' tensor files gone, and a file another save writes under one of their names
right after the commit never taken with them. No process group."""

from __future__ import annotations

import threading

from collgrad.state.training import commit


def _removals_done() -> None:
    for thread in threading.enumerate():
        if thread.name == "collgrad-remove-stale":
            thread.join()


def test_an_earlier_checkpoints_files_go_and_a_file_written_after_the_commit_stays(tmp_path):
    for name in ("model.safetensors", "model-00001-of-00002.safetensors", "fp32-old-00001-of-00001.safetensors"):
        (tmp_path / name).write_text("earlier")
    (tmp_path / ".collgrad-stale-0000-model.safetensors").write_text("left by a process that ended")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "fp32-new-00001-of-00001.safetensors").write_text("this checkpoint's")
    (tmp_path / ".training_state.json.new.tmp").write_text("{}")
    commit(
        str(tmp_path),
        [(str(tmp_path / ".training_state.json.new.tmp"), str(tmp_path / "training_state.json"))],
        {"fp32-new-00001-of-00001.safetensors"},
    )
    (tmp_path / "model.safetensors").write_text("a save_full_model right after")  # the same name
    _removals_done()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "fp32-new-00001-of-00001.safetensors",
        "model.safetensors",
        "training_state.json",
    ]
    assert (tmp_path / "model.safetensors").read_text() == "a save_full_model right after"
