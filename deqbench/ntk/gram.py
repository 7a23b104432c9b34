"""Gram fast path of the empirical NTK (``method="gram"``): K from N x N Gram matrices of the
fixed points, inputs and adjoints, never forming a Jacobian."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from .engine import prepare, standard_deq

# -- gram fast path --------------------------------------------------------------------------------


def gram_ntk(
    model: nn.Module, X: Tensor, output: str | int, tol: float | None, max_iter: int | None
) -> tuple[Tensor, dict[str, Any]]:
    """Closed-form K from N x N Gram matrices (no Jacobian formed).

    With D = act'(a) * w (a the pre-activation, w the adjoint), Z, X, C the stacked fixed
    points, inputs and output cotangents of the rows:

    * fc_deq (z = act(W z + U x + b)): K = (D D^T) o (Z Z^T + X X^T + 1) + (C C^T) o (Z Z^T + 1);
    * mondeq_fc (W = (1-m) I - A^T A + B - B^T): the W term is replaced by the A and B terms,
      from dF/dA = -(A z) d^T - (A d) z^T and dF/dB = d z^T - z d^T.
    """
    from ..core.deq import DEQModel
    from ..core.errors import ConfigError
    from ..models.fc import FCCell

    try:
        from ..models.mondeq import MonFCCell
    except ImportError:  # pragma: no cover
        MonFCCell = ()  # type: ignore[assignment,misc]
    cell = getattr(getattr(model, "deq", None), "cell", None)
    U, head = getattr(model, "U", None), getattr(model, "head", None)
    ok = (
        standard_deq(model)
        and isinstance(cell, FCCell | MonFCCell)
        and isinstance(U, nn.Linear)
        and isinstance(head, nn.Linear)
    )
    if not ok:
        raise ConfigError(
            f"ntk.method='gram' supports fc_deq and mondeq_fc models (dense cell, linear "
            f"injection and head); {type(model).__name__} is not one; use method='batched'"
        )
    cell = cast("FCCell | MonFCCell", cell)  # as ok checked
    model = cast(DEQModel, model)
    U, head = cast(nn.Linear, U), cast(nn.Linear, head)
    st = prepare(model, X, output=output, tol=tol, max_iter=max_iter)
    f64 = torch.float64

    def on(p: Tensor | None) -> bool:
        return p is not None and p.requires_grad

    with torch.no_grad():
        u = model.inject(st.x)
        z, w = st.z.to(f64), st.w.to(f64)
        ZZ = z @ z.T
        if isinstance(cell, FCCell):
            a = cell.W(st.z) + u
            dact = torch.func.jvp(cell.act, (a,), (torch.ones_like(a),))[1]
        else:
            a = st.z @ cell.weight().T + u
            dact = cell.prox_mask(a)
        D = dact.to(f64) * w
        DD = D @ D.T
        x = st.x.flatten(1).to(f64)
        c = st.c.to(f64)
        inner = torch.zeros_like(ZZ)
        if on(U.weight):
            inner += x @ x.T
        if on(U.bias):
            inner += 1.0
        K = torch.zeros_like(ZZ)
        if isinstance(cell, FCCell):
            if on(cell.W.weight):
                inner += ZZ
            if on(cell.W.bias):
                inner += 1.0
        else:
            DZ = D @ z.T  # (i, j) -> d_i . z_j
            if on(cell.A):
                A = cell.A.to(f64)
                P, Q = z @ A.T, D @ A.T  # rows A z_i, A d_i
                K += (P @ P.T) * DD + (P @ Q.T) * DZ + (Q @ P.T) * DZ.T + (Q @ Q.T) * ZZ
            if on(cell.B):
                K += 2.0 * (DD * ZZ - DZ * DZ.T)
        K += DD * inner
        outer = torch.zeros_like(ZZ)
        if on(head.weight):
            outer += ZZ
        if on(head.bias):
            outer += 1.0
        K += (c @ c.T) * outer
    return K, st.info
