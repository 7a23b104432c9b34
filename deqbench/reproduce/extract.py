"""Run directory -> the keyword arguments of a claim's checker (issue 26, part 4).

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


def load(run_dir: str | Path) -> Any:
    """The run's results DataFrame (``variant`` "" where empty)."""
    from ..run.results import load_results

    df = load_results(run_dir, check_keys=False)
    return df.assign(variant=df["variant"].fillna("").astype(str))


def suite_raw(run_dir: str | Path) -> dict[str, Any]:
    """The run's ``suite.yaml`` as a plain mapping ({} when absent or unreadable)."""
    import yaml

    p = Path(run_dir) / "suite.yaml"
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8")) if p.is_file() else {}
    except (OSError, yaml.YAMLError):
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


Extractor = Callable[[Any, Path, str], Extracted]
#: claim id -> fn(results DataFrame, run directory, scale "cpu" | "paper") -> :class:`Extracted`
EXTRACTORS: dict[str, Extractor] = {}


def _extractor(claim_id: str) -> Callable[[Extractor], Extractor]:
    def deco(fn: Extractor) -> Extractor:
        EXTRACTORS[claim_id] = fn
        return fn

    return deco


def extract(claim_id: str, run_dir: str | Path, scale: str = "cpu") -> Extracted:
    """The checker inputs of ``claim_id`` from ``run_dir`` (KeyError for an unknown claim)."""
    fn = EXTRACTORS[claim_id]
    return fn(load(run_dir), Path(run_dir), scale)


# -- 001 -----------------------------------------------------------------------------------------


@_extractor("001-klr-equivalence")
def klr_equivalence(df: Any, run_dir: Path, scale: str) -> Extracted:
    """``klr_agreement`` rows of the informed (``kglm_informed``) and random cells, float64
    where measured (else float32). ``klr_agreement`` counts disagreeing pixels and those at ties
    by ``|p_KLR - 1/2| < 1e-6``, not each pixel's distance: disagreements away from ties enter as
    distance 1e-6 (a lower bound, beyond the checker's 1e-7); disagreements at ties cannot be
    judged against 1e-7 (missing measurement) unless others already decide the verdict."""
    k = df[df["analysis"] == "klr_agreement"]
    informed = _cells(k, init="kglm_informed")
    if not informed:
        return _missing("no klr_agreement rows of a kglm_informed cell")
    dt = "float64" if (k["variant"] == "float64").any() else "float32"

    def val(cell: str, metric: str) -> float:
        d = _rows(k[k["cell_id"] == cell], "klr_agreement", metric, dt)
        return float(d["value"].max()) if len(d) else math.nan

    cell = informed[0]
    pixels, dis, ties = (val(cell, m) for m in ("pixels", "disagreeing_pixels",
                                                  "disagreeing_pixels_at_ties"))  # fmt: skip
    if not all(math.isfinite(x) for x in (pixels, dis, ties)):
        return _missing("klr_agreement pixels / disagreeing_pixels(_at_ties) not measured")
    off = int(dis - ties)
    if ties > 0 and off == 0:
        return _missing(
            f"{int(ties)} disagreeing pixels within 1e-6 of a tie: klr_agreement does not emit "
            "|p_KLR - 1/2| per disagreeing pixel (the checker's tie tolerance is 1e-7)"
        )
    max_iter = (suite_raw(run_dir).get("defaults") or {}).get("solver", {}) or {}
    cap = float(max_iter.get("max_iter", math.inf)) if isinstance(max_iter, dict) else math.inf
    nstep = val(cell, "deq_nstep")
    statuses = set(k[k["cell_id"] == cell]["status"])
    conv = df[(df["cell_id"] == cell) & (df["analysis"] == "convergence")]["value"]
    converged = (
        statuses <= {"ok"}
        and (not len(conv) or float(conv.max()) == 0.0)
        and (not math.isfinite(nstep) or nstep < cap)
    )
    random = _cells(k, init="kglm_random")
    rnd = val(random[0], "disagreeing_pixels") if random else math.nan
    return Extracted(
        {
            "pixels": int(pixels),
            "tie_distances": [1e-6] * off + [0.0] * int(ties),
            "converged": bool(converged),
            "random_disagreeing": int(rnd) if math.isfinite(rnd) else None,
        },
        notes=(f"dtype {dt}",),
    )


