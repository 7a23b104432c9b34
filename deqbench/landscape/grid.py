"""The evaluation of a landscape grid, point by point: the perturbed weights of a point, its
solves (alone, warm-started from solved neighbours, or vmapped in chunks for explicit models) and
its row. :func:`deqbench.landscape.surface.evaluate_grid` drives it; the warm starts themselves
are in :mod:`deqbench.landscape.warm_start`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..core.deq import deq_layers, is_deq
from .directions import _weights
from .warm_start import (
    Combo,
    Index,
    _nearest_zero,
    _WarmStart,
    visit_order,
    warm_candidates,
    warm_start_mode,
    warm_store_mode,
)


def _loss_fn(task: str) -> Callable[[Tensor, Tensor], Tensor]:
    return nn.functional.cross_entropy if task == "classification" else nn.functional.mse_loss


def _point_params(base, dirs, coords) -> dict[str, Tensor]:
    out = {}
    for n, w in base.items():
        p = w
        for d, c in zip(dirs, coords):
            if c != 0.0:
                p = p + c * d[n]
        out[n] = p
    return out


def _spec_weights(model: nn.Module) -> list[str]:
    """Names of 2-D cell weights of the DEQ layers (their spectral norm is logged per point)."""
    from ..core.contracts import cell_weights  # without the parameters a cell declares as injection

    ids = {
        id(p) for layer in deq_layers(model) for _, p in cell_weights(layer.cell) if p.dim() == 2
    }
    return [n for n, p in model.named_parameters() if id(p) in ids]


_STATUS_RANK = {"ok": 0, "converged": 0, "stagnated": 1, "max_iter": 2, "diverged": 3, "nan": 4}


class _PointAcc:
    def __init__(self, device) -> None:
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.float64, device=device)
        self.n = 0
        self.nsteps: list[float] = []
        self.rel: list[float] = []
        self.abs: list[float] = []
        self.converged = True
        self.frac: list[tuple[float, int]] = []  # (converged fraction, batch size)
        self.status = "ok"
        self.tol = math.nan  # the largest tolerance asked of the solves (for notes)
        self.solver = ""

    @property
    def measured(self) -> bool:
        """Whether a DEQ layer reported a forward solve (convergence is known)."""
        return bool(self.nsteps)

    def add_deq(self, layers: Sequence[Any]) -> None:
        stats = [
            layer.last_forward_stats for layer in layers if layer.last_forward_stats is not None
        ]
        if not stats:
            return
        self.nsteps.append(float(sum(s.nstep for s in stats)))
        self.rel.append(max(s.rel_max for s in stats))
        self.abs.append(max(s.abs_max for s in stats))
        self.frac.append((min(s.converged_frac for s in stats), int(stats[0].residual.numel())))
        self.tol = max(
            [t for t in (self.tol, *(float(s.tol) for s in stats)) if t == t] or [math.nan]
        )
        self.solver = ",".join(sorted({s.solver for s in stats if s.solver}))
        for s in stats:
            self.converged = self.converged and bool(s.converged)
            st = s.status if s.status in _STATUS_RANK else "max_iter"
            if _STATUS_RANK[st] > _STATUS_RANK[self.status]:
                self.status = st


def _row(
    a, b, acc: _PointAcc, task: str, dim: int, spec: float, init: str = "model"
) -> dict[str, Any]:
    n = max(acc.n, 1)
    loss = float(acc.loss) / n
    measured = acc.measured
    if measured:
        status = (
            "converged" if acc.converged else (acc.status if acc.status != "ok" else "max_iter")
        )
    else:
        status = "ok"
    if not math.isfinite(loss) and status in ("ok", "converged"):
        status = "nan"
    usable = math.isfinite(loss) and (acc.converged or not measured)
    row: dict[str, Any] = {"alpha": a}
    if dim >= 2:
        row["beta"] = b
    row["loss"] = loss if usable else math.nan
    row["loss_raw"] = loss
    if task == "classification":
        row["accuracy"] = float(acc.correct) / n
    else:
        row["mse"] = loss
    # True / False when a solve was measured; None (empty in the CSV) when convergence is unknown
    row["converged"] = bool(usable) if measured else None
    row["status"] = status
    row["init"] = init
    row["f_nstep"] = sum(acc.nsteps) / len(acc.nsteps) if acc.nsteps else math.nan
    row["f_residual"] = max(acc.rel) if acc.rel else math.nan
    row["f_abs_residual"] = max(acc.abs) if acc.abs else math.nan
    nb = sum(b for _, b in acc.frac)
    row["f_converged_frac"] = sum(f * b for f, b in acc.frac) / nb if nb else math.nan
    row["f_tol"] = acc.tol
    row["w_spec_norm"] = spec
    return row


class _Grid:
    """One evaluation of :func:`evaluate_grid`: the model, the examples, the directions and the
    warm starts, and the ways a point is evaluated (alone, warm-started, or vmapped in chunks)."""

    def __init__(
        self,
        model: nn.Module,
        directions: Sequence[dict[str, Tensor]],
        X: Tensor,
        y: Tensor,
        *,
        alphas: Sequence[float],
        betas: list[float],
        task: str,
        batch_size: int | None,
        spec_norm: bool,
        warm_start: bool | str,
        warm_retry: bool,
        warm_store: str = "auto",
    ) -> None:
        self.model, self.X, self.y, self.task = model, X, y, task
        self.dirs = list(directions)
        self.dim = len(self.dirs)
        self.alphas, self.betas = [float(a) for a in alphas], [float(b) for b in betas]
        self.deq = is_deq(model)
        self.n = X.shape[0]
        self.bs = self.n if not batch_size else min(int(batch_size), self.n)
        self.loss_fn = _loss_fn(task)
        self.device = X.device
        self.layers = list(deq_layers(model))
        self.mode = warm_start_mode(warm_start) if self.deq else "off"
        if self.mode == "centre" and (0.0 not in self.alphas or 0.0 not in self.betas):
            self.mode = "off"  # the centre is not on the grid
        store = warm_store_mode(warm_store, self.device)
        self.warm = _WarmStart(self.layers, store) if self.mode != "off" else None
        self.warm_retry = warm_retry
        self.spec_names = _spec_weights(model) if spec_norm and self.deq else []
        self.base = _weights(model)

    def spec_of(self, params: dict[str, Tensor]) -> float:
        if not self.spec_names:
            return math.nan
        return max(
            float(torch.linalg.matrix_norm(params[nm].double(), ord=2)) for nm in self.spec_names
        )

    def solve_point(self, params: dict[str, Tensor]) -> _PointAcc:
        acc = _PointAcc(self.device)
        X, y, bs, warm = self.X, self.y, self.bs, self.warm
        for i in range(0, self.n, bs):
            xb, yb = X[i : i + bs], y[i : i + bs]
            for layer in self.layers:  # stats of this forward only
                layer.last_forward_stats = None
            if warm is not None:
                warm.begin(i)
            out = functional_call(self.model, params, (xb,))
            m = xb.shape[0]
            acc.loss += self.loss_fn(out, yb).double() * m
            if self.task == "classification":
                acc.correct += (out.argmax(1) == yb).sum().double()
            acc.n += m
            if self.deq:
                acc.add_deq(self.layers)
        return acc

    def one_point(
        self,
        a: float,
        b: float,
        point: Any = None,
        combos: Sequence[Combo] = (),
        record: bool = False,
        src_coords: tuple[float, float] | None = None,
    ) -> dict[str, Any]:
        warm, dim = self.warm, self.dim
        params = _point_params(self.base, self.dirs, (a, b)[:dim])
        if warm is not None:
            warm.start_point(point, combos, record)
        acc = self.solve_point(params)
        frac, pred = warm.warm_frac() if warm is not None else (0.0, 0.0)
        first = math.nan
        if warm is not None and frac > 0 and self.warm_retry and acc.measured and not acc.converged:
            # the warm start missed the tolerance: the point is solved again as the model
            # starts it (its row is that solve's; f_nstep counts both)
            first = sum(acc.nsteps) / len(acc.nsteps)
            warm.start_point(point, (), record)
            acc = self.solve_point(params)
            frac, pred = 0.0, 0.0
        init = "model" if frac == 0.0 else (self.mode if frac == 1.0 else "partial")
        row = _row(a, b, acc, self.task, dim, self.spec_of(params), init)
        if self.deq:
            retried = first == first
            if retried:
                row["f_nstep"] += first
            row["warm_frac"] = frac
            row["predicted_frac"] = pred
            row["warm_retried"] = retried
            row["init_alpha"] = src_coords[0] if src_coords and frac else math.nan
            if dim >= 2:
                row["init_beta"] = src_coords[1] if src_coords and frac else math.nan
        return row

    def chunk_vmap(self, chunk: list[tuple[float, float]]) -> list[dict[str, Any]]:
        model, task, loss_fn, device = self.model, self.task, self.loss_fn, self.device
        cs = torch.tensor(chunk, dtype=torch.float64)
        stacked = {}
        for nm, w in self.base.items():
            p = w.unsqueeze(0).expand(len(chunk), *w.shape)
            for k, d in enumerate(self.dirs):
                c = cs[:, k].to(device=w.device, dtype=w.dtype).view(-1, *([1] * w.dim()))
                p = p + c * d[nm]
            stacked[nm] = p

        def f(p, xb, yb):
            out = functional_call(model, p, (xb,))
            loss = loss_fn(out, yb)
            if task == "classification":
                return loss, (out.argmax(1) == yb).sum()
            return loss, loss.new_zeros(())

        vf = torch.func.vmap(f, in_dims=(0, None, None))
        loss_sum = torch.zeros(len(chunk), dtype=torch.float64, device=device)
        corr = torch.zeros(len(chunk), dtype=torch.float64, device=device)
        for i in range(0, self.n, self.bs):
            xb, yb = self.X[i : i + self.bs], self.y[i : i + self.bs]
            lo, co = vf(stacked, xb, yb)
            loss_sum += lo.double() * xb.shape[0]
            corr += co.double()
        rows = []
        ls, cr = loss_sum.cpu().tolist(), corr.cpu().tolist()
        for j, (a, b) in enumerate(chunk):
            acc = _PointAcc(device)
            acc.loss, acc.correct, acc.n = (
                torch.tensor(ls[j], dtype=torch.float64),
                torch.tensor(cr[j], dtype=torch.float64),
                self.n,
            )
            rows.append(_row(a, b, acc, task, self.dim, math.nan))
        return rows

    def warm_order(self) -> list[tuple[Index, list[Combo]]]:
        """Every grid index in the warm-start order, with the combinations it may start from."""
        al, be = self.alphas, self.betas
        if self.mode in ("neighbour", "nearest"):
            start = (_nearest_zero(al), _nearest_zero(be))
            return [
                (pt, warm_candidates(pt, start, src, extrapolate=self.mode == "neighbour"))
                for pt, src in visit_order(len(al), len(be), start)
            ]
        # centre: every other point from the centre, in grid order
        c = (al.index(0.0), be.index(0.0))
        order: list[tuple[Index, list[Combo]]] = [(c, [])]
        order += [
            ((i, j), [((c, 1.0),)]) for j in range(len(be)) for i in range(len(al)) if (i, j) != c
        ]
        return order

    def warm_sweep(self, rows: list[dict[str, Any]], progress: Any) -> None:
        """Every point, in the warm-start order; stored fixed points are dropped as soon as no
        later point can start from them."""
        warm = self.warm
        assert warm is not None
        al, be = self.alphas, self.betas
        order = self.warm_order()
        last_use: dict[Index, int] = {}
        for v, (_, combos) in enumerate(order):
            for combo in combos:
                for sp, _ in combo:
                    last_use[sp] = v
        expire: dict[int, list[Index]] = {}
        for sp, v in last_use.items():
            expire.setdefault(v, []).append(sp)
        for v, ((i, j), combos) in enumerate(order):
            near = next((c[0][0] for c in combos if len(c) == 1), None)
            sc = (al[near[0]], be[near[1]]) if near is not None else None
            rows.append(self.one_point(al[i], be[j], (i, j), combos, (i, j) in last_use, sc))
            for sp in expire.get(v, ()):
                warm.drop(sp)
            if progress is not None:
                progress(v + 1, len(order))

    def sweep(
        self, coords: list[tuple[float, float]], ppb: int, progress: Any
    ) -> tuple[list[dict[str, Any]], bool, str]:
        """The rows of every point of ``coords`` (the centre first), with whether vmap was used
        and why not where it failed."""
        # The centre is evaluated first on its own through the plain path (from the model's
        # own initial state), so it is exactly the unperturbed model's loss whatever the
        # batching of the other points, and its fixed points seed the warm starts.
        rows: list[dict[str, Any]] = []
        vmap_used, vmap_note = False, ""
        total, centre = len(coords), (0.0, 0.0)
        done = 0
        if self.warm is not None:
            self.warm_sweep(rows, progress)
            done = total
        elif centre in coords:
            rows.append(self.one_point(*centre))
            done = 1
            if progress is not None:
                progress(done, total)
        rest = [c for c in coords if c != centre] if self.warm is None else []
        i = 0
        if ppb > 1:
            try:
                first = rest[:ppb]
                rows.extend(self.chunk_vmap(first))
                vmap_used = True
                i = len(first)
                done += len(first)
                if progress is not None:
                    progress(done, total)
            except Exception as exc:  # noqa: BLE001 - any functorch failure -> plain path
                vmap_note = f"vmap unavailable ({type(exc).__name__}: {str(exc)[:120]}); one point per forward"
        while i < len(rest):
            if vmap_used:
                chunk = rest[i : i + ppb]
                rows.extend(self.chunk_vmap(chunk))
                i += len(chunk)
                done += len(chunk)
            else:
                rows.append(self.one_point(*rest[i]))
                i += 1
                done += 1
            if progress is not None:
                progress(done, total)
        return rows, vmap_used, vmap_note
