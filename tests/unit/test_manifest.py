"""A training state's manifest written and read back without a process group: each parameter's states
that are not per element (Adam's step counts) kept once per distinct value and read back as they were."""

from __future__ import annotations

import json
import math

import torch

from collgrad.checkpoint.manifest import MANIFEST_NAME, Manifest, ParamGroup, read_manifest


def test_states_are_kept_once_per_value_and_read_back_as_they_were(tmp_path):
    """Equal states share one entry (a shared holder, or equal values: 40,000 step counts of one value are
    one); values that compare equal but encode apart stay apart: -0.0 and 0.0, a bf16 and an fp32 zero,
    1, True and 1.0, tensors of other shapes; a NaN reads back a NaN."""
    shared = {"step": torch.tensor(3.0)}
    states = {
        **{f"p{k}": {"step": torch.tensor(7.0)} for k in range(1000)},
        "shared_a": shared,
        "shared_b": shared,
        "neg_zero": {"step": torch.tensor(-0.0)},
        "zero": {"step": torch.tensor(0.0)},
        "bf16_zero": {"step": torch.tensor(0.0, dtype=torch.bfloat16)},
        "vector": {"step": torch.zeros(1)},
        "one": {"step": 1},
        "true": {"step": True},
        "one_float": {"step": 1.0},
        "listed": {"betas": [0.9, 0.99]},
        "nan": {"step": float("nan")},
    }
    manifest = Manifest(
        "0" * 16, {}, {"w": "model.safetensors"}, {}, {}, (ParamGroup(tuple(states), {"lr": 0.1}),), states, None, {}
    )
    text = manifest.to_json()
    (tmp_path / MANIFEST_NAME).parent.mkdir()
    (tmp_path / MANIFEST_NAME).write_bytes(text)
    written = json.loads(text)["param_states"]
    assert len(written["values"]) == 11  # the 1,000 equal ones one; the shared holder one; the rest each
    back = read_manifest(str(tmp_path)).param_states
    assert set(back) == set(states)  # (the manifest lists them by name, sorted)
    for name, held in states.items():
        assert [(type(k), k) for k in back[name]] == [(type(k), k) for k in held], name
        for key, value in held.items():
            got = back[name][key]
            if isinstance(value, torch.Tensor):
                assert got.dtype == value.dtype and got.shape == value.shape, name
                assert torch.equal(got, value) and torch.equal(got.signbit(), value.signbit()), name
            elif isinstance(value, float) and math.isnan(value):
                assert math.isnan(got), name
            else:
                assert got == value and type(got) is type(value), name
