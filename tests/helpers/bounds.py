"""NaN-proof numeric checks for tests: a NaN is never within a bound, and no maximum drops it.

Every comparison with NaN is False, so `if diff > bound: fail` lets a NaN through where `diff <= bound` does not:
`excess` is written that way. Python's builtin `max` keeps a NaN only where it comes first (`max(nan, 1.0)` is nan,
`max(1.0, nan)` is 1.0), so `max(errors) < tol` passes or fails a NaN by its position; `worst` returns NaN wherever
the NaN sits, as torch's `max` does. Check with `assert worst(errors) < tol` or `if excess(diff, bound) is not None`.
"""
from __future__ import annotations

import math
from collections.abc import Iterable


def excess(value: float, bound: float) -> float | None:
    """None when `value <= bound`; otherwise `value / bound`, or inf where that is not a finite number (a NaN on
    either side, a bound <= 0), so that a NaN ranks as the worst violation."""
    if value <= bound:
        return None
    ratio = value / bound if bound > 0 else math.inf
    return ratio if math.isfinite(ratio) else math.inf


def worst(values: Iterable[float]) -> float:
    """The largest of `values`, NaN if any of them is NaN; raises on no values (nothing was compared)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("worst() of no values: nothing was compared")
    return math.nan if any(math.isnan(v) for v in values) else max(values)