def _scheme(init: str) -> str:
    return {"kglm_informed": "informed", "kglm_random": "random", "kglm_naive": "naive"}.get(
        init, init
    )


def _mse_by_epoch(df: Any, cell: str, seeds: Sequence[int]) -> dict[int, list[float]]:
    d = _rows(df[df["cell_id"] == cell], "metrics", "mse", "test")
    d = d[d["step"].notna()]
    out: dict[int, list[float]] = {}
    for e in sorted(int(x) for x in d["step"].unique()):
        out[e] = _per_seed(d[d["step"] == e], seeds)
    return out


@_extractor("001-gp-informed-init")
def gp_informed_init(df: Any, run_dir: Path, scale: str) -> Extracted:
    """``metrics`` test ``mse`` per epoch of the informed and random cells; the informed model's
    converged share per seed: mean over epochs of ``solver_stats`` ``forward_converged``
    (variants train and test), else the runner's ``forward_unconverged_batches``."""
    seeds = seeds_of(df)
    cells = {_scheme(_first(df, c, "init")): c for c in df["cell_id"].unique()}
    if "informed" not in cells or "random" not in cells:
        return _missing("needs an informed (kglm_informed) and a random (kglm_random) cell")
    inf, rnd = (_mse_by_epoch(df, cells[s], seeds) for s in ("informed", "random"))
    if not inf or not rnd:
        return _missing("no metrics test mse per epoch")
    st = _rows(df[df["cell_id"] == cells["informed"]], "solver_stats", "forward_converged")
    st = st[st["variant"].isin(["train", "test"])]
    if len(st):
        conv = _per_seed(st, seeds, "mean")
    else:
        conv = [_converged_share(df, cells["informed"], s) for s in seeds]
    return Extracted({"informed": inf, "random": rnd, "informed_converged": conv})


