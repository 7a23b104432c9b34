"""One measurement of the Hessian analysis at the trained weights: the gates (with the
finite-difference fallback), the estimates (top eigenvalues, trace, SLQ density), the agreement
with the compared backends and the DEQ solves' own gate, each step adding its rows, the rows it
flags and the causes of the flags. :class:`deqbench.hessian.analysis.Hessian` drives it."""

from __future__ import annotations

import math
import time
from typing import Any

from ..analyses.base import CellContext, Row
from ..run.results import FLAGGED

SERIES = "hessian_density"
RITZ = "hessian_ritz"
GATES = ("grad_check", "hvp_vs_fd", "symmetry")
#: the DEQ solves checked (gate d): forward, IFT adjoint, tangent of the double backward
SOLVE_KINDS = ("forward", "backward", "tangent")
SOLVE_NAMES = {"forward": "forward", "backward": "adjoint", "tangent": "second-order tangent"}
#: solver tolerance of the float64 reference copy (1e-10 .. 1e-13)
REF_TOL = 1e-12


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


class Measurement:
    """The state of one measurement: the operators built per backend, the rows, the rows that
    failed (flagged at the end with the causes) and whether the estimates are unreliable."""

    def __init__(
        self,
        params: Any,
        ctx: CellContext,
        hs: Any,
        model: Any,
        loss_fn: Any,
        batches: Any,
        names: Any,
        tol: float,
        ref: tuple[Any, Any] | None,
    ) -> None:
        from ..core.deq import is_deq

        self.p, self.ctx, self.hs, self.model = params, ctx, hs, model
        self.loss_fn, self.batches, self.names, self.tol, self.ref = (
            loss_fn,
            batches,
            names,
            tol,
            ref,
        )
        self.rows: list[Row] = []
        self.backend: str = params.backend
        self.label = hs.loss_label(model)
        self.ops: dict[str, Any] = {}
        self.causes: list[str] = []  # one-line cause + fix per failed check, in order of priority
        self.flag: list[Row] = []  # rows whose measurement failed (status "flagged", note = causes)
        self.estimates_bad = False  # the estimates themselves are unreliable
        self.fallback = ""  # why the estimates come from the fd backend instead of ``backend``
        self.tighten = (
            "solves not tight enough: lower --hessian-tol or use --dtype float64"
            if is_deq(model)
            else "the model's own solver (not a deqbench DEQ layer) is not tightened by the "
            "analysis: lower its tolerance"
        )
        self.t0 = time.perf_counter()

    def op_for(self, b: str) -> Any:
        if b not in self.ops:
            self.ops[b] = self.hs.HVPOperator(
                self.model, self.loss_fn, self.batches, params=self.names, backend=b
            )
        return self.ops[b]

    def lap(self, phase: str) -> None:
        t1 = time.perf_counter()
        self.rows.append(Row("seconds", t1 - self.t0, variant=phase, unit="s"))
        self.t0 = t1

    def run(self) -> list[Row]:
        p, rows = self.p, self.rows
        try:
            main = self.op_for(self.backend)
            rows.append(Row("hessian_dim", main.dim, note=self.label))
            if p.gates:
                main = self.gates(main)
                self.lap("gates")
            backend, fallback = self.backend, self.fallback
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
            est = estimate(p, main, self.hs)
            self.lap("estimates")
            note = self.label + (f"; finite-difference fallback ({fallback})" if fallback else "")
            est_rows = estimate_rows(est, backend, note)
            rows.extend(est_rows)
            self.check_eigenvalues(est["eig"], est_rows)
            if p.density:
                est_rows.append(self.density(main))
                self.lap("density")
            self.compare_backends(main, est)
            rows.append(
                Row(
                    "hvp_seconds",
                    main.seconds_per_hvp,
                    variant=backend,
                    unit="s",
                    note=f"{main.n_hvp} products",
                )
            )
            self.solve_gates()
            bad_values = [r for r in est_rows if not math.isfinite(r.value)]
            if bad_values:
                self.estimates_bad = True
                self.causes.append(
                    f"non-finite estimates ({', '.join(sorted({r.metric for r in bad_values}))}):"
                    " see the gate and residual rows"
                )
            if self.estimates_bad:
                self.flag.extend(est_rows)
        finally:
            for op in reversed(list(self.ops.values())):  # LIFO: each restores what it found
                op.close()
        if self.causes or self.flag:
            note = "; ".join(dict.fromkeys(self.causes)) or "hessian measurement failed its checks"
            ids = {id(r) for r in self.flag}
            for r in rows:
                if id(r) in ids and r.status == "ok":
                    r.status, r.note = FLAGGED, note
        return rows

    def gates(self, main: Any) -> Any:
        """The gates of ``main`` against the finite-difference reference; the operator the
        estimates come from (the fd one when ``on_gate_fail: fd`` falls back to it)."""
        p, hs, rows, flag, causes = self.p, self.hs, self.rows, self.flag, self.causes
        backend, ref = self.backend, self.ref
        if ref is not None:  # FD reference in float64 on a copy at the same weights
            fd = self.ops["fd64"] = hs.HVPOperator(
                ref[0], self.loss_fn, ref[1], params=self.names, backend="fd"
            )
        else:
            fd = self.op_for("fd")
        rep = hs.run_gates(main, fd, n=p.gate_vectors, seed=p.seed)
        for k in GATES:
            ok = rep.passed[k]
            note = f"threshold {rep.thresholds[k]:g}" + ("" if ok else " (failed)")
            if k == "hvp_vs_fd" and rep.fd_retries:
                note += f"; smaller FD step on {rep.fd_retries} vector(s)"
            rows.append(Row(f"gate_{k}", getattr(rep, k), variant=backend, note=note))
            if not ok:
                flag.append(rows[-1])
        rows.append(Row("gate_ok", float(rep.ok), variant=backend, note=self.label))
        if not rep.ok:
            flag.append(rows[-1])
        if not rep.passed["grad_check"]:
            self.estimates_bad = True
            causes.append(
                f"gradient check failed ({rep.grad_check:.2e} > "
                f"{rep.thresholds['grad_check']:g}): the model's backward ({self.label}) is "
                "not the gradient of the loss, so its Hessian is not the loss's: use "
                "--backward ift"
            )
        elif not rep.ok and backend != "fd":
            bad = [k for k in GATES if not rep.passed[k]]
            what = ", ".join(f"{k} {getattr(rep, k):.2e}" for k in bad)
            if p.on_gate_fail == "fd":
                return self.fall_back(fd, rep, what)
            self.estimates_bad = True
            causes.append(
                f"{backend} HVPs failed gate {what}; estimates reported anyway: use --backend fd"
            )
        elif not rep.ok:
            self.estimates_bad = True
            causes.append(
                f"finite-difference HVPs failed gate symmetry ({rep.symmetry:.2e} > "
                f"{rep.thresholds['symmetry']:g}): {self.tighten}"
            )
        return main

    def fall_back(self, fd: Any, rep: Any, what: str) -> Any:
        """The estimates move to the finite-difference operator ``fd`` (whose symmetry is
        checked), after ``backend`` failed the gates ``what``."""
        p = self.p
        self.fallback = f"{self.backend} HVPs failed gate {what}"
        how = ", float64" if self.ref is not None else ""
        self.causes.append(
            f"{self.fallback}; the estimates are from the finite-difference fallback"
            f" (fd{how}): use --backend fd to accept them"
        )
        self.backend = "fd"
        sym = self.hs.symmetry_error(fd, p.gate_vectors, seed=p.seed)
        th = rep.thresholds["symmetry"]
        r = Row("gate_symmetry", sym, variant="fd", note=f"threshold {th:g}")
        self.rows.append(r)
        if not (math.isfinite(sym) and sym <= th):
            self.flag.append(r)
            self.estimates_bad = True
            self.causes.append(
                f"finite-difference HVPs are not symmetric ({sym:.2e} > {th:g}): {self.tighten}"
            )
        return fd

    def check_eigenvalues(self, eig: Any, est_rows: list[Row]) -> None:
        """Flag the top eigenvalues whose Ritz residual missed the requested tolerance."""
        if eig.converged:
            return
        # |lambda - theta| <= r for a Ritz pair with residual r: the pairs whose verified
        # residual missed the requested (relative) tolerance are unreliable
        scale = max((abs(v) for v in eig.eigenvalues), default=0.0)
        lim = self.p.eig_tol * max(
            scale, abs(eig.lambda_min) if math.isfinite(eig.lambda_min) else 0.0
        )
        loose = {i for i, r in enumerate(eig.residuals) if not r <= lim}
        if loose:
            r0 = max(eig.residuals[i] for i in loose)
            self.flag.extend(
                r for r in est_rows if r.metric == "top_eigenvalue" and r.repeat in loose
            )
            self.causes.append(
                f"Lanczos did not converge (Ritz residual {r0:.1e} > {lim:.1e} after "
                f"{eig.n_hvp} products): loosen --eig-tol or raise hessian.eig_max_iter"
            )

    def density(self, main: Any) -> Row:
        """The SLQ density (its series and Ritz values written) and its trace row."""
        import pandas as pd

        p = self.p
        dens = self.hs.slq(main, n_probes=p.slq_probes, steps=p.slq_steps, seed=p.seed)
        grid, d, sigma = dens.curve(sigma_rel=p.sigma_rel)
        self.ctx.write_series(
            SERIES,
            pd.DataFrame(
                {
                    "lambda": grid.numpy(),
                    "density": d.numpy(),
                    "sigma": sigma,
                    "backend": self.backend,
                    "fd_fallback": bool(self.fallback),
                }
            ),
        )
        self.ctx.write_series(RITZ, dens.as_frame())
        r = Row("slq_trace", dens.trace_estimate, variant=self.backend, note=f"sigma={sigma:.3g}")
        self.rows.append(r)
        return r

    def compare_backends(self, main: Any, est: dict[str, Any]) -> None:
        """The agreement of the estimates with each compared backend's."""
        backend = self.backend
        for other in self.p.compare:
            if other == backend:
                continue
            try:
                self.rows.extend(
                    compare(self.p, self.hs, main, self.op_for(other), est, backend, other)
                )
            except Exception as exc:  # noqa: BLE001 - a comparison backend failing is a row
                self.rows.append(
                    Row(
                        "agreement_hvp",
                        math.nan,
                        variant=f"{backend}:{other}",
                        status="error",
                        note=f"{type(exc).__name__}: {exc}"[:300],
                    )
                )
        if self.p.compare:
            self.lap("compare")

    def solve_gates(self) -> None:
        """Gate (d): every DEQ solve of the analysis (forward, IFT adjoint, and the tangent
        solve of the double backward) reached its tolerance: the model's at ``tol``, the float64
        reference copy's at REF_TOL. A missed one is the root cause: the failed gates and
        estimates follow from it."""
        ops, tol, ref, backend = self.ops, self.tol, self.ref, self.backend
        sources = [([o for b, o in ops.items() if b not in ("pyhessian", "fd64")], tol)]
        if "fd64" in ops:
            sources.append(([ops["fd64"]], REF_TOL))
        missed = []
        for kind in SOLVE_KINDS:
            per = [(solve_residuals(o), t) for o, t in sources]
            cs = [
                (r[f"{kind}_all_converged"], r, t) for r, t in per if f"{kind}_all_converged" in r
            ]
            if not cs:
                continue
            c = min(x[0] for x in cs)
            v = max(r.get(f"{kind}_rel_residual_max", math.nan) for _, r, _ in cs)
            self.rows.append(Row(f"gate_{kind}_rel_residual_max", v, variant=backend))
            tols = f"tol {tol:g}" + (f" (float64 reference {REF_TOL:g})" if ref else "")
            r = Row(f"gate_{kind}_all_converged", c, variant=backend, note=tols)
            self.rows.append(r)
            if c < 1.0:
                self.flag.append(r)
                for ck, rk, tk in cs:
                    if ck < 1.0:
                        v = rk.get(f"{kind}_rel_residual_max", math.nan)
                        missed.append(f"{SOLVE_NAMES[kind]} rel {v:.2e} > {tk:g}")
        if missed:
            self.estimates_bad = True
            self.causes[:] = [
                f"DEQ solves at the trained weights missed their tolerance ({'; '.join(missed)}"
                f" in {solve_budget(self.model)} iterations): raise --max-iter or --hessian-tol"
                + ("" if str(self.ctx.dtype) == "torch.float64" else ", or use --dtype float64")
            ]


