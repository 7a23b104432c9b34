"""Analysis ``hessian``: spectrum of the training-loss Hessian after training.

On a fixed, seeded subset of the chosen split (``samples``, in batches of ``batch_size``), at the
trained parameters and in ``eval()``: the top-``k`` eigenvalues and lambda_min (Lanczos, Ritz
residual stop; or power iteration), the trace (Hutchinson, stopped on a standard-error target)
and the eigenvalue density (SLQ), through :class:`deqbench.hessian.HVPOperator`.

DEQ solves are tightened for the analysis to ``tol`` (default 1e-6 in float32, 1e-12 in
float64) with a budget of at least ``max_iter`` (200) iterations, and restored afterwards; with
``direct: auto`` the IFT adjoint and tangent solves are per-sample LU solves of I - J factored
once per point where the state is small (exact, and ~10x faster per HVP; checked against the
batched map, see :func:`deqbench.deq.direct_solves`).

Before any number, these gates run: gradient vs a central difference of the
loss, the backend's HVP vs the finite-difference HVP (the FD reference is taken on a float64
copy at the same weights for a float32 model, ``fd_reference``; a vector whose FD step crosses a
kink of the loss is retaken with smaller steps), symmetry. If the ``autograd`` or ``pyhessian``
backend fails them (a hook-based IFT, ``once_differentiable``), the estimates come from the
``fd`` backend instead (``on_gate_fail: fd``), named in the rows (variant ``fd``,
``fd_fallback`` 1, the notes), the plot and the cell's flag. The backends in ``compare`` are run
on the same probes and their agreement is reported.

Status: a failed gate, a DEQ solve of the analysis (forward, IFT adjoint, or the tangent solve
of the double backward) that missed its tolerance, a Lanczos pair that missed its Ritz
tolerance, or non-finite estimates make the rows concerned ``flagged`` (the failed gate or
residual rows, and the estimates where they are unreliable), all with one note: the causes, each
with its fix. The task then flags the cell and the command exits 1.

Rows: ``top_eigenvalue`` (repeat = rank), ``top_eigenvalue_residual``, ``lambda_min``,
``trace``, ``trace_se``, ``trace_samples``, ``slq_trace``, ``hvp_seconds``, ``gate_*`` (with
``gate_{forward,backward,tangent}_{rel_residual_max,all_converged}``), ``fd_fallback``,
``direct_solves``, ``agreement_hvp`` / ``agreement_top_eigenvalue`` / ``agreement_trace``
(variant ``backend:other``), ``hessian_dim``. Series: ``hessian_density`` (lambda, density,
sigma, backend, fd_fallback) and ``hessian_ritz`` (probe, node, weight). Plot:
``plots/hessian_density.png``.

Example (suite YAML)::

    analyses:
      - hessian: {samples: 512, top_k: 3, trace_rel_se: 0.02, compare: [pyhessian]}
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..analyses.base import Analysis, CellContext, Row
from ..core.registry import analyses
from ..run import plots
from .measure import (  # noqa: F401  (re-exported: the analysis's names in one place)
    GATES,
    REF_TOL,
    RITZ,
    SERIES,
    SOLVE_KINDS,
    SOLVE_NAMES,
    Measurement,
    _rel,
)


@contextlib.contextmanager
def tightened(
    model: Any, tol: float | None, max_iter: int | None, refine: int | None = None
) -> Iterator[None]:
    """Temporarily set the forward and adjoint tolerance / budget of every DEQ layer, and at
    least ``refine`` differentiable adjoint steps for double backward (the IFT Hessian's error
    decays as rho(J)**refine, so a trained DEQ with rho(J) near 1 needs hundreds)."""
    from ..core.deq import deq_layers

    layers = list(deq_layers(model))
    saved = [(layer.solver_cfg, layer.backward_cfg) for layer in layers]
    try:
        for layer in layers:
            s, b = layer.solver_cfg, layer.backward_cfg
            kw: dict[str, Any] = {}
            if tol is not None:
                kw["tol"] = tol
            if max_iter is not None:
                kw["max_iter"] = max(max_iter, s.max_iter)
            layer.solver_cfg = replace(s, **kw)
            if max_iter is not None:
                kw["max_iter"] = max(max_iter, b.max_iter)
            if refine is not None:
                kw["refine"] = max(refine, b.refine)
            layer.backward_cfg = replace(b, **kw)
        yield
    finally:
        for layer, (s, b) in zip(layers, saved):
            layer.solver_cfg, layer.backward_cfg = s, b


def select(X: Any, y: Any, n: int, seed: int) -> tuple[Any, Any]:
    """A seeded random subset of ``n`` examples (all of them when fewer)."""
    import torch

    g = torch.Generator().manual_seed(int(seed))
    idx = torch.randperm(X.shape[0], generator=g)[: min(n, X.shape[0])].to(X.device)
    return X[idx], y[idx]


@analyses.register("hessian")
class Hessian(Analysis):
    """Top eigenvalues, trace and density of the loss Hessian at the trained parameters."""

    judges_own_solves = True  # see Analysis.judges_own_solves
    name = "hessian"
    #: the cell deqbench.testing.check_analysis runs it on (over testing.DEFAULT_EXAMPLE)
    example: ClassVar[dict[str, Any]] = {
        "params": {"samples": 32, "top_k": 1, "trace_max_samples": 20, "slq_steps": 16}
    }
    version = "1"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        backend: Literal["autograd", "fd", "pyhessian"] = "autograd"
        compare: list[Literal["autograd", "fd", "pyhessian"]] = Field(default=["pyhessian"])
        split: Literal["train", "test"] = "train"
        samples: int = Field(512, ge=1)
        batch_size: int | None = Field(
            None, ge=1, description="HVP batch (default: all samples at once)"
        )
        params: Literal["all", "cell"] = "all"
        method: Literal["lanczos", "power"] = "lanczos"
        top_k: int = Field(3, ge=1)
        eig_tol: float = Field(1e-4, gt=0, description="relative Ritz-residual tolerance")
        eig_max_iter: int = Field(100, ge=1)
        trace: bool = True
        trace_rel_se: float = Field(0.02, gt=0)
        trace_min_samples: int = Field(10, ge=2)
        trace_max_samples: int = Field(300, ge=2)
        density: bool = True
        slq_probes: int = Field(3, ge=1)
        slq_steps: int = Field(64, ge=2)
        sigma_rel: float = Field(0.01, gt=0)
        compare_probes: int = Field(
            20, ge=2, description="Hutchinson probes for the compare backends"
        )
        gates: bool = True
        gate_vectors: int = Field(3, ge=1)
        on_gate_fail: Literal["fd", "report"] = "fd"
        tol: float | None = Field(
            None, gt=0, description="DEQ solver tolerance during the analysis"
        )
        max_iter: int | None = Field(200, ge=1)
        refine: int | None = Field(
            300,
            ge=0,
            description="least differentiable adjoint steps of an IFT double backward with "
            "second_order refine (the default, implicit, needs none)",
        )
        fd_reference: Literal["float64", "same"] = Field(
            "float64",
            description="dtype of the gates' finite-difference reference (and of the fd "
            "fallback) for a model in lower precision: a float64 copy at the same weights, or "
            "the model's own dtype",
        )
        direct: Literal["auto", "off"] = Field(
            "auto",
            description="IFT adjoint and tangent solves by a per-sample LU of I - J, factored "
            "once per point, where the state is small and samples do not interact (exact; "
            "checked against the batched map); off: the layers' own solvers",
        )
        seed: int = 0
        checkpoint: str | None = None

        @model_validator(mode="after")
        def _power_is_top_1(self) -> Hessian.Params:
            """Power iteration gives the top eigenvalue only: an explicit top_k > 1 with it is
            an error (Lanczos gives the top k), not silently one value."""
            if self.method == "power":
                if "top_k" in self.model_fields_set and self.top_k > 1:
                    raise ValueError(
                        f"method power gives the top eigenvalue only (top_k 1, got {self.top_k});"
                        " use method lanczos for the top k"
                    )
                self.top_k = 1
            return self

    params: Params  # narrowed for type checkers

    @classmethod
    def headline(cls, rows: Any) -> list[str]:
        """Top eigenvalue, trace, the backend that produced them, and the gates."""

        def first(metric: str, variant: str | None = None, repeat: int = 0) -> Any:
            d = rows[(rows["metric"] == metric) & (rows["repeat"].fillna(0) == repeat)]
            if variant is not None:
                d = d[d["variant"] == variant]
            return d.iloc[0] if len(d) else None

        top, tr = first("top_eigenvalue"), first("trace")
        if top is None and tr is None:
            return []
        backend = str((top if top is not None else tr)["variant"])
        parts = []
        if top is not None:
            res = first("top_eigenvalue_residual", backend)
            parts.append(f"top eigenvalue {top['value']:.4g}"
                         + (f" (Ritz residual {res['value']:.1e})" if res is not None else ""))  # fmt: skip
        if tr is not None:
            se = first("trace_se", backend)
            parts.append(f"trace {tr['value']:.4g}"
                         + (f" +- {se['value']:.2g} (Hutchinson)" if se is not None else ""))  # fmt: skip
        fb = first("fd_fallback")
        how = "finite differences (fallback)" if fb is not None and fb["value"] == 1 else backend
        gate = first("gate_ok")
        gates = "" if gate is None else ("gates passed" if gate["value"] == 1 else "GATES FAILED")
        flagged = (rows["status"] == "flagged").any()
        tail = f"; HVPs by {how}" + (f", {gates}" if gates else "")
        return ["; ".join(parts) + tail + ("; flagged (see note)" if flagged else "")]

    def before_training(self, ctx: CellContext) -> Iterable[Row]:
        if self.params.checkpoint:
            from ..landscape.analysis import load_checkpoint

            load_checkpoint(ctx.model, self.params.checkpoint, ctx.device)
        return ()

    def after_training(self, ctx: CellContext) -> Iterable[Row]:
        import torch

        from ..core.deq import direct_solves, is_deq
        from ..core.evaluation import loss_function
        from . import spectrum as hs

        p = self.params
        model = ctx.model
        X, y = ctx.data.train if p.split == "train" else ctx.data.test
        X, y = select(X, y, p.samples, p.seed)
        bs = p.batch_size or X.shape[0]
        batches = [(X[i : i + bs], y[i : i + bs]) for i in range(0, X.shape[0], bs)]
        loss_fn = loss_function(ctx.task)
        names = None
        if p.params == "cell":
            cell_ids = {
                id(q)
                for q in (model.cell_parameters() if hasattr(model, "cell_parameters") else [])
            }
            names = [
                n for n, q in model.named_parameters() if id(q) in cell_ids and q.requires_grad
            ]
            if not names:
                from ..core.errors import ConfigError

                raise ConfigError("hessian.params: cell — the model exposes no cell parameters")
        tol = p.tol if p.tol is not None else (REF_TOL if ctx.dtype == torch.float64 else 1e-6)
        rows: list[Row] = []
        deq = is_deq(model)
        with contextlib.ExitStack() as stack:
            if deq:
                stack.enter_context(tightened(model, tol, p.max_iter, p.refine))
            ds = stack.enter_context(direct_solves(model)) if deq and p.direct == "auto" else []
            ref = None
            if p.gates and p.fd_reference == "float64" and ctx.dtype != torch.float64:
                ref = self._float64_copy(model, batches, deq, stack)
            rows.extend(self._measure(ctx, hs, model, loss_fn, batches, names, tol, ref))
            if ds:
                off = [d.off for d in ds if d.off]
                rows.append(
                    Row(
                        "direct_solves",
                        float(sum(d.solves for d in ds)),
                        note=(
                            f"IFT linear solves by per-sample LU ({sum(d.factorisations for d in ds)}"
                            " factorisations)"
                            + (f"; iterative where {'; '.join(sorted(set(off)))}" if off else "")
                        ),
                    )
                )
        return rows

    def _float64_copy(
        self, model: Any, batches: Any, deq: bool, stack: contextlib.ExitStack
    ) -> tuple[Any, Any] | None:
        """A float64 copy of the model and batches at the same weights, with float64 solves,
        for the finite-difference reference of the gates: in float32 an FD-HVP is good to
        about 1e-4..1e-3 only (rounding over the step, solver tolerance over the step), the
        size of the gate's threshold; the copy's is good to about 1e-9."""
        import copy

        import torch

        from ..core.deq import direct_solves

        p = self.params
        try:
            m64 = copy.deepcopy(model).to(torch.float64)
        except Exception:  # noqa: BLE001 - no float64 copy (device, exotic module): same dtype
            return None
        b64 = [
            tuple(t.to(torch.float64) if t.is_floating_point() else t for t in b) for b in batches
        ]
        if deq:
            stack.enter_context(tightened(m64, REF_TOL, p.max_iter, p.refine))
            if p.direct == "auto":
                stack.enter_context(direct_solves(m64))
        return m64, b64

    def _measure(
        self,
        ctx: CellContext,
        hs: Any,
        model: Any,
        loss_fn: Any,
        batches: Any,
        names: Any,
        tol: float,
        ref: tuple[Any, Any] | None = None,
    ) -> list[Row]:
        return Measurement(self.params, ctx, hs, model, loss_fn, batches, names, tol, ref).run()

    @classmethod
    def plot(cls, df: Any, run_dir: Any) -> dict[str, Any]:
        """The figures (``deqbench.plots``): :func:`hessian_plots`."""
        return hessian_plots(df, run_dir)


def hessian_plots(df: Any, run_dir: Path) -> dict[str, Any]:
    """``plots/hessian_density.png``: every cell's SLQ density with its top eigenvalue."""
    from . import plots as pa

    series = plots.read_series(run_dir, SERIES)
    if series.empty:
        return {}
    eigs = df[
        (df["analysis"] == "hessian") & (df["metric"] == "top_eigenvalue") & (df["repeat"] == 0)
    ]
    bad = {(c, int(sd)) for c, sd in eigs[eigs["status"] != "ok"][["cell_id", "seed"]].to_numpy()}
    eigs = eigs.rename(columns={"value": "eigenvalue"})[["cell_id", "seed", "eigenvalue"]]
    return {"hessian_density": pa.hessian_density(series, eigs, unreliable=bad)}
