"""Run directory -> the keyword arguments of a claim's checker.

One extractor per claim of :data:`deqbench.reproduce.claims.CLAIMS`, registered in
:data:`EXTRACTORS` under the claim id. Each reads a run directory written by the runner
(``results.csv``, ``suite.yaml``, ``series/``) and returns an :class:`Extracted`: either the
checker's keyword arguments (``kwargs``; per-seed lists paired by position, seed ``i`` of the run
at index ``i``, a seed without a value NaN) or, where the run's analyses do not emit a
measurement the checker needs, ``kwargs=None`` and ``missing`` naming that measurement (the
caller reports ``not run`` with it). Rows count when their status is ``ok`` or ``flagged`` (a
flagged solve is data: the checker's convergence rule decides), never ``error``/``skipped``.

Measurements the analyses do not emit yet (what they should emit; the extractors work around
or say so):

* ``klr_agreement``: ``|p_KLR - 1/2|`` of each disagreeing pixel (it emits only a count at
  ``|p - 1/2| < 1e-6``; the checker's tie tolerance is 1e-7): disagreements at ties by 1e-6 give
  ``not run`` naming this measurement;
* ``ntk``: the fitted log-loss slope and the predicted slope as rows (the slope is fitted here
  from ``loss_at_eval``; the predicted one read from ``series/ntk__*.csv``);
* ``unroll_compare``: a per-step memory measurement on CPU finer than a fresh process's peak
  RSS (``activation_memory`` is used where ``peak_memory`` is not positive in every cell);
* ``trajectory``: nothing missing (``iterations_median``, ``silhouette``/``pca2``,
  ``converged_frac`` per recorded epoch);
* ``landscape``: nothing missing (``low_loss_area_frac``, ``converged_frac``).

Layout: this package's ``__init__`` holds what every extractor uses (:class:`Extracted`,
:func:`load`, :func:`suite_raw`, :func:`data_name`, :func:`seeds_of`, the private row readers, the
:data:`EXTRACTORS` registry with its ``@_extractor(claim_id)`` decorator and :func:`extract`); one
module per paper holds that paper's extractors: ``p001_kglm``, ``p002_pcdeq``, ``p003_opteq``,
``p004_ntk``, imported (so registered) at the end of ``__init__`` and their ``__all__``
re-exported here. A new claim: add the claim to ``claims.py``, its checker to
``checks/pNNN_*.py``, its extractor to ``extract/pNNN_*.py``.

Example:
    >>> from deqbench.reproduce.extract import EXTRACTORS
    >>> "002-lipschitz" in EXTRACTORS
    True
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._papers import load_papers

#: rows that carry a measurement (a flagged solve is data, the checker judges convergence)
MEASURED = ("ok", "flagged")
#: task statuses that count as a failed (NaN / inf / diverged / crashed) run
FAILED = ("diverged", "nan", "error", "oom")


@dataclass(frozen=True)
class Extracted:
    """What an extractor found.

    Attributes:
        kwargs: the checker's keyword arguments; None when a needed measurement is missing.
        missing: with ``kwargs=None``: the missing measurement, as a ``not run`` reason.
        notes: remarks for the report (e.g. a measurement taken from a neighbouring one).
    """

    kwargs: dict[str, Any] | None
    missing: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)


def _missing(what: str) -> Extracted:
    return Extracted(None, f"data: {what}")


# -- reading a run -------------------------------------------------------------------------------


#: the last run read by :func:`load`: ((results.csv, its size and mtime), its DataFrame); a report
#: judges up to a dozen claims on one run, each reading it (extractor, steps, epochs)
_LOADED: list[tuple[tuple[str, int, int], Any]] = []


def load(run_dir: str | Path) -> Any:
    """The run's results DataFrame (``variant`` "" where empty). The last run read is kept, so
    the claims sharing a run parse its ``results.csv`` once (read again when the file changes);
    each caller gets its own shallow copy."""
    from ...run.results import load_results

    path = Path(run_dir) / "results.csv"
    try:
        st = path.stat()
        key: tuple[str, int, int] | None = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    except OSError:
        key = None
    if key is not None and _LOADED and _LOADED[0][0] == key:
        return _LOADED[0][1].copy(deep=False)
    df = load_results(run_dir, check_keys=False)
    df = df.assign(variant=df["variant"].fillna("").astype(str))
    if key is not None:
        _LOADED[:] = [(key, df)]
    return df.copy(deep=False)


def suite_raw(run_dir: str | Path) -> dict[str, Any]:
    """The run's ``suite.yaml`` as a plain mapping ({} when absent or unreadable)."""
    from ...core.errors import ConfigError
    from ...run.yamlio import read_yaml

    p = Path(run_dir) / "suite.yaml"
    if not p.is_file():
        return {}
    try:
        raw, _ = read_yaml(p)
    except ConfigError:  # unreadable or invalid YAML (read_yaml's one-line errors)
        return {}
    return raw if isinstance(raw, dict) else {}


def data_name(run_dir: str | Path) -> str:
    """The dataset name of the run's suite (``""`` when unknown)."""
    data = suite_raw(run_dir).get("data")
    return str(data.get("name", "")) if isinstance(data, dict) else str(data or "")


def seeds_of(df: Any) -> list[int]:
    """The run's seeds, sorted (from every row, whatever its status)."""
    return sorted(int(s) for s in df["seed"].dropna().unique())


def _rows(df: Any, analysis: str, metric: str | None = None, variant: str | None = None) -> Any:
    d = df[(df["analysis"] == analysis) & df["status"].isin(MEASURED)]
    if metric is not None:
        d = d[d["metric"] == metric]
    if variant is not None:
        d = d[d["variant"] == variant]
    return d


