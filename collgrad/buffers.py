"""Small helpers on tensor memory shared by the dispatcher and the sources."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["adjacent_view"]


def adjacent_view(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D view covering ``parts`` if they are contiguous, of one dtype, and lie back to back in
    one storage in this order; else None. Lets a bucket of views into an existing flat buffer travel
    without a packing copy."""
    if not parts:
        return None
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for p in parts:
        if (
            not p.is_contiguous()
            or p.dtype != first.dtype
            or p.device != first.device
            or p.untyped_storage().data_ptr() != storage
            or p.data_ptr() != end
        ):
            return None
        end = p.data_ptr() + p.numel() * p.element_size()
    total = sum(p.numel() for p in parts)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (total,), (1,))
