"""Analysis ``hessian``: spectrum of the training-loss Hessian after training.

On a fixed, seeded subset of the chosen split (``samples``, in batches of ``batch_size``), at the
trained parameters and in ``eval()``: the top-``k`` eigenvalues and lambda_min (Lanczos, Ritz
residual stop; or power iteration), the trace (Hutchinson, stopped on a standard-error target)
and the eigenvalue density (SLQ), through :class:`deqbench.hessian.HVPOperator`.

Before any number, the gates of REFERENCE.md 3.4 run: gradient vs a central difference of the
loss, the backend's HVP vs the finite-difference HVP, symmetry. If the ``autograd`` or
``pyhessian`` backend fails them (a hook-based IFT, ``once_differentiable``), the estimates come
from the ``fd`` backend instead (``on_gate_fail: fd``) and the note says so. The backends in
``compare`` are run on the same probes and their agreement is reported. DEQ solves are tightened
to ``tol`` (default 1e-6 in float32, 1e-12 in float64) for the analysis and restored afterwards.

Rows: ``top_eigenvalue`` (repeat = rank), ``top_eigenvalue_residual``, ``lambda_min``,
``trace``, ``trace_se``, ``trace_samples``, ``slq_trace``, ``hvp_seconds``, ``gate_*``,
``agreement_hvp`` / ``agreement_top_eigenvalue`` / ``agreement_trace`` (variant
``backend:other``), ``hessian_dim``. Series: ``hessian_density`` (lambda, density, sigma) and
``hessian_ritz`` (probe, node, weight). Plot: ``plots/hessian_density.png``.

Example (suite YAML)::

    analyses:
      - hessian: {samples: 512, top_k: 3, trace_rel_se: 0.02, compare: [pyhessian]}
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .. import plots
from ..registry import analyses
from .base import Analysis, CellContext, Row

SERIES = "hessian_density"
RITZ = "hessian_ritz"


@contextlib.contextmanager
def tightened(
    model: Any, tol: float | None, max_iter: int | None, refine: int | None = None
) -> Iterator[None]:
    """Temporarily set the forward and adjoint tolerance / budget of every DEQ layer, and at
    least ``refine`` differentiable adjoint steps for double backward (the IFT Hessian's error
    decays as rho(J)**refine, so a trained DEQ with rho(J) near 1 needs hundreds)."""
    from ..deq import deq_layers

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


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


@analyses.register("hessian")
class Hessian(Analysis):
    """Top eigenvalues, trace and density of the loss Hessian at the trained parameters."""

    name = "hessian"
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
            300, ge=0, description="least differentiable adjoint steps (IFT double backward)"
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

    def before_training(self, ctx: CellContext) -> Iterable[Row]:
        if self.params.checkpoint:
            from .landscape import load_checkpoint

            load_checkpoint(ctx.model, self.params.checkpoint, ctx.device)
        return ()

    def after_training(self, ctx: CellContext) -> Iterable[Row]:
        import torch

        from .. import hessian as hs
        from ..deq import is_deq
        from ..train import loss_function

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
                from ..errors import ConfigError

                raise ConfigError("hessian.params: cell — the model exposes no cell parameters")
        tol = p.tol if p.tol is not None else (1e-12 if ctx.dtype == torch.float64 else 1e-6)
        rows: list[Row] = []
        deq = is_deq(model)
        with tightened(
            model, tol if deq else None, p.max_iter if deq else None, p.refine if deq else None
        ):
            rows.extend(self._measure(ctx, hs, model, loss_fn, batches, names))
        return rows

    def _measure(
        self, ctx: CellContext, hs: Any, model: Any, loss_fn: Any, batches: Any, names: Any
    ) -> list[Row]:
        import pandas as pd

        p = self.params
        rows: list[Row] = []
        backend = p.backend
        label = hs.loss_label(model)
        note = ""
        ops: dict[str, Any] = {}

        def op_for(b: str) -> Any:
            if b not in ops:
                ops[b] = hs.HVPOperator(model, loss_fn, batches, params=names, backend=b)
            return ops[b]

        t0 = time.perf_counter()

        def lap(phase: str) -> None:
            nonlocal t0
            t1 = time.perf_counter()
            rows.append(Row("seconds", t1 - t0, variant=phase, unit="s"))
            t0 = t1

        try:
            main = op_for(backend)
            rows.append(Row("hessian_dim", main.dim, note=label))
            if p.gates:
                fd = op_for("fd")
                rep = hs.run_gates(main, fd, n=p.gate_vectors, seed=p.seed)
                for k in ("grad_check", "hvp_vs_fd", "symmetry"):
                    ok = rep.passed[k]
                    rows.append(
                        Row(
                            f"gate_{k}",
                            getattr(rep, k),
                            variant=backend,
                            status="ok" if ok else "error",
                            note=f"threshold {rep.thresholds[k]:g}" + ("" if ok else " (failed)"),
                        )
                    )
                for k, v in rep.residuals.items():
                    rows.append(Row(f"gate_{k}", v, variant=backend))
                rows.append(Row("gate_ok", float(rep.ok), variant=backend, note=label))
                fwd_ok = rep.residuals.get("forward_all_converged", 1.0) >= 1.0
                if not fwd_ok:
                    res = rep.residuals.get("forward_rel_residual_max", math.nan)
                    note = (
                        f"forward solver did not converge (rel residual {res:.2e} > tol): the "
                        "implicit loss is not defined to this tolerance; estimates unreliable"
                    )
                elif not rep.passed["grad_check"]:
                    note = f"gradient check failed: '{label}' is not the loss's gradient; estimates are of a surrogate"
                elif not rep.ok and backend != "fd" and p.on_gate_fail == "fd":
                    note = f"{backend} failed the gates (hvp_vs_fd {rep.hvp_vs_fd:.2e}, symmetry {rep.symmetry:.2e}); estimates from fd"
                    backend = "fd"
                    main = fd
                elif not rep.ok:
                    note = f"{backend} failed the gates; estimates reported anyway"
                lap("gates")
            est = self._estimate(main, hs)
            lap("estimates")
            status = "ok" if not note or note.endswith("from fd") else "error"
            rows.extend(self._rows(est, backend, note or label, status))
            if p.density:
                dens = hs.slq(main, n_probes=p.slq_probes, steps=p.slq_steps, seed=p.seed)
                grid, d, sigma = dens.curve(sigma_rel=p.sigma_rel)
                ctx.write_series(
                    SERIES,
                    pd.DataFrame(
                        {
                            "lambda": grid.numpy(),
                            "density": d.numpy(),
                            "sigma": sigma,
                            "backend": backend,
                        }
                    ),
                )
                ctx.write_series(RITZ, dens.as_frame())
                rows.append(
                    Row(
                        "slq_trace", dens.trace_estimate, variant=backend, note=f"sigma={sigma:.3g}"
                    )
                )
                lap("density")
            for other in p.compare:
                if other == backend:
                    continue
                try:
                    rows.extend(self._compare(hs, main, op_for(other), est, backend, other))
                except Exception as exc:  # noqa: BLE001 - a comparison backend failing is a row
                    rows.append(
                        Row(
                            "agreement_hvp",
                            math.nan,
                            variant=f"{backend}:{other}",
                            status="error",
                            note=f"{type(exc).__name__}: {exc}"[:300],
                        )
                    )
            if p.compare:
                lap("compare")
            rows.append(
                Row(
                    "hvp_seconds",
                    main.seconds_per_hvp,
                    variant=backend,
                    unit="s",
                    note=f"{main.n_hvp} products",
                )
            )
        finally:
            for op in reversed(list(ops.values())):  # LIFO: each restores what it found
                op.close()
        return rows

    def _eig(self, hs: Any, op: Any, k: int) -> Any:
        """Top-``k`` eigenvalues by ``method`` (power iteration gives the top one only)."""
        p = self.params
        if p.method == "power":
            return hs.power_iteration(
                op, max_iter=max(p.eig_max_iter, 10), tol=p.eig_tol, seed=p.seed
            )
        return hs.lanczos(op, k, max_iter=p.eig_max_iter, tol=p.eig_tol, seed=p.seed)

    def _estimate(self, op: Any, hs: Any) -> dict[str, Any]:
        p = self.params
        eig = self._eig(hs, op, p.top_k)
        tr = None
        if p.trace:
            tr = hs.hutchinson_trace(
                op,
                rel_target_se=p.trace_rel_se,
                min_samples=p.trace_min_samples,
                max_samples=p.trace_max_samples,
                seed=p.seed,
            )
        return {"eig": eig, "trace": tr}

    def _rows(self, est: dict[str, Any], backend: str, note: str, status: str) -> list[Row]:
        eig, tr = est["eig"], est["trace"]
        rows = []
        for i, (v, r) in enumerate(zip(eig.eigenvalues, eig.residuals)):
            rows.append(
                Row("top_eigenvalue", v, variant=backend, repeat=i, status=status, note=note)
            )
            rows.append(Row("top_eigenvalue_residual", r, variant=backend, repeat=i))
        rows.append(
            Row(
                "eig_converged",
                float(eig.converged),
                variant=backend,
                note=f"{eig.method}, {eig.n_hvp} products",
            )
        )
        if math.isfinite(eig.lambda_min):
            rows.append(
                Row(
                    "lambda_min",
                    eig.lambda_min,
                    variant=backend,
                    status=status,
                    note="smallest Ritz value (extremal, less converged than the top)",
                )
            )
        if tr is not None:
            rows.append(Row("trace", tr.trace, variant=backend, status=status, note=note))
            rows.append(
                Row(
                    "trace_se",
                    tr.se,
                    variant=backend,
                    note=f"target {tr.target_se:.3g}, {'met' if tr.converged else 'not met'}",
                )
            )
            rows.append(Row("trace_samples", tr.n, variant=backend))
        return rows

    def _compare(
        self, hs: Any, main: Any, other: Any, est: dict[str, Any], b: str, o: str
    ) -> list[Row]:
        p = self.params
        v = f"{b}:{o}"
        rows = [
            Row(
                "agreement_hvp",
                hs.hvp_agreement(main, other, p.gate_vectors, seed=p.seed),
                variant=v,
                note="max ||Hv_a - Hv_b|| / ||Hv_b||",
            )
        ]
        e2 = self._eig(hs, other, 1)
        rows.append(
            Row(
                "agreement_top_eigenvalue",
                _rel(e2.eigenvalues[0], est["eig"].eigenvalues[0]),
                variant=v,
                note=f"{o}: {e2.eigenvalues[0]:.8g}",
            )
        )
        tr = est["trace"]
        if tr is not None:
            # The same seed gives the same probes: compare the means over the first n of them.
            n = min(tr.n, p.compare_probes)
            t2 = hs.hutchinson_trace(
                other, rel_target_se=None, min_samples=n, max_samples=n, seed=p.seed
            )
            ref = math.fsum(tr.samples[:n]) / n
            rows.append(
                Row(
                    "agreement_trace",
                    _rel(t2.trace, ref),
                    variant=v,
                    note=f"same {n} probes; {b}: {ref:.8g}, {o}: {t2.trace:.8g}",
                )
            )
        return rows


@plots.register("hessian")
def hessian_plots(df: Any, run_dir: Path) -> dict[str, Any]:
    """``plots/hessian_density.png``: every cell's SLQ density with its top eigenvalue."""
    from .. import plots_analysis as pa

    series = plots.read_series(run_dir, SERIES)
    if series.empty:
        return {}
    eigs = df[
        (df["analysis"] == "hessian") & (df["metric"] == "top_eigenvalue") & (df["repeat"] == 0)
    ]
    bad = {(c, int(sd)) for c, sd in eigs[eigs["status"] != "ok"][["cell_id", "seed"]].to_numpy()}
    eigs = eigs.rename(columns={"value": "eigenvalue"})[["cell_id", "seed", "eigenvalue"]]
    return {"hessian_density": pa.hessian_density(series, eigs, unreliable=bad)}
