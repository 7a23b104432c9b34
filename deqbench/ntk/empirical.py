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
so K equals the NTK of the one-step surrogate::

    s_i(theta) = <w_i, f(z*_i, inject(x_i; theta); theta)> + c_i . readout(z*_i; theta)

with z* and w held fixed. The default ``method="batched"`` therefore does one batched forward
solve and one batched adjoint solve for all probes, then per-sample gradients of ``s`` with
``torch.func.vmap(grad(...))``, block by block over parameter tensors (a tensor too large for
the block budget is sliced), accumulating ``K += G_b G_b^T`` in float64 so the full N x P
Jacobian never exists. ``method="naive"`` loops over probes and differentiates the model
itself (its configured backward mode); ``method="gram"`` never forms a Jacobian and uses the
closed-form Gram expression of ``fc_deq``-type models (``z = act(W z + U x + b)``, linear head).
Models without DEQ layers (MLP, ``tied_repeat``) get the plain per-sample NTK.

Numerics: TF32 is switched off inside (and restored), K is
accumulated and diagonalised in float64, and :func:`ntk_summary` reports a rounding-noise floor
next to lambda_min (K's float64 rounding plus that of the per-sample gradients); a lambda_min
at or below it is reported as K singular to working precision (lambda_min clamped to [0, floor],
``resolved`` False, condition = inf, ``condition_lower_bound`` = lambda_max / floor), never as
a negative number or NaN.

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

from ..core.deq import DEQLayer, deq_layers
from .engine import (
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
    "reference_converged",
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
    """Closed-form K of fc_deq / mondeq_fc models (:mod:`deqbench.ntk.gram`)."""
    from .gram import gram_ntk as _g

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
            a reference; a plain fixed-point IFT adjoint is solved by Anderson there, see
            :func:`naive_ntk`) or ``"gram"`` (closed form; ``fc_deq``-type models only).
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
    from ..core.errors import ConfigError

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
    info["tol"], info["max_iter"] = tol, max_iter  # None: the model's own (tighter) settings
    info["time_s"] = time.perf_counter() - t0
    return (K, info) if return_info else K


def ntk_budget(
    model: nn.Module, dtype: torch.dtype, tol: float | None, max_iter: int | None
) -> tuple[float | None, int | None]:
    """Solver tolerance and budget of the NTK's solves for a DEQ (unchanged for other models).

    ``tol`` None: 1e-10 in float64, 1e-6 in float32, unless the model is configured tighter
    (then its own tolerances and budgets are kept: None, ``max_iter``). The lambda_min error is
    about tol * cond / (1 - L), so a training tolerance is far too loose. When
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

    Noise floor: the smallest eigenvalue a computed K can tell
    apart from 0, ``floor = c * (eps_K * N * lambda_max + (10 * eps)^2 * trace)``:

    * ``eps_K * N * lambda_max``: rounding of K's own arithmetic (contraction and eigvalsh);
      eps_K is the machine epsilon of ``K.dtype``, float64 for every K of
      :func:`empirical_ntk`, which accumulates K in float64 whatever the gradients' dtype;
    * ``(10 * eps)^2 * trace``: rounding of the per-sample gradients J (K = J J^T). Their
      relative error ``delta ~ 10 eps`` moves each singular value of J by at most
      ``||dJ||_2 <= delta ||J||_F = delta sqrt(trace)``, so a lambda_min = sigma_min^2 of a
      singular J shows up as at most ``delta^2 * trace``. With float32 gradients and a float64
      K this is about 1e-12 * trace, far below ``eps32 * N * lambda_max`` (the floor of a K
      formed in float32, which the old summary applied to every float32 model and which,
      at N = 2048, declared a lambda_min accurate to 1e-9 unresolved).

    A lambda_min at or below the floor is reported as what it is, K singular to working
    precision: ``lambda_min`` is the computed eigenvalue clamped at 0 (never the negative
    rounding value, never NaN), ``resolved`` False, ``status`` "singular", ``condition``
    inf, and ``condition_lower_bound = lambda_max / floor`` (what the condition is at least).
    Only a non-finite K (e.g. a diverged solve) gives NaN (``status`` "non-finite").

    Args:
        K: (N, N) kernel matrix, in the dtype it was accumulated in.
        eps: machine epsilon of the per-sample gradients that K was contracted from
            (``info["eps"]`` of :func:`empirical_ntk`; default: that of ``K.dtype``).
        c: safety constant of the noise floor.

    Returns:
        dict with ``lambda_min`` (>= 0; 0 up to the floor when singular; NaN only when K is
        non-finite), ``lambda_max``, ``condition`` (lambda_max / lambda_min; inf when
        singular), ``condition_lower_bound``, ``trace``, ``trace_per_n``, ``noise_floor``,
        ``resolved`` (lambda_min > floor), ``status`` ("resolved" | "singular" |
        "non-finite"), ``note`` (one line for a report; "" when resolved) and ``n``.

    Example:
        >>> ntk_summary(torch.eye(3))["condition"]
        1.0
    """
    from ..core.errors import ConfigError

    if K.dim() != 2 or K.shape[0] != K.shape[1]:
        raise ConfigError(f"ntk_summary: K must be a square (N, N) matrix, got {tuple(K.shape)}")
    eps_k = float(torch.finfo(K.dtype).eps) if K.dtype.is_floating_point else 0.0
    K64 = K.detach().to(torch.float64)
    K64 = 0.5 * (K64 + K64.T)
    n = int(K64.shape[0])
    if n == 0:
        raise ConfigError("ntk_summary: empty kernel")
    eps_k = max(eps_k, float(torch.finfo(torch.float64).eps))
    eps = eps_k if eps is None else float(eps)
    trace = float(torch.diagonal(K64).sum())
    out: dict[str, Any] = {"trace": trace, "trace_per_n": trace / n, "n": n}
    if not bool(torch.isfinite(K64).all()):  # e.g. a diverged solve: nothing is known
        bad = int((~torch.isfinite(K64)).sum())
        out.update(
            lambda_min=math.nan,
            lambda_max=math.nan,
            condition=math.nan,
            condition_lower_bound=math.nan,
            noise_floor=math.nan,
            resolved=False,
            status="non-finite",
            note=f"K has {bad} non-finite entries (a diverged solve or overflow)",
        )
        return out
    with _numerics():
        ev = torch.linalg.eigvalsh(K64)
    lmin, lmax = float(ev[0]), float(ev[-1])
    floor = c * (eps_k * n * max(lmax, 0.0) + (10.0 * eps) ** 2 * max(trace, 0.0))
    resolved = lmin > floor
    if resolved:
        cond = bound = lmax / lmin
    else:  # singular to working precision: the condition is at least lambda_max / floor
        cond, bound = math.inf, (lmax / floor if floor > 0 else math.inf)
    out.update(
        lambda_min=lmin if resolved else max(lmin, 0.0),
        lambda_max=lmax,
        condition=cond,
        condition_lower_bound=bound,
        noise_floor=floor,
        resolved=bool(resolved),
        status="resolved" if resolved else "singular",
        note=""
        if resolved
        else (
            f"K singular to working precision: lambda_min {max(lmin, 0.0):.3g} <= noise floor "
            f"{floor:.3g} (lambda_max {lmax:.3g}, N {n}; duplicated probes, N > P or "
            "cond > 1/eps)"
        ),
    )
    return out


# -- numerics guards ----------------------------------------------------------------------------


@contextmanager
def _numerics() -> Iterator[None]:
    """TF32 off (matmul and cuDNN) and 'highest' float32 matmul precision; restored after
    (the precision here, the flags by :func:`~deqbench.performance.measure.numeric_flags`)."""
    from ..performance.measure import numeric_flags

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


# Adjoint solvers a reference may keep: Anderson and Broyden solve the linear adjoint system
# whatever the spectral radius of J (a plain fixed-point iteration diverges once it exceeds 1);
# structured solvers (monDEQ splitting) are the family's own convergent method.
_ROBUST_ADJOINT = ("anderson", "broyden")


def _robust_backward(b: Any) -> Any:
    """The reference's adjoint: a plain iterative ``ift`` adjoint solver becomes Anderson (its
    common options kept); other modes, Anderson/Broyden and structured solvers are kept."""
    from .. import solvers
    from ..solvers.base import COMMON_OPTIONS

    if b.name != "ift" or b.solver in _ROBUST_ADJOINT:
        return b
    if getattr(solvers.get(b.solver), "needs_structure", False):
        return b
    opts = {k: v for k, v in b.options.items() if k in COMMON_OPTIONS}
    return replace(b, solver="anderson", options=opts)


@contextmanager
def _tolerances(
    layers: list[DEQLayer], tol: float | None, max_iter: int | None, robust: bool = False
) -> Iterator[None]:
    """Temporarily override the forward/adjoint tolerance and budget of ``layers`` (and, with
    ``robust``, a plain iterative adjoint solver by Anderson: :func:`_robust_backward`)."""
    saved = [(lay.solver_cfg, lay.backward_cfg) for lay in layers]
    try:
        for lay in layers:
            s, b = lay.solver_cfg, lay.backward_cfg
            if tol is not None:
                s, b = replace(s, tol=tol), replace(b, tol=tol)
            if max_iter is not None:
                s, b = replace(s, max_iter=max_iter), replace(b, max_iter=max_iter)
            if robust:
                b = _robust_backward(b)
            lay.solver_cfg, lay.backward_cfg = s, b
        yield
    finally:
        for lay, (s, b) in zip(layers, saved):
            lay.solver_cfg, lay.backward_cfg = s, b


# -- naive reference -------------------------------------------------------------------------------


def naive_ntk(
    model: nn.Module,
    X: Tensor,
    output: str | int,
    tol: float | None,
    max_iter: int | None,
    *,
    robust: bool = True,
) -> tuple[Tensor, dict[str, Any]]:
    """Reference K: one forward and one backward per probe through the model itself, with its
    configured backward mode (IFT, unrolled, ...); K = J J^T in float64.

    As a reference it must be solved to its tolerance: with ``robust`` (default) an ``ift``
    adjoint solved by plain iteration (which diverges once the spectral radius of J exceeds 1)
    is solved by Anderson instead (Anderson/Broyden and structured solvers are kept). Every
    probe's forward and adjoint statistics are checked: ``info`` holds ``forward_converged``
    / ``adjoint_converged`` (1.0 only if every probe's solve met the tolerance), the largest
    relative residuals and the summed steps, like the batched engine's. A caller using K as a
    reference must check them (:func:`reference_converged`). ``robust=False`` keeps the
    configured adjoint solver (e.g. to time the naive loop with the same solver as the batched
    path)."""
    params = [p for p in model.parameters() if p.requires_grad]
    layers = list(deq_layers(model))
    n = X.shape[0]
    rows: list[Tensor] = []
    fstats: list[Any] = []
    bstats: list[Any] = []
    adjoint_solver = ""
    with _tolerances(layers, tol, max_iter, robust), torch.enable_grad():
        if layers and layers[0].backward_cfg.name == "ift":
            adjoint_solver = layers[0].backward_cfg.solver
        idx = C = None
        for i in range(n):
            for lay in layers:
                lay.last_forward_stats = lay.last_backward_stats = None
            out = model(X[i : i + 1]).reshape(-1)
            fstats += [lay.last_forward_stats for lay in layers]
            if C is None:
                idx, C = _cotangents(output, n, out.numel(), out)
            assert idx is not None  # set at i == 0
            sel = (idx == i).nonzero().flatten().tolist()
            for k, r in enumerate(sel):
                F = (out * C[r]).sum()
                gs = torch.autograd.grad(
                    F, params, retain_graph=k < len(sel) - 1, allow_unused=True
                )
                bstats += [lay.last_backward_stats for lay in layers]
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
    info: dict[str, Any] = {"rows": len(rows), "eps": float(torch.finfo(X.dtype).eps)}
    from .engine import _stats_info

    info.update(_stats_info("forward", fstats))
    info.update(_stats_info("adjoint", bstats))
    if adjoint_solver:
        info["adjoint_solver"] = adjoint_solver
    return J @ J.T, info


def reference_converged(info: dict[str, Any]) -> tuple[bool, str]:
    """Whether the solves behind a K met their tolerance (``info`` of :func:`empirical_ntk`),
    and if not, a one-line reason. Models without DEQ layers (no solves) always pass."""
    bad = [
        f"{k} solve not converged (rel residual {info.get(f'{k}_rel_residual', math.nan):.3g})"
        for k in ("forward", "adjoint")
        if info.get(f"{k}_converged", 1.0) != 1.0
    ]
    return (not bad), "; ".join(bad)
