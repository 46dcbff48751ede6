"""An edit of every full gradient written before a step, by either writing path (for the tests that
train with edits and compare with plain PyTorch)."""

from __future__ import annotations

from typing import Any, Callable

import torch


def write_edit(model: Any, how: str, edit: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
    """``how="set"``: read every full gradient, write ``edit(name, grad)`` back; ``"update"``: stream them
    through ``edit`` (small buckets, so several)."""
    import collgrad

    if how == "set":
        grads = collgrad.safe_get_full_model_grads(model)
        collgrad.safe_set_full_model_grads(model, {n: edit(n, g) for n, g in grads.items()})
    else:
        collgrad.safe_update_full_model_grads(model, edit, bucket_bytes=512)
