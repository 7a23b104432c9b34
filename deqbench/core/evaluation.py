"""Evaluation of a model on a data split: loss, accuracy or MSE, and mean DEQ forward stats
(used by training, :mod:`deqbench.run.train`, and by the analyses through
:meth:`CellContext.evaluate <deqbench.analyses.base.CellContext.evaluate>`). It depends on the
DEQ core only, so that the analysis contract can call it without importing the runner."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .deq import Runtime, last_stats
from .image_metrics import image_sums, is_image
from .runtime import autocast, for_loss, model_runtime
from .verdict import solve_ledger, verify_solves


def loss_function(task: str) -> Callable[[Tensor, Tensor], Tensor]:
    if task == "classification":
        return nn.functional.cross_entropy
    return nn.functional.mse_loss


def evaluate(
    model: nn.Module,
    X: Tensor,
    y: Tensor,
    task: str,
    batch_size: int = 512,
    runtime: Runtime | None = None,
    data_range: float = 1.0,
) -> dict[str, float]:
    """Loss, accuracy (classification) or MSE (regression; with image-shaped targets also the
    mean PSNR and SSIM of ``data_range``, :mod:`deqbench.core.image_metrics`), and mean DEQ
    forward stats, under ``no_grad`` in eval mode. ``runtime`` (default: the model's DEQ layers'): the forward runs
    under its autocast, the loss in float32. Every batch solve is verified (its residual
    recomputed with one more f-evaluation); ``forward_converged`` is the share of them the
    runner accepted, absent where nothing was solved (an unrolled K-step forward)."""
    if runtime is None:
        runtime = model_runtime(model)
    was = model.training
    model.eval()
    loss_fn = loss_function(task)
    tot_loss, tot_correct, n = 0.0, 0.0, 0
    quality: dict[str, float] = {}  # image-shaped regression targets: psnr, ssim sums
    nsteps: list[float] = []
    resid: list[float] = []
    with solve_ledger() as ledger, verify_solves():
        for i in range(0, X.shape[0], batch_size):
            xb, yb = X[i : i + batch_size], y[i : i + batch_size]
            with torch.no_grad(), autocast(runtime, xb.device):  # an evaluation needs no graph
                out = model(xb)
                loss = loss_fn(for_loss(out, runtime), yb)
            b = xb.shape[0]
            tot_loss += float(loss) * b
            if task == "classification":
                tot_correct += float((out.argmax(1) == yb).sum())
            elif is_image(yb):
                for k, v in image_sums(for_loss(out, runtime), yb, data_range).items():
                    quality[k] = quality.get(k, 0.0) + v
            n += b
            st = last_stats(model)
            if st:
                nsteps.append(st["forward_nstep"])
                resid.append(st["forward_rel_residual"])
    model.train(was)
    res = {"loss": tot_loss / max(n, 1)}
    if task == "classification":
        res["accuracy"] = tot_correct / max(n, 1)
    else:
        res["mse"] = res["loss"]
        res.update({k: v / max(n, 1) for k, v in quality.items()})
    if nsteps:
        res["forward_nstep"] = sum(nsteps) / len(nsteps)
        res["forward_rel_residual"] = max(resid)
    res.update(converged_share(ledger.records))
    return res


def converged_share(records: list[Any]) -> dict[str, float]:
    """``forward_converged`` / ``backward_converged``: the share of ``records`` (batch solves,
    :class:`deqbench.core.verdict.SolveRecord`) the runner accepted."""
    out: dict[str, float] = {}
    for kind, key in (("forward", "forward_converged"), ("adjoint", "backward_converged")):
        rs = [r for r in records if r.kind == kind]
        if rs:
            out[key] = sum(r.converged for r in rs) / len(rs)
    return out
