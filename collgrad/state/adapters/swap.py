"""ZeRO-3 with the optimizer on NVMe: gradient partitions of swapped sub-groups, one sub-group swapped in
at a time. Works on the optimizer object it is given; deepspeed itself is never imported here.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SwappedIn"]


class SwappedIn:
    """ZeRO-3 with the optimizer on NVMe: the gradient partitions of swapped sub-groups, one sub-group
    swapped in at a time. DeepSpeed's per-parameter accessors (``_get_fp32_grad_state_partition``,
    ``set_local_grad_for_param``) swap the parameter's whole sub-group in, into buffers from a fixed
    pool, every time they are called: per parameter, reading runs the pool dry (DeepSpeed asserts)
    and writing moves a sub-group per parameter. Here a sub-group goes in once and back (its
    gradients written back with ``write_back``, else released) when the next one is needed or at
    the end; after an exception the sub-group held is released without writing back."""

    def __init__(self, opt: Any, *, write_back: bool) -> None:
        self.opt, self.write_back = opt, write_back
        self.held: int | None = None

    def grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """This rank's fp32 gradient partition of ``param`` in the swap buffers, or None when its
        sub-group is not swapped (it lies in memory)."""
        opt = self.opt
        group_idx, offset, numel = opt.grad_position[opt.get_param_id(param)]
        if not opt._swappable_optimizer_subgroup(group_idx):
            return None
        if self.held != group_idx:
            self._let_go(self.write_back)
            opt._get_fp32_grad_state_partition(param, release_swap_buffers=False)  # swaps the sub-group in
            self.held = group_idx
        part: torch.Tensor = opt.fp32_partitioned_groups_flat[group_idx].grad.narrow(0, offset, numel)
        return part

    def _let_go(self, write_back: bool) -> None:
        held, self.held = self.held, None
        if held is None:
            return
        if write_back:
            self.opt._writeback_swap_state(held, write_opt_state=False, write_gradients=True)
        else:
            self.opt._release_swap_buffers(held)

    def __enter__(self) -> SwappedIn:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self._let_go(self.write_back and kind is None)