def _per_seed(d: Any, seeds: Sequence[int], how: str = "median") -> list[float]:
    """One value per seed of the rows ``d`` (aggregated by ``how``), NaN where a seed has none."""
    out = []
    for s in seeds:
        v = d[d["seed"] == s]["value"].astype(float)
        out.append(float(getattr(v, how)()) if len(v) else math.nan)
    return out


def _curves(d: Any, seeds: Sequence[int], min_step: int = 0) -> list[list[float]]:
    """Per seed, the per-step values of rows ``d`` (median per step), steps >= ``min_step``."""
    out = []
    for s in seeds:
        g = d[(d["seed"] == s) & d["step"].notna()]
        g = g[g["step"].astype(int) >= min_step]
        out.append([float(v) for v in g.groupby(g["step"].astype(int))["value"].median()])
    return out


def _curve_first(d: Any, seed: int) -> float:
    g = d[d["seed"] == seed]
    if g.empty:
        return math.nan
    return float(g.loc[g["step"].astype(int).idxmin(), "value"])


def _curve_last(d: Any, seed: int) -> float:
    g = d[d["seed"] == seed]
    if g.empty:
        return math.nan
    return float(g.loc[g["step"].astype(int).idxmax(), "value"])


def _at_step(d: Any, seed: int, step: int) -> float:
    g = d[(d["seed"] == seed) & (d["step"] == step)]
    return float(g["value"].median()) if len(g) else math.nan


def _series_mean(path: Path, column: str) -> float:
    """Mean of the finite values of ``column`` in a series CSV (NaN when absent)."""
    import pandas as pd

    try:
        v = pd.to_numeric(pd.read_csv(path)[column], errors="coerce").dropna()
    except (OSError, KeyError, ValueError):
        return math.nan
    return float(v.mean()) if len(v) else math.nan


def _task_status(df: Any, cell: str, seed: int) -> str:
    r = df[(df["cell_id"] == cell) & (df["seed"] == seed) & (df["analysis"] == "runner")]
    return str(r["status"].iloc[-1]) if len(r) else "missing"


def _first(df: Any, cell: str, column: str) -> str:
    v = df.loc[df["cell_id"] == cell, column]
    v = v[v.astype(str) != ""]
    return str(v.iloc[0]) if len(v) else ""


def _cells(df: Any, **match: str) -> list[str]:
    d = df
    for col, val in match.items():
        d = d[d[col] == val]
    return sorted(d["cell_id"].unique())


def _activation(cell: str) -> str | None:
    m = re.search(r"activation=([a-z0-9]+)", cell)
    return m.group(1) if m else None


def _converged_share(df: Any, cell: str, seed: int) -> float:
    """Share of batches whose forward solve converged (the runner's convergence rows of the
    training and evaluation phases, ``1 - max forward_unconverged_batches``; the before-training
    phase is reported only), NaN when not recorded."""
    d = df[
        (df["analysis"] == "convergence")
        & (df["cell_id"] == cell)
        & (df["seed"] == seed)
        & (df["metric"] == "forward_unconverged_batches")
        & (df["variant"].isin(["train", "eval"]))
    ]
    v = d["value"].astype(float).dropna()
    return 1.0 - float(v.max()) if len(v) else math.nan


# -- the registry --------------------------------------------------------------------------------


Extractor = Callable[[Any, Path, str], Extracted]
#: claim id -> fn(results DataFrame, run directory, scale "cpu" | "paper") -> :class:`Extracted`
EXTRACTORS: dict[str, Extractor] = {}
#: claims whose extractor reads one run's own files or machine (series CSVs, run.json's device,
#: the suite's matrix): judged from one run only, never from a suite run in parts
ONE_RUN: set[str] = set()


def _extractor(claim_id: str, one_run: bool = False) -> Callable[[Extractor], Extractor]:
    def deco(fn: Extractor) -> Extractor:
        EXTRACTORS[claim_id] = fn
        if one_run:
            ONE_RUN.add(claim_id)
        return fn

    return deco


def extract(
    claim_id: str, run_dir: str | Path | Sequence[str | Path], scale: str = "cpu"
) -> Extracted:
    """The checker inputs of ``claim_id`` from ``run_dir`` (KeyError for an unknown claim).
    Several runs of one suite (parts of its grid, no cell in two, the same settings): their
    rows together, the suite settings read from the first; a claim of :data:`ONE_RUN` is then
    not run."""
    fn = EXTRACTORS[claim_id]
    if isinstance(run_dir, (str, Path)):
        return fn(load(run_dir), Path(run_dir), scale)
    dirs = [Path(d) for d in run_dir]
    if len(dirs) == 1:
        return fn(load(dirs[0]), dirs[0], scale)
    if claim_id in ONE_RUN:
        return Extracted(None, f"one run: this claim reads a run's own files or machine, and "
                               f"its suite ran in {len(dirs)} parts")  # fmt: skip
    import pandas as pd

    df = pd.concat([load(d) for d in dirs], ignore_index=True)
    return fn(df, dirs[0], scale)


def describe(ex: Extracted) -> str:
    """A short text of an extraction (for logs)."""
    if ex.kwargs is None:
        return ex.missing
    return ", ".join(f"{k}={_short(v)}" for k, v in ex.kwargs.items())


def _short(v: Any) -> str:
    if isinstance(v, Mapping):
        return "{" + ", ".join(str(k) for k in v) + "}"
    if isinstance(v, (list, tuple)):
        return f"[{len(v)}]"
    return str(v)


# -- the per-paper modules -----------------------------------------------------------------------


load_papers(__name__, __path__, globals())  # each pNNN_*.py registers its extractors
