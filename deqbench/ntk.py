"""Empirical neural tangent kernel (NTK) of DEQs and explicit networks, and its spectrum.

``K_ij = <dF(x_i)/dtheta, dF(x_j)/dtheta>`` over *all* trainable parameters, for a scalar output
``F`` chosen from the model's outputs (``output``):

* ``"sum"`` (default): the sum over the output units (for a classifier, the sum of the logits);
* an ``int`` k: output unit (logit) k;
* ``"scalar"``: the model has one output;
* ``"full"``: every output unit separately; K is then (N*O) x (N*O), rows ordered sample-major
  (row ``i*O + o``). This is the kernel that governs squared-loss gradient descent on O-dim
  targets.

For a DEQ ``F(x) = c . readout(z*)``, ``z* = f(z*, inject(x))``, the per-sample gradient is
``(df/dtheta)^T w + d readout/dtheta`` with the adjoint ``w = J^T w + d F/dz*`` (J = df/dz at z*),
so K equals the NTK of the one-step surrogate (REFERENCE.md section 8.1)::

    s_i(theta) = <w_i, f(z*_i, inject(x_i; theta); theta)> + c_i . readout(z*_i; theta)

with z* and w held fixed. The default ``method="batched"`` therefore does one batched forward
solve and one batched adjoint solve for all probes, then per-sample gradients of ``s`` with
``torch.func.vmap(grad(...))``, block by block over parameter tensors (a tensor too large for
the block budget is sliced), accumulating ``K += G_b G_b^T`` in float64 so the full N x P
Jacobian never exists. ``method="naive"`` loops over probes and differentiates the model
itself (its configured backward mode); ``method="gram"`` never forms a Jacobian and uses the
closed-form Gram expression of ``fc_deq``-type models (``z = act(W z + U x + b)``, linear head).
Models without DEQ layers (MLP, ``tied_repeat``) get the plain per-sample NTK.

Numerics (REFERENCE.md section 8.3): TF32 is switched off inside (and restored), K is
accumulated and diagonalised in float64, and :func:`ntk_summary` reports a rounding-noise floor
``c * eps * N * lambda_max`` next to lambda_min; a lambda_min below it is reported as unresolved
(NaN, condition = inf), never as a (possibly negative) number.

Example:
    >>> import torch, deqbench
    >>> from deqbench.ntk import empirical_ntk, ntk_summary
    >>> model = deqbench.models.create("fc_deq_tiny", in_shape=(64,)).double()
    >>> X = torch.randn(16, 64, dtype=torch.float64)
    >>> K = empirical_ntk(model, X, output="sum")          # (16, 16) float64
    >>> s = ntk_summary(K)                                  # doctest: +SKIP
    >>> s["lambda_min"], s["condition"], s["resolved"]     # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from .deq import DEQLayer, deq_layers
from .ntk_engine import (
    NTKState,
    _cotangents,
    contract,
    default_block_bytes,
    jacobian_blocks,
    prepare,
    standard_deq,
)

METHODS = ("batched", "naive", "gram")
OUTPUT_KINDS = ("sum", "scalar", "full")

__all__ = [
    "empirical_ntk",
    "ntk_summary",
    "ntk_budget",
    "naive_ntk",
    "gram_ntk",
    "prepare",
    "jacobian_blocks",
    "contract",
    "default_block_bytes",
    "standard_deq",
    "NTKState",
    "METHODS",
    "OUTPUT_KINDS",
]


def gram_ntk(*args: Any, **kwargs: Any) -> tuple[Tensor, dict[str, Any]]:
    """Closed-form K of fc_deq / mondeq_fc models (:mod:`deqbench.ntk_gram`)."""
    from .ntk_gram import gram_ntk as _g

    return _g(*args, **kwargs)


# -- public API --------------------------------------------------------------------------------


def empirical_ntk(
    model: nn.Module,
    inputs: Tensor,
    *,
    output: str | int = "sum",
    chunk_size: int | None = None,
    method: str = "batched",
    tol: float | None = None,
    max_iter: int | None = None,
    block_bytes: int | None = None,
    adjoint: str = "auto",
    return_info: bool = False,
) -> Tensor | tuple[Tensor, dict[str, Any]]:
    """Empirical NTK of ``model`` on the probe batch ``inputs``.

    Args:
        model: a DEQ (:class:`~deqbench.deq.DEQModel` with one equilibrium layer) or any
            ``nn.Module`` mapping a batch to (B, O) outputs without cross-sample operations
            (the model is put in eval mode during the computation, so BatchNorm uses its running
            statistics; the mode is restored).
        inputs: (N, ...) probe inputs, on the model's device and dtype.
        output: ``"sum"`` | ``int`` logit index | ``"scalar"`` | ``"full"`` (module docstring).
        chunk_size: ``vmap`` chunk size for the per-sample gradients (None: all rows at once).
        method: ``"batched"`` (default), ``"naive"`` (one backward per probe through the model,
            a reference) or ``"gram"`` (closed form; ``fc_deq``-type models only).
        tol: forward and adjoint solver tolerance for DEQs (None: 1e-10 in float64, 1e-6 in
            float32, not the model's training tolerance: the lambda_min error is about
            tol * cond / (1 - L)); see :func:`ntk_budget`.
        max_iter: forward and adjoint iteration budget (None: the largest configured one, at
            least 1000).
        block_bytes: memory budget of one per-sample gradient block (float64 copy included);
            default 256 MiB on CPU, a quarter of the free memory (<= 8 GiB) on CUDA.
        adjoint: how the batched adjoint (I - J^T) w = g is solved: "solver" (the layer's
            backward solver, as in training), "direct" (per-sample Jacobians, one batched LU
            solve; exact up to rounding) or "auto" (direct when N d^3, d the state size
            per sample, is at most 2e10 on CUDA or 3e8 on CPU; else the solver).
        return_info: also return a dict with solver statistics, timings, row layout and
            ``eps`` (the machine epsilon of the per-sample gradients, for :func:`ntk_summary`).

    Returns:
        K, an (R, R) float64 tensor on the inputs' device (R = N, or N*O for ``"full"``);
        with ``return_info``, ``(K, info)``.

    Example:
        >>> K = empirical_ntk(model, X, output=3, method="batched")   # doctest: +SKIP
    """
    from .errors import ConfigError

    if method not in METHODS:
        raise ConfigError(
            f"ntk.method: unknown method '{method}'; choose from {', '.join(METHODS)}"
        )
    if inputs.dim() < 2 or inputs.shape[0] < 1:
        raise ConfigError(
            f"ntk: inputs must be a batch (N, ...) with N >= 1 probes, got shape "
            f"{tuple(inputs.shape)}"
        )
    tol, max_iter = ntk_budget(model, inputs.dtype, tol, max_iter)
    t0 = time.perf_counter()
    with _numerics(), _eval_mode(model):
        if method == "naive":
            K, info = naive_ntk(model, inputs, output, tol, max_iter)
        elif method == "gram":
            K, info = gram_ntk(model, inputs, output, tol, max_iter)
        else:
            st = prepare(model, inputs, output=output, tol=tol, max_iter=max_iter, adjoint=adjoint)
            try:
                K = contract(
                    jacobian_blocks(st, chunk_size=chunk_size, block_bytes=block_bytes), st.rows
                )
                info = st.info
            except RuntimeError as exc:
                # A custom-forward model whose forward has side effects that torch.func cannot
                # trace (e.g. reading data_ptr() of a parameter): per-probe reference instead.
                if st.surrogate.mode != "layers" or "out of memory" in str(exc).lower():
                    raise
                import warnings

                why = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    f"ntk: batched engine failed on {type(model).__name__} ({why}); "
                    "using method='naive'",
                    RuntimeWarning,
                    stacklevel=2,
                )
                K, info = naive_ntk(model, inputs, output, tol, max_iter)
                info["fallback"] = f"naive ({why[:160]})"
    info["method"] = method
    info["time_s"] = time.perf_counter() - t0
    return (K, info) if return_info else K


def ntk_budget(
    model: nn.Module, dtype: torch.dtype, tol: float | None, max_iter: int | None
) -> tuple[float | None, int | None]:
    """Solver tolerance and budget of the NTK's solves for a DEQ (unchanged for other models).

    ``tol`` None: 1e-10 in float64, 1e-6 in float32, unless the model is configured tighter
    (then its own tolerances and budgets are kept: None, ``max_iter``). The lambda_min error is
    about tol * cond / (1 - L) (REFERENCE 8.3), so a training tolerance is far too loose. When
    the tolerance is tighter than the configured ones and ``max_iter`` is None, the budget is
    the largest configured one, at least 1000."""
    layers = list(deq_layers(model))
    if not layers:
        return tol, max_iter
    cfgs = [c for lay in layers for c in (lay.solver_cfg, lay.backward_cfg)]
    configured = min(float(c.tol) for c in cfgs)
    if tol is None:
        default = 1e-10 if dtype == torch.float64 else 1e-6
        if configured <= default:
            return None, max_iter
        tol = default
    if max_iter is None and tol < configured:
        max_iter = max([1000] + [int(c.max_iter) for c in cfgs])
    return tol, max_iter


def ntk_summary(K: Tensor, *, eps: float | None = None, c: float = 1.0) -> dict[str, Any]:
    """Spectrum summary of an NTK matrix, computed in float64 on ``(K + K^T)/2``.

    Args:
        K: (N, N) kernel matrix.
        eps: machine epsilon of the arithmetic that produced K's entries (default float64's;
            pass ``torch.finfo(torch.float32).eps`` for float32 per-sample gradients, or use
            ``info["eps"]`` from :func:`empirical_ntk`).
        c: safety constant of the noise floor.

    Returns:
        dict with ``lambda_min`` (NaN when unresolved), ``lambda_max``, ``condition``
        (lambda_max / lambda_min; inf when unresolved), ``trace``, ``trace_per_n``,
        ``noise_floor`` (``c * eps * N * lambda_max``), ``resolved`` (lambda_min > floor) and ``n``.

    Example:
        >>> ntk_summary(torch.eye(3))["condition"]
        1.0
    """
    from .errors import ConfigError

    if K.dim() != 2 or K.shape[0] != K.shape[1]:
        raise ConfigError(f"ntk_summary: K must be a square (N, N) matrix, got {tuple(K.shape)}")
    K64 = K.detach().to(torch.float64)
    K64 = 0.5 * (K64 + K64.T)
    n = int(K64.shape[0])
    if n == 0:
        raise ConfigError("ntk_summary: empty kernel")
    lmin = lmax = math.nan  # a non-finite K (e.g. a diverged solve): nothing is resolved
    if bool(torch.isfinite(K64).all()):
        with _numerics():
            ev = torch.linalg.eigvalsh(K64)
        lmin, lmax = float(ev[0]), float(ev[-1])
    eps = float(torch.finfo(torch.float64).eps) if eps is None else float(eps)
    floor = c * eps * n * max(abs(lmax), 0.0)
    finite = math.isfinite(lmin) and math.isfinite(lmax)
    resolved = finite and lmin > floor
    trace = float(torch.diagonal(K64).sum())
    return {
        "lambda_min": lmin if resolved else math.nan,
        "lambda_max": lmax,
        "condition": lmax / lmin if resolved else math.inf,
        "trace": trace,
        "trace_per_n": trace / n,
        "noise_floor": floor,
        "resolved": bool(resolved),
        "n": n,
    }


# -- numerics guards ----------------------------------------------------------------------------


@contextmanager
def _numerics() -> Iterator[None]:
    """TF32 off (matmul and cuDNN) and 'highest' float32 matmul precision; restored after
    (the precision here, the flags by :func:`~deqbench.measure.numeric_flags`)."""
    from .measure import numeric_flags

    prev = torch.get_float32_matmul_precision()  # read before the legacy flags are set
    with numeric_flags(tf32=False):
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(prev)


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


@contextmanager
def _tolerances(layers: list[DEQLayer], tol: float | None, max_iter: int | None) -> Iterator[None]:
    """Temporarily override the forward/adjoint tolerance and budget of ``layers``."""
    saved = [(lay.solver_cfg, lay.backward_cfg) for lay in layers]
    try:
        for lay in layers:
            s, b = lay.solver_cfg, lay.backward_cfg
            if tol is not None:
                s, b = replace(s, tol=tol), replace(b, tol=tol)
            if max_iter is not None:
                s, b = replace(s, max_iter=max_iter), replace(b, max_iter=max_iter)
            lay.solver_cfg, lay.backward_cfg = s, b
        yield
    finally:
        for lay, (s, b) in zip(layers, saved):
            lay.solver_cfg, lay.backward_cfg = s, b


# -- naive reference -------------------------------------------------------------------------------


def naive_ntk(
    model: nn.Module, X: Tensor, output: str | int, tol: float | None, max_iter: int | None
) -> tuple[Tensor, dict[str, Any]]:
    """Reference K: one forward and one backward per probe through the model itself, with its
    configured backward mode (IFT, unrolled, ...); K = J J^T in float64."""
    params = [p for p in model.parameters() if p.requires_grad]
    n = X.shape[0]
    rows: list[Tensor] = []
    with _tolerances(list(deq_layers(model)), tol, max_iter), torch.enable_grad():
        idx = C = None
        for i in range(n):
            out = model(X[i : i + 1]).reshape(-1)
            if C is None:
                idx, C = _cotangents(output, n, out.numel(), out)
            sel = (idx == i).nonzero().flatten().tolist()
            for k, r in enumerate(sel):
                F = (out * C[r]).sum()
                gs = torch.autograd.grad(
                    F, params, retain_graph=k < len(sel) - 1, allow_unused=True
                )
                rows.append(
                    torch.cat(
                        [
                            (g if g is not None else torch.zeros_like(p))
                            .reshape(-1)
                            .to(torch.float64)
                            for g, p in zip(gs, params)
                        ]
                    )
                )
    J = torch.stack(rows)
    info = {"rows": len(rows), "eps": float(torch.finfo(X.dtype).eps)}
    return J @ J.T, info
