"""Outcome checks of the OptEq suites (papers/003; REFERENCE.md 9.5): opteq, opteq_gpu.
The checks live with the unroll_compare analysis."""

from __future__ import annotations

from typing import Any

from . import register


@register("opteq", "opteq_gpu")
def check_opteq(df: Any) -> Any:
    from ..performance.unroll_compare import opteq_outcomes  # lazy: imports torch

    return opteq_outcomes(df)