def solve_residuals(ops: list[Any]) -> dict[str, float]:
    """The operators' DEQ solve records merged: largest residuals, least convergence."""
    out: dict[str, float] = {}
    for op in ops:
        for k, v in op.residuals().items():
            if k in out:
                v = min(out[k], v) if k.endswith("converged") else max(out[k], v)
            out[k] = v
    return out


def solve_budget(model: Any) -> int:
    """The largest forward or backward iteration budget of the model's DEQ layers."""
    from ..core.deq import deq_layers

    return max(
        (max(ly.solver_cfg.max_iter, ly.backward_cfg.max_iter) for ly in deq_layers(model)),
        default=0,
    )


def eigenvalues(p: Any, hs: Any, op: Any, k: int) -> Any:
    """Top-``k`` eigenvalues by ``method`` (power iteration gives the top one only)."""
    if p.method == "power":
        return hs.power_iteration(op, max_iter=max(p.eig_max_iter, 10), tol=p.eig_tol, seed=p.seed)
    return hs.lanczos(op, k, max_iter=p.eig_max_iter, tol=p.eig_tol, seed=p.seed)


def estimate(p: Any, op: Any, hs: Any) -> dict[str, Any]:
    """The top eigenvalues and (``trace``) the Hutchinson trace of ``op``."""
    eig = eigenvalues(p, hs, op, p.top_k)
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


def estimate_rows(est: dict[str, Any], backend: str, note: str) -> list[Row]:
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


def compare(
    p: Any, hs: Any, main: Any, other: Any, est: dict[str, Any], b: str, o: str
) -> list[Row]:
    """The agreement of backend ``o``'s HVPs, top eigenvalue and trace with ``b``'s."""
    v = f"{b}:{o}"
    rows = [
        Row(
            "agreement_hvp",
            hs.hvp_agreement(main, other, p.gate_vectors, seed=p.seed),
            variant=v,
            note="max ||Hv_a - Hv_b|| / ||Hv_b||",
        )
    ]
    e2 = eigenvalues(p, hs, other, 1)
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
