"""Spectral tools: layer norms, the cell Jacobian at the fixed point,
and a Lipschitz bound.

Layers
    * dense: exact largest singular value (:func:`dense_norm`) and power iteration
      (:func:`dense_power_norm`);
    * convolutions: the exact spectral norm of the *circular* convolution operator on an n x n
      input by the FFT method of Sedghi, Gupta and Long (2018) (:func:`conv_spectral_norm`),
      an upper bound for zero padding; power iteration on ``v -> conv^T(conv(v))`` of the actual
      (zero-padded) operator (:func:`conv_power_norm`); explicit dense operator matrices for
      checks (:func:`conv_matrix`).

Jacobian of a cell f(z, u) at z* (per sample, batched over dim 0; the cell must not mix samples)
    * :func:`jacobian_spectral_radius`: power iteration with VJPs (or JVPs), refined by a short
      Arnoldi (Rayleigh-Ritz) so complex dominant pairs are resolved;
    * :func:`jacobian_spectral_norm`: power iteration on J^T J (JVP then VJP);
    * :func:`jacobian_frobenius`: Hutchinson estimate sqrt(mean_v ||v^T J||^2), v ~ N(0, I).

Other
    * :func:`lipschitz_upper_bound`: product of the layer norms of a cell (times sup|sigma'|
      where the cell knows it); cells may provide ``lipschitz_bound()`` themselves.
    * :func:`monotonicity_margin`: lambda_max((W + W^T)/2) by ``eigvalsh`` (monDEQ condition
      lambda_max <= 1 - m).

Example:
    >>> import torch
    >>> from deqbench.spectral import conv_power_norm, conv_spectral_norm, spectral_norm
    >>> w = torch.randn(4, 3, 5, 5)
    >>> s = conv_spectral_norm(w, (16, 16))        # exact for circular padding
    >>> s >= conv_power_norm(w, (16, 16), padding=2) - 1e-6  # zero padding: FFT is an upper bound
    True
    >>> spectral_norm(torch.nn.Linear(8, 8))       # exact largest singular value of the weight
    ... # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..core.errors import ConfigError

# -- dense ---------------------------------------------------------------------------------


def dense_norm(W: Tensor) -> float:
    """Exact largest singular value of a matrix (float64)."""
    return float(torch.linalg.matrix_norm(W.detach().double(), ord=2))


def _gen(seed: int | None, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(0 if seed is None else int(seed))
    return g


def _lanczos_max(op: Callable[[Tensor], Tensor], v: Tensor, m: int) -> Tensor:
    """Largest Ritz value of a symmetric PSD batched operator after ``m`` Lanczos steps from
    ``v`` (B, ...) (full re-orthogonalisation; per sample). A lower bound of lambda_max that is
    at least the Rayleigh quotient of ``v``."""
    shape1 = (-1, *([1] * (v.dim() - 1)))
    B = v.shape[0]
    T = torch.zeros(B, m, m, dtype=v.dtype, device=v.device)
    Q = [v / _tiny(_bnorm(v)).view(shape1)]
    k = m
    for j in range(m):
        w = op(Q[j])
        for _rep in range(2):
            for i in range(j + 1):
                h = _bdot(Q[i], w)
                if _rep == 0 and i == j:
                    T[:, i, j] += h
                w = w - h.view(shape1) * Q[i]
        if j + 1 == m:
            break
        hn = _bnorm(w)
        scale = _tiny(T[:, j, j].abs())
        if bool((hn <= 1e-12 * scale).all()):
            k = j + 1
            break
        T[:, j + 1, j] = hn
        T[:, j, j + 1] = hn
        Q.append(w / _tiny(hn).view(shape1))
    Tk = T[:, :k, :k]
    Tk = 0.5 * (Tk + Tk.transpose(1, 2))
    return torch.linalg.eigvalsh(Tk)[:, -1].clamp_min(0)


def operator_power_norm(
    apply: Callable[[Tensor], Tensor],
    in_shape: tuple[int, ...],
    adjoint: Callable[[Tensor], Tensor] | None = None,
    *,
    iters: int = 100,
    tol: float = 1e-10,
    refine: int = 10,
    seed: int | None = 0,
    dtype: torch.dtype = torch.float64,
    device=None,
) -> float:
    """Largest singular value of a linear operator by power iteration on A^T A.

    Args:
        apply: v -> A v on tensors of shape ``in_shape`` (a batch dim of 1 included if needed).
        in_shape: shape of the operator's input.
        adjoint: u -> A^T u; default: a VJP of ``apply`` (exact for linear operators).
        iters: maximum power iterations; stops when the estimate changes by < ``tol``
            (relative).
        refine: Lanczos steps on A^T A from the power-iterated vector (0: none); they sharpen
            the estimate when the top singular values are close.

    Returns:
        sigma_max estimate, a lower bound that increases to the true value.
    """
    v = torch.randn(in_shape, generator=_gen(seed, device), dtype=dtype, device=device)
    v = v / v.norm()
    if adjoint is None:

        def adjoint(u: Tensor) -> Tensor:  # VJP of the linear map (at any point)
            with torch.enable_grad():
                x = torch.zeros_like(v, requires_grad=True)
                return torch.autograd.grad(apply(x), x, u)[0]

    def ata(x: Tensor) -> Tensor:
        return adjoint(apply(x))

    est = 0.0
    for _ in range(iters):
        w = ata(v)
        nw = float(w.norm())
        new = math.sqrt(max(float((w * v).sum()), 0.0))
        if nw == 0.0:
            return 0.0
        v = w / nw
        if abs(new - est) <= tol * max(new, 1e-300):
            est = new
            break
        est = new
    power = float(apply(v).norm())
    if refine <= 0:
        return power
    lam = float(_lanczos_max(lambda x: ata(x[0]).unsqueeze(0), v.unsqueeze(0), refine)[0])
    return max(power, math.sqrt(lam))


def dense_power_norm(W: Tensor, *, iters: int = 200, tol: float = 1e-12, seed: int = 0) -> float:
    """Largest singular value of a matrix by power iteration (float64)."""
    A = W.detach().double()
    return operator_power_norm(
        lambda v: A @ v,
        (A.shape[1],),
        lambda u: A.T @ u,
        iters=iters,
        tol=tol,
        seed=seed,
        device=A.device,
    )


# -- convolutions ----------------------------------------------------------------------------


def _hw(input_hw: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(input_hw, int):
        return (input_hw, input_hw)
    t = tuple(int(s) for s in input_hw)
    if len(t) != 2:
        raise ConfigError(f"input_hw must be n or (h, w); got {input_hw!r}")
    if min(t) < 1:
        raise ConfigError(f"input_hw must be positive sizes; got {input_hw!r}")
    return t  # type: ignore[return-value]


def _filters(weight: Tensor) -> Tensor:
    if not isinstance(weight, Tensor) or weight.dim() != 4:
        shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ConfigError(f"a conv weight must have shape (C_out, C_in, k1, k2); got {shape}")
    return weight.detach()


def conv_spectral_norm(weight: Tensor, input_hw: int | tuple[int, int]) -> float:
    """Exact spectral norm of the circular 2-D convolution (stride 1) with ``weight``.

    Sedghi, Gupta & Long (2018): zero-pad the taps to n1 x n2 (taps beyond the input size wrap
    around and add), take the 2-D FFT over the tap axes, and return the largest singular value
    of the C_out x C_in matrices over all frequencies. For zero-padded convolutions this is an
    upper bound, and so it is for a strided convolution (a subsampling of the stride-1 output:
    ||S C|| <= ||C||).

    Args:
        weight: (C_out, C_in, k1, k2) filter bank.
        input_hw: (n1, n2) input size (or n for n x n).

    Example:
        >>> import torch
        >>> conv_spectral_norm(torch.ones(1, 1, 3, 3), (8, 8))   # DC gain of a 3x3 box filter
        9.0
    """
    n1, n2 = _hw(input_hw)
    w = _filters(weight).double()
    k1, k2 = w.shape[-2:]
    if k1 > n1 or k2 > n2:  # fold taps modulo n (circular wrap-around)
        f = torch.zeros(*w.shape[:2], n1, n2, dtype=w.dtype, device=w.device)
        for a in range(k1):
            for b in range(k2):
                f[..., a % n1, b % n2] += w[..., a, b]
        w = f
    # real taps: K(-u, -v) = conj(K(u, v)) has the same singular values, so the half spectrum
    # of rfft2 covers every frequency
    spec = torch.fft.rfft2(w, s=(n1, n2))  # (C_out, C_in, n1, n2 // 2 + 1)
    mats = spec.permute(2, 3, 0, 1)
    return float(torch.linalg.svdvals(mats)[..., 0].max())


def conv_norm_fft(weight: Tensor, input_size: int | tuple[int, int]) -> float:
    """Alias of :func:`conv_spectral_norm` (kept for the earlier API)."""
    return conv_spectral_norm(weight, input_size)


def _pad_int(padding, k: tuple[int, int]) -> tuple[int, int]:
    if padding == "same":
        return (k[0] // 2, k[1] // 2)
    if padding == "valid":
        return (0, 0)
    if isinstance(padding, int):
        return (padding, padding)
    return (int(padding[0]), int(padding[1]))


def conv_operator(
    weight: Tensor, *, padding=None, padding_mode: str = "zeros", stride=1, dilation=1
) -> Callable[[Tensor], Tensor]:
    """v -> conv(v) (bias-free) as a function on (B, C_in, H, W) tensors."""
    k = tuple(weight.shape[-2:])
    p = _pad_int("same" if padding is None else padding, k)  # type: ignore[arg-type]
    w = weight.detach()
    if padding_mode == "zeros":
        return lambda v: nn.functional.conv2d(
            v, w.to(v.dtype), stride=stride, padding=p, dilation=dilation
        )
    mode = {"circular": "circular", "reflect": "reflect", "replicate": "replicate"}.get(
        padding_mode
    )
    if mode is None:
        raise ConfigError(f"unknown padding_mode '{padding_mode}'")
    return lambda v: nn.functional.conv2d(
        nn.functional.pad(v, (p[1], p[1], p[0], p[0]), mode=mode),
        w.to(v.dtype),
        stride=stride,
        dilation=dilation,
    )


def conv_power_norm(
    weight: Tensor,
    input_hw: int | tuple[int, int],
    *,
    padding=None,
    padding_mode: str = "zeros",
    stride=1,
    dilation=1,
    iters: int = 200,
    tol: float = 1e-10,
    seed: int = 0,
) -> float:
    """Spectral norm of the convolution operator as applied (default: zero padding k//2) by
    power iteration on ``v -> conv^T(conv(v))``; the transpose is ``conv_transpose2d`` at the
    same padding (zero padding, stride 1) or a VJP otherwise. float64."""
    n1, n2 = _hw(input_hw)
    w = weight.detach().double()
    k = tuple(w.shape[-2:])
    p = _pad_int("same" if padding is None else padding, k)  # type: ignore[arg-type]
    apply = conv_operator(w, padding=p, padding_mode=padding_mode, stride=stride, dilation=dilation)
    adjoint = None
    if padding_mode == "zeros" and nn.modules.utils._pair(stride) == (1, 1):

        def adjoint(u: Tensor) -> Tensor:
            return nn.functional.conv_transpose2d(u, w, padding=p, dilation=dilation)

    return operator_power_norm(
        apply, (1, w.shape[1], n1, n2), adjoint, iters=iters, tol=tol, seed=seed, device=w.device
    )


def conv_matrix(
    weight: Tensor,
    input_hw: int | tuple[int, int],
    *,
    padding=None,
    padding_mode: str = "zeros",
    stride=1,
    dilation=1,
) -> Tensor:
    """The dense matrix of the convolution operator, built by applying it to the basis vectors
    (float64; rows = flattened outputs, columns = flattened inputs). For checks on small sizes."""
    n1, n2 = _hw(input_hw)
    w = weight.detach().double()
    c_in = w.shape[1]
    N = c_in * n1 * n2
    eye = torch.eye(N, dtype=w.dtype, device=w.device).view(N, c_in, n1, n2)
    out = conv_operator(
        w, padding=padding, padding_mode=padding_mode, stride=stride, dilation=dilation
    )(eye)
    return out.reshape(N, -1).T.contiguous()


# -- any layer -------------------------------------------------------------------------------


def spectral_norm(
    matrix_or_module: Tensor | nn.Module,
    input_hw: int | tuple[int, int] | None = None,
    *,
    method: str = "exact",
    iters: int = 200,
    seed: int = 0,
) -> float:
    """Spectral norm of a matrix, an ``nn.Linear`` or an ``nn.Conv2d``.

    Args:
        matrix_or_module: 2-D tensor, Linear, Conv2d, or a 4-D filter bank.
        input_hw: input size for convolutions (required for them).
        method: ``exact`` (dense: SVD; conv: Sedghi FFT of the stride-1 circular convolution,
            exact for circular padding and stride 1, an upper bound for zero padding or a
            stride > 1) or ``power`` (power iteration of the operator as applied, i.e. with the
            module's padding and stride).

    Example:
        >>> import torch
        >>> spectral_norm(torch.diag(torch.tensor([3.0, -5.0])))
        5.0
    """
    obj = matrix_or_module
    if isinstance(obj, nn.Linear):
        obj = obj.weight
    if method not in ("exact", "power"):
        raise ConfigError(f"spectral_norm: method must be 'exact' or 'power', got {method!r}")
    if isinstance(obj, nn.Conv2d):
        if input_hw is None:
            raise ConfigError("spectral_norm of a Conv2d needs input_hw=(h, w)")
        if method == "exact":
            return conv_spectral_norm(obj.weight, input_hw)
        return conv_power_norm(
            obj.weight,
            input_hw,
            padding=obj.padding,
            padding_mode=obj.padding_mode,
            stride=obj.stride,
            dilation=obj.dilation,
            iters=iters,
            seed=seed,
        )
    if isinstance(obj, Tensor):
        if obj.dim() == 2:
            return (
                dense_norm(obj)
                if method == "exact"
                else dense_power_norm(obj, iters=iters, seed=seed)
            )
        if obj.dim() == 4:
            if input_hw is None:
                raise ConfigError("spectral_norm of a 4-D filter bank needs input_hw=(h, w)")
            if method == "exact":
                return conv_spectral_norm(obj, input_hw)
            return conv_power_norm(obj, input_hw, iters=iters, seed=seed)
        return dense_norm(obj.reshape(obj.shape[0], -1))
    raise ConfigError(f"spectral_norm: cannot handle {type(obj).__name__}")


def operator_norm(weight: Tensor, input_size: int | tuple[int, int] = 32) -> float:
    """Spectral norm of a dense (2-D) or conv (4-D, exact circular) weight; other shapes are
    flattened to (out, -1)."""
    if weight.dim() == 2:
        return dense_norm(weight)
    if weight.dim() == 4:
        return conv_spectral_norm(weight, input_size)
    return dense_norm(weight.reshape(weight.shape[0], -1))


def monotonicity_margin(W: Tensor) -> float:
    """lambda_max((W + W^T)/2) of a square matrix, by ``eigvalsh`` (not power iteration, which
    returns the eigenvalue of largest magnitude)."""
    A = W.detach().double()
    return float(torch.linalg.eigvalsh(0.5 * (A + A.T)).max())


# -- the cell Jacobian at the fixed point ----------------------------------------------------


def _bdot(a: Tensor, b: Tensor) -> Tensor:
    return (a.reshape(a.shape[0], -1) * b.reshape(b.shape[0], -1)).sum(1)


def _tiny(x: Tensor) -> Tensor:
    """``x`` clamped away from 0 by the dtype's smallest normal number (1e-300 is 0 in float32)."""
    return x.clamp_min(torch.finfo(x.dtype).tiny)


def _bnorm(a: Tensor) -> Tensor:
    return torch.linalg.vector_norm(a.reshape(a.shape[0], -1), dim=1)


class _Linearised:
    """J v and J^T w of ``z -> cell(z, u)`` at z*, from one recorded graph (plain autograd:
    VJPs by backward, JVPs by the double-backward trick d/dw <J^T w, v> = J v)."""

    def __init__(self, cell: Callable[..., Tensor], z_star: Tensor, u: Tensor) -> None:
        with torch.enable_grad():
            self.z = z_star.detach().requires_grad_(True)
            self.out = cell(self.z, u.detach())
            self.w = torch.zeros_like(self.out, requires_grad=True)
            self.g: Tensor | None = None

    def vjp(self, w: Tensor) -> Tensor:
        with torch.enable_grad():
            (r,) = torch.autograd.grad(self.out, self.z, w, retain_graph=True, allow_unused=True)
        return torch.zeros_like(self.z) if r is None else r.detach()

    def jvp(self, v: Tensor) -> Tensor:
        with torch.enable_grad():
            if self.g is None:
                (self.g,) = torch.autograd.grad(
                    self.out, self.z, self.w, create_graph=True, allow_unused=True
                )
                if self.g is None or not self.g.requires_grad:  # f does not depend on z
                    return torch.zeros_like(self.out)
            (r,) = torch.autograd.grad(self.g, self.w, v, retain_graph=True, allow_unused=True)
        return torch.zeros_like(self.out) if r is None else r.detach()


def _vjp_fn(cell, z_star: Tensor, u: Tensor):
    return _Linearised(cell, z_star, u).vjp


def _jvp_fn(cell, z_star: Tensor, u: Tensor):
    return _Linearised(cell, z_star, u).jvp


def jacobian_spectral_radius(
    cell: Callable[..., Tensor],
    z_star: Tensor,
    x: Tensor,
    *,
    iters: int = 100,
    arnoldi: int = 8,
    mode: str = "vjp",
    seed: int = 0,
) -> Tensor:
    """Per-sample spectral radius rho(J) of J = d cell(z, x)/dz at z = z_star.

    Power iteration (``iters`` VJPs, or JVPs with ``mode="jvp"``; J^T has the same
    eigenvalues) followed by ``arnoldi`` Arnoldi steps from the power-iterated vector; the
    estimate is the largest Ritz value modulus, so a dominant complex pair (where plain power
    iteration oscillates) is resolved. The cell must treat samples independently.

    Args:
        cell: callable ``cell(z, x)`` (a DEQ cell; ``x`` is its injection u).
        z_star: (B, ...) fixed point.
        x: the injection the cell takes.

    Returns:
        (B,) float tensor of estimates.

    Example:
        >>> import torch, deqbench
        >>> m = deqbench.models.create("fc_deq_tiny", in_shape=(8,))
        >>> z, u = m.equilibrium(torch.randn(4, 8))
        >>> rho = jacobian_spectral_radius(m.deq.cell, z, u)   # (4,)
    """
    if mode not in ("vjp", "jvp"):
        raise ConfigError(f"mode must be 'vjp' or 'jvp', got {mode!r}")
    op = _vjp_fn(cell, z_star, x) if mode == "vjp" else _jvp_fn(cell, z_star, x)
    g = _gen(seed, z_star.device)
    v = torch.randn(z_star.shape, generator=g, dtype=z_star.dtype, device=z_star.device)
    shape1 = (-1, *([1] * (v.dim() - 1)))
    v = v / _bnorm(v).view(shape1)
    power = torch.zeros(v.shape[0], dtype=v.dtype, device=v.device)
    for _ in range(iters):
        w = op(v)
        power = _bnorm(w)
        v = w / _tiny(power).view(shape1)
    if arnoldi <= 0:
        return power
    m = arnoldi
    B = v.shape[0]
    H = torch.zeros(B, m + 1, m, dtype=v.dtype, device=v.device)
    Q = [v]
    k_used = m
    for j in range(m):
        w = op(Q[j])
        for _rep in range(2):  # re-orthogonalise (Gram-Schmidt twice)
            for i in range(j + 1):
                h = _bdot(Q[i], w)
                H[:, i, j] += h
                w = w - h.view(shape1) * Q[i]
        hn = _bnorm(w)
        # per-sample breakdown (invariant subspace found): stop that sample's Krylov space by
        # continuing with q = 0, so its later Hessenberg columns stay zero
        done = hn <= 1e-12 * _tiny(H[:, : j + 1, j].abs().amax(1))
        H[:, j + 1, j] = torch.where(done, torch.zeros_like(hn), hn)
        if bool(done.all()):
            k_used = j + 1
            break
        q = w / _tiny(hn).view(shape1)
        Q.append(torch.where(done.view(shape1), torch.zeros_like(q), q))
    Hm = torch.nan_to_num(H[:, :k_used, :k_used])  # LAPACK rejects non-finite input
    ritz = torch.linalg.eigvals(Hm).abs().amax(1)
    return ritz.to(v.dtype)


def jacobian_spectral_norm(
    cell: Callable[..., Tensor],
    z_star: Tensor,
    x: Tensor,
    *,
    iters: int = 100,
    tol: float = 1e-10,
    refine: int = 10,
    seed: int = 0,
) -> Tensor:
    """Per-sample sigma_max(J) at z_star by power iteration on J^T J (a JVP, then a VJP),
    sharpened by ``refine`` Lanczos steps. sigma_max(J) >= rho(J). Returns (B,)."""
    lin = _Linearised(cell, z_star, x)
    jvp, vjp = lin.jvp, lin.vjp
    g = _gen(seed, z_star.device)
    v = torch.randn(z_star.shape, generator=g, dtype=z_star.dtype, device=z_star.device)
    shape1 = (-1, *([1] * (v.dim() - 1)))
    v = v / _bnorm(v).view(shape1)
    est = torch.zeros(v.shape[0], dtype=v.dtype, device=v.device)
    for _ in range(iters):
        w = vjp(jvp(v))
        new = _bdot(w, v).clamp_min(0).sqrt()
        v = w / _tiny(_bnorm(w)).view(shape1)
        done = bool(((new - est).abs() <= tol * _tiny(new)).all())
        est = new
        if done:
            break
    power = _bnorm(jvp(v))
    if refine <= 0:
        return power
    return torch.maximum(power, _lanczos_max(lambda q: vjp(jvp(q)), v, refine).sqrt())


def jacobian_frobenius(
    cell: Callable[..., Tensor],
    z_star: Tensor,
    x: Tensor,
    *,
    n_vectors: int = 8,
    seed: int = 0,
) -> Tensor:
    """Per-sample Hutchinson estimate of ||J||_F: sqrt(mean_v ||v^T J||^2), v ~ N(0, I)
    (unbiased for ||J||_F^2). Returns (B,)."""
    vjp = _vjp_fn(cell, z_star, x)
    g = _gen(seed, z_star.device)
    acc = torch.zeros(z_star.shape[0], dtype=z_star.dtype, device=z_star.device)
    for _ in range(n_vectors):
        v = torch.randn(z_star.shape, generator=g, dtype=z_star.dtype, device=z_star.device)
        acc = acc + _bnorm(vjp(v)) ** 2
    return (acc / n_vectors).sqrt()


# -- Lipschitz bound --------------------------------------------------------------------------


def layers(module: nn.Module) -> list[tuple[str, Any]]:
    """The Linear and Conv2d submodules of ``module`` (name, module), in registration order;
    for a cell, not those whose weight it declares as injection (``injection_parameters()``)."""
    from ..core.contracts import injection_parameters

    skip = {id(p) for p in injection_parameters(module)}
    return [
        (n, m)
        for n, m in module.named_modules()
        if isinstance(m, (nn.Linear, nn.Conv2d)) and id(m.weight) not in skip
    ]


_NORM_LAYERS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm, nn.InstanceNorm2d)


def lipschitz_upper_bound(
    cell: nn.Module,
    input_hw: dict[str, Any] | tuple[int, int] | None = None,
) -> tuple[float, str]:
    """Upper bound of the cell's Lipschitz constant in z: the product of its layers' spectral
    norms (convs: exact circular norm, itself an upper bound for zero padding).

    A cell with a ``lipschitz_bound()`` method (e.g. the kGLM cell, which multiplies by
    sup|sigma'|) is asked instead. The plain product assumes 1-Lipschitz activations and no
    normalisation layers; when the cell has normalisation layers the note says the product is
    not a bound.

    Args:
        cell: the DEQ cell.
        input_hw: input size of the convolutions (one (h, w) for all, or per layer name).

    Returns:
        (bound, note)
    """
    own = getattr(cell, "lipschitz_bound", None)
    if callable(own):
        return float(own()), "cell.lipschitz_bound()"
    prod = 1.0
    for name, m in layers(cell):
        if isinstance(m, nn.Conv2d):
            hw = input_hw.get(name) if isinstance(input_hw, dict) else input_hw
            if hw is None:
                raise ConfigError(f"lipschitz_upper_bound: input size of conv '{name}' unknown")
            prod *= conv_spectral_norm(m.weight, hw)
        else:
            prod *= dense_norm(m.weight)
    if not layers(cell):  # an empty product is no bound
        return math.nan, "not available: no Linear/Conv2d cell weight and no lipschitz_bound()"
    note = "product of layer norms"
    if any(isinstance(m, _NORM_LAYERS) for m in cell.modules()):
        note += "; cell has normalisation layers, so not a true bound"
    return prod, note
