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
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..analyses.base import Analysis, CellContext, Row
from ..core.registry import analyses
from ..run import plots
from ..run.results import FLAGGED

SERIES = "hessian_density"
RITZ = "hessian_ritz"
GATES = ("grad_check", "hvp_vs_fd", "symmetry")
#: the DEQ solves checked (gate d): forward, IFT adjoint, tangent of the double backward
SOLVE_KINDS = ("forward", "backward", "tangent")
SOLVE_NAMES = {"forward": "forward", "backward": "adjoint", "tangent": "second-order tangent"}
#: solver tolerance of the float64 reference copy (1e-10 .. 1e-13)
REF_TOL = 1e-12


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


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


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
        import pandas as pd

        p = self.params
        rows: list[Row] = []
        backend = p.backend
        label = hs.loss_label(model)
        ops: dict[str, Any] = {}
        causes: list[str] = []  # one-line cause + fix per failed check, in order of priority
        flag: list[Row] = []  # rows whose measurement failed (status "flagged", note = causes)
        estimates_bad = False  # the estimates themselves are unreliable
        fallback = ""  # why the estimates come from the fd backend instead of ``backend``

        def op_for(b: str) -> Any:
            if b not in ops:
                ops[b] = hs.HVPOperator(model, loss_fn, batches, params=names, backend=b)
            return ops[b]

        from ..core.deq import is_deq

        tighten = (
            "solves not tight enough: lower --hessian-tol or use --dtype float64"
            if is_deq(model)
            else "the model's own solver (not a deqbench DEQ layer) is not tightened by the "
            "analysis: lower its tolerance"
        )
        t0 = time.perf_counter()

        def lap(phase: str) -> None:
            nonlocal t0
            t1 = time.perf_counter()
            rows.append(Row("seconds", t1 - t0, variant=phase, unit="s"))
            t0 = t1

        try:
            main = op_for(backend)
            rows.append(Row("hessian_dim", main.dim, note=label))
            rep = None
            if p.gates:
                if ref is not None:  # FD reference in float64 on a copy at the same weights
                    fd = ops["fd64"] = hs.HVPOperator(
                        ref[0], loss_fn, ref[1], params=names, backend="fd"
                    )
                else:
                    fd = op_for("fd")
                rep = hs.run_gates(main, fd, n=p.gate_vectors, seed=p.seed)
                gate_rows = {}
                for k in GATES:
                    ok = rep.passed[k]
                    note = f"threshold {rep.thresholds[k]:g}" + ("" if ok else " (failed)")
                    if k == "hvp_vs_fd" and rep.fd_retries:
                        note += f"; smaller FD step on {rep.fd_retries} vector(s)"
                    gate_rows[k] = Row(f"gate_{k}", getattr(rep, k), variant=backend, note=note)
                    rows.append(gate_rows[k])
                    if not ok:
                        flag.append(gate_rows[k])
                rows.append(Row("gate_ok", float(rep.ok), variant=backend, note=label))
                if not rep.ok:
                    flag.append(rows[-1])
                if not rep.passed["grad_check"]:
                    estimates_bad = True
                    causes.append(
                        f"gradient check failed ({rep.grad_check:.2e} > "
                        f"{rep.thresholds['grad_check']:g}): the model's backward ({label}) is "
                        "not the gradient of the loss, so its Hessian is not the loss's: use "
                        "--backward ift"
                    )
                elif not rep.ok and backend != "fd":
                    bad = [k for k in GATES if not rep.passed[k]]
                    what = ", ".join(f"{k} {getattr(rep, k):.2e}" for k in bad)
                    if p.on_gate_fail == "fd":
                        fallback = f"{backend} HVPs failed gate {what}"
                        how = ", float64" if ref is not None else ""
                        causes.append(
                            f"{fallback}; the estimates are from the finite-difference fallback"
                            f" (fd{how}): use --backend fd to accept them"
                        )
                        backend = "fd"
                        main = fd
                        sym = hs.symmetry_error(fd, p.gate_vectors, seed=p.seed)
                        th = rep.thresholds["symmetry"]
                        r = Row("gate_symmetry", sym, variant="fd", note=f"threshold {th:g}")
                        rows.append(r)
                        if not (math.isfinite(sym) and sym <= th):
                            flag.append(r)
                            estimates_bad = True
                            causes.append(
                                f"finite-difference HVPs are not symmetric ({sym:.2e} > {th:g}):"
                                f" {tighten}"
                            )
                    else:
                        estimates_bad = True
                        causes.append(
                            f"{backend} HVPs failed gate {what}; estimates reported anyway: use "
                            "--backend fd"
                        )
                elif not rep.ok:
                    estimates_bad = True
                    causes.append(
                        f"finite-difference HVPs failed gate symmetry ({rep.symmetry:.2e} > "
                        f"{rep.thresholds['symmetry']:g}): {tighten}"
                    )
                lap("gates")
            rows.append(
                Row(
                    "fd_fallback",
                    float(bool(fallback)),
                    variant=backend,
                    note=(
                        f"estimates from the finite-difference fallback: {fallback}"
                        if fallback
                        else f"estimates from the {backend} backend"
                    ),
                )
            )
            est = self._estimate(main, hs)
            lap("estimates")
            est_note = label + (f"; finite-difference fallback ({fallback})" if fallback else "")
            est_rows = self._rows(est, backend, est_note)
            rows.extend(est_rows)
            eig = est["eig"]
            if not eig.converged:
                # |lambda - theta| <= r for a Ritz pair with residual r: the pairs whose verified
                # residual missed the requested (relative) tolerance are unreliable
                scale = max((abs(v) for v in eig.eigenvalues), default=0.0)
                lim = p.eig_tol * max(
                    scale, abs(eig.lambda_min) if math.isfinite(eig.lambda_min) else 0.0
                )
                loose = {i for i, r in enumerate(eig.residuals) if not r <= lim}
                if loose:
                    r0 = max(eig.residuals[i] for i in loose)
                    flag.extend(
                        r for r in est_rows if r.metric == "top_eigenvalue" and r.repeat in loose
                    )
                    causes.append(
                        f"Lanczos did not converge (Ritz residual {r0:.1e} > {lim:.1e} after "
                        f"{eig.n_hvp} products): loosen --eig-tol or raise hessian.eig_max_iter"
                    )
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
                            "fd_fallback": bool(fallback),
                        }
                    ),
                )
                ctx.write_series(RITZ, dens.as_frame())
                r = Row(
                    "slq_trace", dens.trace_estimate, variant=backend, note=f"sigma={sigma:.3g}"
                )
                rows.append(r)
                est_rows.append(r)
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
            # gate (d): every DEQ solve of the analysis (forward, IFT adjoint, and the tangent
            # solve of the double backward) reached its tolerance: the model's at ``tol``, the
            # float64 reference copy's at REF_TOL
            sources = [([o for b, o in ops.items() if b not in ("pyhessian", "fd64")], tol)]
            if "fd64" in ops:
                sources.append(([ops["fd64"]], REF_TOL))
            missed = []
            for kind in SOLVE_KINDS:
                per = [(self._solve_residuals(o), t) for o, t in sources]
                cs = [
                    (r[f"{kind}_all_converged"], r, t)
                    for r, t in per
                    if f"{kind}_all_converged" in r
                ]
                if not cs:
                    continue
                c = min(x[0] for x in cs)
                v = max(r.get(f"{kind}_rel_residual_max", math.nan) for _, r, _ in cs)
                rows.append(Row(f"gate_{kind}_rel_residual_max", v, variant=backend))
                tols = f"tol {tol:g}" + (f" (float64 reference {REF_TOL:g})" if ref else "")
                r = Row(f"gate_{kind}_all_converged", c, variant=backend, note=tols)
                rows.append(r)
                if c < 1.0:
                    flag.append(r)
                    for ck, rk, tk in cs:
                        if ck < 1.0:
                            v = rk.get(f"{kind}_rel_residual_max", math.nan)
                            missed.append(f"{SOLVE_NAMES[kind]} rel {v:.2e} > {tk:g}")
            if missed:  # the root cause: failed gates and estimates follow from it
                estimates_bad = True
                causes[:] = [
                    f"DEQ solves at the trained weights missed their tolerance ({'; '.join(missed)}"
                    f" in {self._budget(model)} iterations): raise --max-iter or --hessian-tol"
                    + ("" if str(ctx.dtype) == "torch.float64" else ", or use --dtype float64")
                ]
            bad_values = [r for r in est_rows if not math.isfinite(r.value)]
            if bad_values:
                estimates_bad = True
                causes.append(
                    f"non-finite estimates ({', '.join(sorted({r.metric for r in bad_values}))}):"
                    " see the gate and residual rows"
                )
            if estimates_bad:
                flag.extend(est_rows)
        finally:
            for op in reversed(list(ops.values())):  # LIFO: each restores what it found
                op.close()
        if causes or flag:
            note = "; ".join(dict.fromkeys(causes)) or "hessian measurement failed its checks"
            ids = {id(r) for r in flag}
            for r in rows:
                if id(r) in ids and r.status == "ok":
                    r.status, r.note = FLAGGED, note
        return rows

    @staticmethod
    def _solve_residuals(ops: list[Any]) -> dict[str, float]:
        """The operators' DEQ solve records merged: largest residuals, least convergence."""
        out: dict[str, float] = {}
        for op in ops:
            for k, v in op.residuals().items():
                if k in out:
                    v = min(out[k], v) if k.endswith("converged") else max(out[k], v)
                out[k] = v
        return out

    @staticmethod
    def _budget(model: Any) -> int:
        from ..core.deq import deq_layers

        return max(
            (max(ly.solver_cfg.max_iter, ly.backward_cfg.max_iter) for ly in deq_layers(model)),
            default=0,
        )

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

    def _rows(self, est: dict[str, Any], backend: str, note: str) -> list[Row]:
        """The estimate rows (top eigenvalues, lambda_min, trace and their diagnostics)."""
        eig, tr = est["eig"], est["trace"]
        rows = []
        for i, (v, r) in enumerate(zip(eig.eigenvalues, eig.residuals)):
            rows.append(Row("top_eigenvalue", v, variant=backend, repeat=i, note=note))
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
                    note="smallest Ritz value (extremal, less converged than the top)",
                )
            )
        if tr is not None:
            rows.append(Row("trace", tr.trace, variant=backend, note=note))
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
