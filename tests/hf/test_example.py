"""The examples run as written: the Trainer example writes its chart; examples/ema_and_save.py
keeps an EMA of the fp32 master weights per ZeRO-3 partition, saves it, and AutoModelForCausalLM loads
it: bitwise the EMA of the whole weights gathered every step (--check); examples/load_pretrained.py
loads each rank its own bytes; examples/resume_anywhere.py resumes a ZeRO-2 run on 2 ranks under ZeRO-3 on
3 (bitwise) and FSDP2 on 2 (training on as uninterrupted), and from_pretrained loads its directory."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'collgrad[hf]')")

from tests.harness import run_example


def test_trainer_grad_norms_example_writes_its_chart(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install 'collgrad[plot]')")
    png = tmp_path / "norms.png"
    stdout = run_example("trainer_grad_norms", "--steps", "3", "--png", str(png))
    steps = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all("global norm" in line for line in steps)
    assert png.stat().st_size > 10_000


def test_ema_example_saves_a_model_transformers_loads(tmp_path):
    out = tmp_path / "ema"
    stdout = run_example("ema_and_save", "--out", str(out), "--steps", "3", "--check")
    assert "from_pretrained loads the EMA model: True; equal to the EMA of the gathered weights: True" in stdout
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}


def test_load_pretrained_example_loads_each_rank_its_own_bytes(tmp_path):
    stdout = run_example("load_pretrained", "--out", str(tmp_path / "gpt2-tiny"))
    lines = stdout.splitlines()
    total = int(next(line for line in lines if line.startswith("save_pretrained wrote")).split()[-2])
    read = [int(line.split()[4]) for line in lines if " rank " in line and "read" in line]
    equal = [line for line in lines if "logits equal to from_pretrained's" in line]
    assert len(read) == 4 and all(r < total * 0.6 for r in read), stdout  # ZeRO-3 and FSDP2, 2 ranks each
    assert len(equal) == 4 and all(line.endswith("True") for line in equal), stdout


def test_resume_anywhere_example_resumes_at_another_world_size_stage_and_framework(tmp_path):
    stdout = run_example("resume_anywhere", "--out", str(tmp_path / "run"))
    assert "ZeRO-3, 3 ranks: fp32 masters and Adam states equal to the saved: True" in stdout, stdout
    assert "as the uninterrupted run's: True" in stdout, stdout
    assert "logits equal to the model's at the save: True" in stdout, stdout
    assert "DeepSpeed's own checkpoint, converted: from_pretrained's logits equal: True" in stdout, stdout