@_extractor("001-denoise")
def denoise(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per scheme (``kglm_informed`` -> kglm, ``kglm_random`` -> random) and epoch, per seed the
    best ``metrics`` test ``mse`` over the grid of scales (finite values of tasks that did not
    fail); failed runs per seed = grid points whose task failed or whose last test MSE is not
    finite; converged = the runner's forward convergence share at the best final grid point."""
    seeds = seeds_of(df)
    groups: dict[str, list[str]] = {"kglm": [], "random": []}
    for c in df["cell_id"].unique():
        sch = {"kglm_informed": "kglm", "kglm_random": "random"}.get(_first(df, c, "init"))
        if sch:
            groups[sch].append(c)
    if not groups["kglm"] or not groups["random"]:
        return _missing("needs kglm_informed and kglm_random cells")
    best: dict[str, dict[int, list[float]]] = {}
    failed: dict[str, list[int]] = {}
    converged: dict[str, list[float]] = {}
    for scheme, cells in groups.items():
        per_cell = {c: _mse_by_epoch(df, c, seeds) for c in cells}
        epochs = sorted({e for m in per_cell.values() for e in m})
        fails = []
        conv = []
        for i, s in enumerate(seeds):
            bad = 0
            best_cell, best_v = None, math.inf
            for c, m in per_cell.items():
                last = m[max(m)][i] if m else math.nan
                if _task_status(df, c, s) in FAILED or not math.isfinite(last):
                    bad += 1
                elif last < best_v:
                    best_cell, best_v = c, last
            fails.append(bad)
            conv.append(_converged_share(df, best_cell, s) if best_cell else math.nan)
        failed[scheme] = fails
        converged[scheme] = conv
        best[scheme] = {}
        for e in epochs:
            vals = []
            for i, s in enumerate(seeds):
                ok = [
                    m[e][i]
                    for c, m in per_cell.items()
                    if e in m and math.isfinite(m[e][i]) and _task_status(df, c, s) not in FAILED
                ]
                vals.append(min(ok) if ok else math.nan)
            best[scheme][e] = vals
    kw: dict[str, Any] = {"best_mse": best, "failed": failed}
    if all(math.isfinite(v) for vs in converged.values() for v in vs):
        kw["converged"] = converged
    return Extracted(kw)


@_extractor("001-init-cost")
def init_cost(df: Any, run_dir: Path, scale: str) -> Extracted:
    """``kglm_init_cost`` ``init_time`` rows (one per repeat; step = width or channels) of the
    first seed: variants ``fc/kglm``, ``fc/random``, ``conv/kglm``."""
    d = _rows(df, "kglm_init_cost", "init_time")
    if d.empty:
        return _missing("no kglm_init_cost init_time rows")
    d = d[d["seed"] == min(seeds_of(d))]

    def table(variant: str) -> dict[int, list[float]]:
        g = d[d["variant"] == variant].sort_values("repeat")
        return {int(k): [float(x) for x in v["value"]] for k, v in g.groupby(g["step"].astype(int))}

    return Extracted(
        {
            "fc_kglm": table("fc/kglm"),
            "fc_random": table("fc/random"),
            "conv_kglm": table("conv/kglm"),
        }
    )


# -- 002 -----------------------------------------------------------------------------------------

_ARCH = {"pcdeq_l": "L", "pcdeq_sc": "SC", "pcdeq_mc": "MC"}


def _pcdeq_cells(df: Any) -> list[tuple[str, str, str, bool]]:
    """(cell, architecture L/SC/MC, activation, constrained) of every pcDEQ cell."""
    fs = df[df["analysis"] == "family_stats"]
    out = []
    for c in sorted(fs["cell_id"].unique()):
        model = _first(df, c, "model")
        arch = next((a for m, a in _ARCH.items() if model.startswith(m)), "")
        act = _activation(c)
        if not arch or not act:
            continue
        flag = fs[(fs["cell_id"] == c) & (fs["metric"] == "nonneg_constraint")]["value"]
        nonneg = bool(float(flag.max()) >= 0.5) if len(flag) else "nonneg=false" not in c
        out.append((c, arch, act, nonneg))
    return out


def _primary(archs: set[str]) -> str:
    """The architecture whose curves are keyed by activation alone (SC: paper 002 Section 5.3's
    statements are about SC; else L)."""
    return next((a for a in ("SC", "L", "MC") if a in archs), "")


@_extractor("002-mnist-accuracy")
def mnist_accuracy(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Final ``family_stats`` ``test_accuracy`` (else ``metrics`` test accuracy) per seed of each
    constrained pcDEQ cell, keyed by its Table 1 name (``pcDEQ-1-L-Tanh``, sigmoid: pcDEQ-2);
    ``paper_data`` when the run's dataset is ``mnist``."""
    seeds = seeds_of(df)
    acc: dict[str, list[float]] = {}
    for c, arch, act, nonneg in _pcdeq_cells(df):
        if not nonneg:
            continue
        d = _rows(df[df["cell_id"] == c], "family_stats", "test_accuracy")
        if d.empty:
            d = _rows(df[df["cell_id"] == c], "metrics", "accuracy", "test")
        d = d[d["step"].notna()]
        last = [_curve_last(d, s) for s in seeds]
        n = 2 if act == "sigmoid" else 1
        pretty = "ReLU6" if act == "relu6" else act.capitalize()
        acc[f"pcDEQ-{n}-{arch}-{pretty}"] = last
    return Extracted({"accuracy": acc, "scale": scale, "paper_data": data_name(run_dir) == "mnist"})


def _curve_last(d: Any, seed: int) -> float:
    g = d[d["seed"] == seed]
    if g.empty:
        return math.nan
    return float(g.loc[g["step"].astype(int).idxmax(), "value"])


def _pcdeq_iterations(df: Any, nonneg: bool) -> dict[str, list[list[float]]]:
    seeds = seeds_of(df)
    cells = [x for x in _pcdeq_cells(df) if x[3] == nonneg]
    prim = _primary({a for _, a, _, _ in cells})
    out = {}
    for c, arch, act, _ in cells:
        d = _rows(df[df["cell_id"] == c], "family_stats", "forward_nstep", "")
        out[act if arch == prim else f"{arch}:{act}"] = _curves(d, seeds, min_step=1)
    return out


@_extractor("002-iterations")
def iterations(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per activation, per seed, the per-epoch mean forward iterations (``family_stats``
    ``forward_nstep``, variant "" = mean over layers, epochs >= 1) of the constrained pcDEQ
    cells; activations of the primary architecture (SC, else L) by name, others as
    ``ARCH:activation``."""
    it = _pcdeq_iterations(df, nonneg=True)
    if not it:
        return _missing("no family_stats forward_nstep of a constrained pcDEQ cell")
    return Extracted(
        {"forward_iterations": it, "scale": scale, "paper_data": data_name(run_dir) == "mnist"}
    )


@_extractor("002-lipschitz")
def lipschitz(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per activation, per seed, the per-epoch sigma_max(W) (epochs >= 1) of the constrained
    linear (L) pcDEQ cells: ``family_stats`` ``sigma_max`` (layer0), else the ``spectral``
    analysis's family quantity ``sigma_max/layer0``."""
    seeds = seeds_of(df)
    out: dict[str, list[list[float]]] = {}
    for c, arch, act, nonneg in _pcdeq_cells(df):
        if arch != "L" or not nonneg:
            continue
        d = _rows(df[df["cell_id"] == c], "family_stats", "sigma_max")
        d = d[d["variant"].isin(["layer0", ""])]
        out[act] = _curves(d, seeds, min_step=1)
    if not out:  # kglm_pcdeq_sigma: spectral analysis, no family_stats
        sp = df[(df["analysis"] == "spectral") & df["status"].isin(MEASURED)]
        for c in sorted(sp["cell_id"].unique()):
            a = _activation(c)
            if not a or not _first(df, c, "model").startswith("pcdeq_l"):
                continue
            d = sp[(sp["cell_id"] == c) & sp["metric"].isin(["sigma_max/layer0"])]
            if d.empty:
                d = sp[(sp["cell_id"] == c) & (sp["metric"] == "sigma_max")]
                d = d[d["variant"].isin(["sigma_max/layer0", "layer0"])]
            out[a] = _curves(d, seeds, min_step=1)
    if not out or not any(any(c) for cs in out.values() for c in cs):
        return _missing("no sigma_max per epoch of a constrained linear pcDEQ layer")
    return Extracted({"sigma_max": out})


@_extractor("002-unconstrained")
def unconstrained(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per seed per-epoch forward iterations of the tanh pcDEQ and of the unconstrained tanh
    control of the same architecture (the primary one: SC, else L)."""
    pc, ctl = _pcdeq_iterations(df, nonneg=True), _pcdeq_iterations(df, nonneg=False)
    if "tanh" not in pc or "tanh" not in ctl:
        return _missing(
            "needs a constrained tanh pcDEQ and its unconstrained control (nonneg false)"
        )
    return Extracted({"pcdeq_iterations": pc["tanh"], "control_iterations": ctl["tanh"]})


# -- 003 -----------------------------------------------------------------------------------------


def _opteq(df: Any) -> tuple[Any, dict[str, tuple[str, float]]]:
    """``unroll_compare`` rows of one gamma (0.9 if several, else the largest below 1) and
    cell -> ("unrolled", K) or ("ift", thd)."""
    u = _rows(df, "unroll_compare")
    gam = u[u["metric"] == "gamma"].groupby("cell_id")["value"].median()
    if gam.nunique() > 1:
        vals = sorted(set(gam))
        pick = (
            0.9
            if any(math.isclose(v, 0.9) for v in vals)
            else max([v for v in vals if v < 1] or vals)
        )
        keep = set(gam[[math.isclose(v, pick) for v in gam]].index)
        u = u[u["cell_id"].isin(keep)]
    kinds: dict[str, tuple[str, float]] = {}
    for c in u["cell_id"].unique():
        bw = _first(df, c, "backward")
        k = u[(u["cell_id"] == c) & (u["metric"] == "unroll_k")]["value"]
        t = u[(u["cell_id"] == c) & (u["metric"] == "threshold")]["value"]
        if bw.startswith("unrolled") and len(k) and math.isfinite(float(k.iloc[0])):
            kinds[c] = ("unrolled", float(k.iloc[0]))
        elif bw.startswith("ift") and len(t) and math.isfinite(float(t.iloc[0])):
            kinds[c] = ("ift", float(t.iloc[0]))
    return u, kinds


def _opteq_table(df: Any, metric: str, kind: str, scale_by: float = 1.0) -> dict[Any, list[float]]:
    u, kinds = _opteq(df)
    seeds = seeds_of(df)
    out: dict[Any, list[float]] = {}
    for c, (k, x) in sorted(kinds.items(), key=lambda kv: kv[1][1]):
        if k != kind:
            continue
        d = u[(u["cell_id"] == c) & (u["metric"] == metric)]
        key = int(x) if kind == "unrolled" else x
        out[key] = [v * scale_by for v in _per_seed(d, seeds)]
    return out


@_extractor("003-residual-vs-k")
def residual_vs_k(df: Any, run_dir: Path, scale: str) -> Extracted:
    """K -> per seed ``unroll_compare`` ``rel_residual_opteq`` of the unrolled cells."""
    r = _opteq_table(df, "rel_residual_opteq", "unrolled")
    return Extracted({"residual": r}) if r else _missing("no unroll_compare rel_residual_opteq")


@_extractor("003-accuracy-vs-k")
def accuracy_vs_k(df: Any, run_dir: Path, scale: str) -> Extracted:
    """K -> per seed ``unroll_compare`` ``test_accuracy`` of the unrolled cells."""
    a = _opteq_table(df, "test_accuracy", "unrolled")
    return Extracted({"accuracy": a}) if a else _missing("no unroll_compare test_accuracy")


@_extractor("003-unrolled-speed")
def unrolled_speed(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per seed inference seconds per batch (``unroll_compare`` ``inference_ms_median`` / 1000)
    of the unrolled cells (by K) and the IFT cells (by threshold)."""
    un = _opteq_table(df, "inference_ms_median", "unrolled", 1e-3)
    ift = _opteq_table(df, "inference_ms_median", "ift", 1e-3)
    if not un or not ift:
        return _missing("no unroll_compare inference_ms_median of unrolled and IFT cells")
    return Extracted({"unrolled": un, "ift": ift})


def _positive(table: Mapping[Any, Sequence[float]]) -> bool:
    return bool(table) and all(math.isfinite(v) and v > 0 for vs in table.values() for v in vs)


@_extractor("003-ift-memory")
def ift_memory(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per seed memory of one training step (bytes) of the unrolled cells (by K) and the IFT
    cells (by threshold): ``unroll_compare`` ``peak_memory`` (the CUDA allocator's peak) where
    it is positive in every cell and seed, else ``activation_memory`` (the bytes autograd saves
    in one training forward; on CPU ``peak_memory`` is a fresh process's peak RSS, too coarse
    for small models, or not measured with ``memory_cpu: false``)."""
    for metric in ("peak_memory", "activation_memory"):
        un = _opteq_table(df, metric, "unrolled")
        ift = _opteq_table(df, metric, "ift")
        if _positive(un) and _positive(ift):
            return Extracted({"unrolled": un, "ift": ift}, notes=(f"memory: {metric}",))
    return _missing("no positive unroll_compare peak_memory or activation_memory in every cell")


# -- 004 -----------------------------------------------------------------------------------------


@_extractor("004-pr-fb")
def pr_fb(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per seed a :class:`~deqbench.reproduce.checks.Sweep`: ``splitting_sweep``
    ``fb_alpha_bound`` and ``converged`` per ``forward_backward/alpha=a`` and
    ``peaceman_rachford/alpha=a`` (first cell)."""
    from .checks import Sweep

    sw = _rows(df, "splitting_sweep")
    if sw.empty:
        return _missing("no splitting_sweep rows")
    sw = sw[sw["cell_id"] == sorted(sw["cell_id"].unique())[0]]
    sweeps = []
    for s in seeds_of(sw):
        d = sw[sw["seed"] == s]
        bound = d[d["metric"] == "fb_alpha_bound"]["value"]
        tab: dict[str, dict[float, bool]] = {"forward_backward": {}, "peaceman_rachford": {}}
        for _, r in d[d["metric"] == "converged"].iterrows():
            method, _, a = str(r["variant"]).partition("/alpha=")
            if method in tab and a:
                tab[method][float(a)] = bool(float(r["value"]) >= 0.5)
        sweeps.append(
            Sweep(
                float(bound.iloc[0]) if len(bound) else math.nan,
                tab["forward_backward"],
                tab["peaceman_rachford"],
            )
        )
    return Extracted({"sweeps": sweeps})


def _slope(steps: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of log(values) against steps (positive finite values only)."""
    pts = [(float(x), math.log(float(y))) for x, y in zip(steps, values) if float(y) > 0]
    if len(pts) < 2:
        return math.nan
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den > 0 else math.nan


@_extractor("004-ntk-lambda-min")
def ntk_lambda_min(df: Any, run_dir: Path, scale: str) -> Extracted:
    """The monDEQ cell's ``ntk`` rows per seed: ``lambda_min`` at each evaluation (first at
    init); the slope of log(``loss_at_eval``) per step fitted over the evaluations (full-batch
    GD: one step per epoch); converged = no flagged ``ntk`` row; the predicted slope: the mean of
    the series' ``pred_log_loss_slope`` (``series/ntk__<cell>__seed<s>.csv``). ``ntk`` emits no
    fitted slope of its own as a row."""
    nt = df[df["analysis"] == "ntk"]
    cells = [
        c for c in sorted(nt["cell_id"].unique()) if _first(df, c, "model").startswith("mondeq")
    ]
    if not cells:
        return _missing("no ntk rows of a monDEQ cell (the theorem is for monDEQs)")
    d = nt[nt["cell_id"] == cells[0]]
    lam, slope, conv = [], [], []
    for s in seeds_of(df):
        g = d[d["seed"] == s]
        lm = g[(g["metric"] == "lambda_min") & g["status"].isin(MEASURED)].sort_values("step")
        ls = g[(g["metric"] == "loss_at_eval") & g["status"].isin(MEASURED)].sort_values("step")
        lam.append([float(v) for v in lm["value"]])
        slope.append(_slope(list(ls["step"].astype(float)), list(ls["value"])))
        conv.append(bool(len(g)) and not (g["status"] == "flagged").any())
    if not any(lam):
        return _missing("no ntk lambda_min rows")
    kw: dict[str, Any] = {"lambda_min": lam, "log_loss_slope": slope, "converged": conv}
    pred = [_series_mean(run_dir / "series" / f"ntk__{cells[0]}__seed{s}.csv",
                         "pred_log_loss_slope") for s in seeds_of(df)]  # fmt: skip
    if all(math.isfinite(p) for p in pred):
        kw["predicted_slope"] = pred
    return Extracted(kw)


def _series_mean(path: Path, column: str) -> float:
    """Mean of the finite values of ``column`` in a series CSV (NaN when absent)."""
    import pandas as pd

    try:
        v = pd.to_numeric(pd.read_csv(path)[column], errors="coerce").dropna()
    except (OSError, KeyError, ValueError):
        return math.nan
    return float(v.mean()) if len(v) else math.nan


def _trajectory_cells(df: Any) -> tuple[str | None, str | None]:
    """(standard, small): the largest measured ``cell_weight_std`` is N(0, 1); small is the
    ``init=var0.01`` cell (the thesis's N(0, 0.01) read as a variance), else the smallest."""
    t = df[(df["analysis"] == "trajectory") & (df["metric"] == "cell_weight_std")]
    std = t.groupby("cell_id")["value"].median().dropna()
    if len(std) < 2:
        return None, None
    standard = str(std.idxmax())
    small = next((c for c in std.index if "init=var0.01" in c), str(std.idxmin()))
    return standard, small


@_extractor("004-trajectory-init")
def trajectory_init(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per seed ``trajectory`` ``iterations_median`` at the first recording (init) of the
    standard (largest init std) and small (``init=var0.01``) cells."""
    standard, small = _trajectory_cells(df)
    if standard is None or small is None:
        return _missing("needs two trajectory cells with cell_weight_std")
    seeds = seeds_of(df)
    out = {}
    for key, c in (("standard", standard), ("small", small)):
        d = _rows(df[df["cell_id"] == c], "trajectory", "iterations_median")
        d = d[d["step"].notna()]
        out[key] = [_curve_first(d, s) for s in seeds]
    return Extracted({"iterations": out})


def _curve_first(d: Any, seed: int) -> float:
    g = d[d["seed"] == seed]
    if g.empty:
        return math.nan
    return float(g.loc[g["step"].astype(int).idxmin(), "value"])


def _at_step(d: Any, seed: int, step: int) -> float:
    g = d[(d["seed"] == seed) & (d["step"] == step)]
    return float(g["value"].median()) if len(g) else math.nan


@_extractor("004-trajectory-separation")
def trajectory_separation(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per seed ``trajectory`` ``silhouette`` (variant ``pca2``) of the small-init cell at epoch 0
    and epoch 1, and its ``converged_frac`` at epoch 1."""
    _, small = _trajectory_cells(df)
    if small is None:
        cells = sorted(df[df["analysis"] == "trajectory"]["cell_id"].unique())
        small = cells[0] if cells else None
    if small is None:
        return _missing("no trajectory rows")
    t = df[(df["analysis"] == "trajectory") & (df["cell_id"] == small)]
    t = t[t["status"].isin(MEASURED)]
    sil = t[(t["metric"] == "silhouette") & (t["variant"] == "pca2")]
    if not (sil["step"] == 1).any():
        return _missing("no trajectory silhouette (pca2) after epoch 1 (epochs must include 1)")
    seeds = seeds_of(df)
    cf = t[t["metric"] == "converged_frac"]
    return Extracted(
        {
            "silhouette_init": [_at_step(sil, s, 0) for s in seeds],
            "silhouette_trained": [_at_step(sil, s, 1) for s in seeds],
            "converged": [_at_step(cf, s, 1) for s in seeds],
        }
    )


@_extractor("004-landscape-repeats")
def landscape_repeats(df: Any, run_dir: Path, scale: str) -> Extracted:
    """Per seed ``landscape`` ``low_loss_area_frac`` of the DEQ (``deq``) and of ``tied_repeat``
    cells (``repeat-N`` from ``repeats=N`` in the cell id); the DEQ's ``converged_frac``."""
    la = df[(df["analysis"] == "landscape") & df["status"].isin(MEASURED)]
    seeds = seeds_of(df)
    area: dict[str, list[float]] = {}
    deq_conv: list[float] = []
    for c in sorted(la["cell_id"].unique()):
        model = _first(df, c, "model")
        if model.startswith("tied_repeat"):
            n = re.search(r"repeats=(\d+)", c)
            if not n:
                continue
            key = f"repeat-{n.group(1)}"
        else:
            key = "deq"
            deq_conv = _per_seed(la[(la["cell_id"] == c) & (la["metric"] == "converged_frac")],
                                 seeds)  # fmt: skip
        d = la[(la["cell_id"] == c) & la["metric"].str.startswith("low_loss_area_frac")]
        area[key] = _per_seed(d, seeds)
    if not area:
        return _missing("no landscape low_loss_area_frac rows")
    return Extracted({"low_loss_area": area, "deq_converged": deq_conv})


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
