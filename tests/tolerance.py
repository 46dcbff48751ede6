"""Tolerances derived from the arithmetic, for comparisons that cannot be bitwise.

Two results that differ only in the order a sum of ``n`` floating-point terms was accumulated (a
backend's reduction order against the reference's) are each within ``(n - 1) * u * sum(|x|)`` of the
exact sum, first order, with ``u`` the unit roundoff (half the dtype's epsilon) [Higham, Accuracy and
Stability of Numerical Algorithms, 2nd ed., eq. 4.4]; a division (a mean) or a scaling by a non-power
of two adds ``u * |result|`` to each. So they differ by at most ``2 * n * u * sum(|x|)`` elementwise,
and in 2-norm by at most ``2 * n * u * ||sum(|x|)||`` (the norm of the elementwise bound). Relative to
the result that is ``2 * n * u * ||sum(|x|)|| / ||sum(x)||``: the ratio of norms is the magnitude factor
(1 where all terms have one sign, large where they cancel), computed from the data the test has.

A sum of squares (a norm) has terms of one sign: its relative error is at most ``(n - 1) * u``, and the
square root halves a relative error.
"""

from __future__ import annotations

import torch


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """Half the dtype's epsilon: the largest relative error of one rounding (round to nearest)."""
    return torch.finfo(dtype).eps / 2


def reordered_sum(terms: int, dtype: torch.dtype = torch.float32) -> float:
    """The factor of ``sum(|x|)`` two evaluations of a sum (or mean) of ``terms`` values, accumulated in
    different orders, may differ by: ``(terms - 1)`` roundings of the additions plus one of a division
    or scaling, on each side."""
    return 2 * terms * unit_roundoff(dtype)


def norm_of_sum_of_squares(terms: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative difference of two evaluations of ``sqrt(sum(x**2))`` over ``terms`` values accumulated in
    different orders: each square rounds (1), each addition (terms - 1), the square root halves the
    relative error and rounds once more (1), on each side."""
    return 2 * ((terms + 1) / 2 + 1) * unit_roundoff(dtype)
