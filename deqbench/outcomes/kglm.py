"""Outcome checks of the kGLM suites (REFERENCE.md 9.1-9.3, 9.4 sigma_max): the rows of
:func:`deqbench.kglm.analysis.kglm_outcomes` as outcome rows (``summary.csv``)."""

from __future__ import annotations

from typing import Any

from . import outcome, register

SUITES = (
    "kglm_klr",
    "kglm_smooth",
    "kglm_smooth_gpu",
    "kglm_denoise",
    "kglm_denoise_gpu",
    "kglm_init_cost",
    "kglm_pcdeq_sigma",
)


@register(*SUITES)
def check_kglm(df: Any) -> Any:
    import pandas as pd

    from ..kglm.analysis import kglm_outcomes

    rows = [outcome(c, "info" if h is None else h, detail=d) for c, h, d in kglm_outcomes(df)]
    return pd.DataFrame(rows)
