"""Type-II Anderson acceleration with a residual-scaled regulariser.

Per sample, ring buffers hold the last m evaluations F_i = f(x_i) and residuals G_i = F_i - x_i
(x_i = F_i - G_i need not be stored). A step solves

    min_alpha ||sum_i alpha_i G_i||^2 + lam_eff ||alpha||^2   subject to  sum_i alpha_i = 1,

i.e. alpha = w / sum(w) with (G G^T + lam_eff I) w = 1, and moves to

    x_new = beta sum_i alpha_i F_i + (1 - beta) sum_i alpha_i x_i
          = sum_i alpha_i F_i - (1 - beta) sum_i alpha_i G_i.

``lam`` is relative: lam_eff = lam * max_i ||G_i||^2 per sample (+ ``lam_abs``). An absolute
lambda such as TorchDEQ's 1e-4 swamps G G^T once ||g||^2 falls below it, alpha tends to uniform
weights and Anderson degenerates into averaging the last iterates.

The first step (one residual) is a plain fixed-point step x_1 = f(x_0). G G^T is kept in
float64 and updated by one new row per step (a batched matrix-vector product over the buffer,
on CUDA over chunks of each sample's vector, see :func:`~deqbench.solvers.base.chunking`), the
m x m systems are solved in batch on the device in
float64 with ``torch.linalg.solve_ex`` (no host sync), and a sample whose solve failed or
produced a non-finite weight takes a plain step x = f(x_latest) instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pydantic import Field
from torch import Tensor

from ..core.registry import solvers
from . import fused
from .base import (
    LARGE_NUMEL,
    GraphOptions,
    SolverStats,
    Tracker,
    check_output,
    chunking,
    flat,
    graph_loop,
    graph_mode,
    graph_state,
    graph_steps,
    solver,
    steps_label,
)


class AndersonOptions(GraphOptions):
    m: int = Field(6, gt=0, description="history size.")
    beta: float = Field(1.0, gt=0, le=2, description="mixing; 1 uses the mixed images only.")
    lam: float = Field(
        1e-8,
        ge=0,
        description="regulariser relative to the residual scale, lam_eff = lam * max_i "
        "||G_i||^2 per sample.",
    )
    lam_abs: float = Field(
        0.0,
        ge=0,
        description="absolute regulariser added to lam_eff (TorchDEQ's lam is lam=0, "
        "lam_abs=1e-4).",
    )


@solvers.register("anderson")
# the eager step is host-bound on large cells too (conv64: ~25 small kernels and a batched
# solve per step against a ~1 ms f), so the DEQ layer captures it up to LARGE_NUMEL elements
@solver(AndersonOptions, cuda_graph=True, graph_numel=LARGE_NUMEL)
def anderson(
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    opts: AndersonOptions,
    *,
    max_iter: int = 50,
    tol: float = 1e-4,
    stop_mode: str = "rel",
) -> tuple[Tensor, SolverStats]:
    """Anderson acceleration (type II) of the fixed-point iteration z = f(z).

    z0 is the first measured iterate (returned if nothing beats it). With ``cuda_graph`` every
    step works on all m slots (unused ones are masked out of the least-squares problem), so one
    captured step serves the whole solve. Options: :class:`AndersonOptions`.

    Returns:
        (z, SolverStats); ``extra["fallbacks"]`` counts per-sample plain steps taken because a
        least-squares solve failed.

    Example:
        >>> import torch
        >>> A = torch.tensor([[0.5, 0.3], [0.0, 0.4]], dtype=torch.float64)
        >>> z, st = anderson(lambda z: z @ A.T + 1, torch.zeros(1, 2, dtype=torch.float64),
        ...                  max_iter=20, tol=1e-10)
        >>> st.status, st.nstep
        ('converged', 10)
    """
    m, beta, lam, lam_abs = opts.m, opts.beta, opts.lam, opts.lam_abs
    gmode = graph_mode(opts)
    tracker = Tracker(
        "anderson", z0, max_iter=max_iter, tol=tol, stop_mode=stop_mode, common=opts,
        static=gmode is not None,
    )  # fmt: skip
    shape = z0.shape
    bsz = int(shape[0])
    dim = flat(z0).shape[1]
    nc, cd = chunking(bsz, dim, z0.device)  # each sample's vector as nc chunks of length cd
    m = min(m, max_iter)
    dev, dt = z0.device, z0.dtype
    if gmode is not None:
        steps = graph_steps(opts, z0)
        nstep, fallbacks = _static_steps(
            f,
            z0,
            tracker,
            gmode,
            opts.returns,
            stop_mode,
            m,
            nc,
            cd,
            beta,
            lam,
            lam_abs,
            max_iter,
            steps,
        )
        info = {"m": m, "lam": lam, "lam_abs": lam_abs, "fallbacks": fallbacks}
        return tracker.finish(
            nstep, info | {"cuda_graph": gmode, "graph_steps": steps_label(steps)}
        )
    Fb = torch.empty(bsz, nc, m, cd, dtype=dt, device=dev)
    Gb = torch.empty(bsz, nc, m, cd, dtype=dt, device=dev)
    sdt = _system_dtype(dt)
    ones = torch.ones(bsz, m, 1, dtype=sdt, device=dev)
    eye_ids = torch.arange(m, device=dev)
    fallbacks = torch.zeros(bsz, dtype=torch.int64, device=dev)
    Hs = torch.zeros(bsz, m, m, dtype=sdt, device=dev)  # G G^T, updated one row per step
    alpha_buf = torch.empty(bsz, m, dtype=dt, device=dev)
    # the fused kernels where they run (CUDA, Triton): the new row of G G^T, the weights and
    # the mix, three launches instead of ~20
    fast = sdt == torch.float64 and fused.usable(Hs) and fused.usable(Fb, Gb, alpha_buf)
    rows = _row_buffer(bsz, nc, m, cd, dt, dev) if fast else None
    x = z0
    nstep = 0
    while True:
        fx = f(x)
        nstep += 1
        if nstep == 1:
            check_output("anderson", x, fx)
        slot = (nstep - 1) % m
        n = min(nstep, m)
        Gs = Gb[:, :, slot]  # (B, nc, cd) view
        tracker.record(x, fx, None, slots=(Fb, Gb, m, cd))  # F, G at slot (nstep - 1) % m
        if tracker.stop() or nstep >= max_iter:
            break
        # the new row and column of G G^T (the other entries do not change)
        Gn = Gb[:, :, :n].reshape(bsz * nc, n, cd)  # views: (B, nc) flatten without a copy
        if fast:  # the row, then the weights (slots not written yet are masked in them)
            assert rows is not None
            fused.anderson_row(Gb, rows, nstep, m)
            fused.anderson_weights(Hs, alpha_buf, fallbacks, nstep, m, lam, lam_abs, rows=rows)
        else:
            h = torch.bmm(Gn, Gs.reshape(bsz * nc, cd, 1)).view(bsz, nc, n)
            h = (h.sum(1) if nc > 1 else h[:, 0]).to(sdt)
            Hs[:, slot, :n] = h
            Hs[:, :n, slot] = h
        if n == 1:  # one residual: a plain (beta-damped) fixed-point step
            # f's output itself (never modified, so no copy is needed)
            x = fx if beta == 1.0 else torch.add(x.reshape(bsz, nc, cd), Gs, alpha=beta).view(shape)
            continue
        if fast:  # a fresh tensor: the tracker holds earlier iterates
            xn = torch.empty(shape, dtype=dt, device=dev)
            fused.anderson_mix(Fb, Gb, alpha_buf, xn, nstep, m, beta)
            x = xn
            continue
        Fn = Fb[:, :, :n].reshape(bsz * nc, n, cd)
        H = Hs[:, :n, :n].clone()
        diag = H.diagonal(dim1=1, dim2=2)
        reg = diag.amax(dim=1, keepdim=True)
        reg = reg * lam + lam_abs if lam_abs else reg * lam
        diag.add_(reg)
        onehot = (eye_ids[:n] == slot).to(sdt).view(1, n, 1)
        alpha = _weights(H, ones[:, :n], onehot, fallbacks, dt).view(bsz, 1, 1, n)
        if nc > 1:
            alpha = alpha.expand(bsz, nc, 1, n)
        alpha = alpha.reshape(bsz * nc, 1, n)
        xn = torch.bmm(alpha, Fn)  # (B * nc, 1, cd): a fresh contiguous tensor
        if beta != 1.0:
            xn = torch.baddbmm(xn, alpha, Gn, alpha=-(1.0 - beta))
        x = xn.view(shape)
    return tracker.finish(nstep, {"m": m, "lam": lam, "lam_abs": lam_abs, "fallbacks": fallbacks})


def _row_buffer(bsz: int, nc: int, m: int, cd: int, dt: torch.dtype, dev: torch.device) -> Tensor:
    """Scratch for :func:`fused.anderson_row`'s partial products (per sample, chunk, piece)."""
    npow2 = max(2, 1 << max(0, (m - 1).bit_length()))
    return torch.empty(bsz * nc * fused.anderson_pieces(cd) * npow2, dtype=dt, device=dev)


def _system_dtype(dt: torch.dtype) -> torch.dtype:
    """float64 for the tiny systems: G G^T in float32 is only good to ~1e-7 relative, and the
    relative lambda sits below that."""
    return torch.float64 if dt in (torch.float32, torch.float16, torch.bfloat16) else dt


def _weights(H: Tensor, rhs: Tensor, newest: Tensor, fallbacks: Tensor, dt: torch.dtype) -> Tensor:
    """alpha = w / sum(w) with H w = rhs per sample, (B, n, 1) in ``dt``, on the device (no host
    sync, capturable). A sample whose solve is singular or non-finite gets the one-hot weights
    ``newest`` (a plain step from the newest evaluation) and is counted in ``fallbacks``."""
    w, info = torch.linalg.solve_ex(H, rhs)
    alpha = w / w.sum(dim=1, keepdim=True)
    bad = (info != 0) | ~torch.isfinite(alpha.sum(dim=(1, 2)))
    fallbacks.add_(bad)
    return torch.where(bad.view(-1, 1, 1), newest, alpha).to(dt)


def _static_steps(
    f: Callable[[Tensor], Tensor],
    z0: Tensor,
    tracker: Tracker,
    gmode: str,
    returns: str,
    stop_mode: str,
    m: int,
    nc: int,
    cd: int,
    beta: float,
    lam: float,
    lam_abs: float,
    max_iter: int,
    steps: int = 1,
) -> tuple[int, Tensor]:
    """Anderson on static buffers (the ring slot and the number of used slots live on the
    device), so that one step can be captured in a CUDA graph and replayed; unused slots get a
    huge diagonal, so their weights vanish. Returns (nstep, fallbacks)."""
    bsz, dev, dt = z0.shape[0], z0.device, z0.dtype
    sdt = _system_dtype(dt)
    key = ("anderson", f, tuple(z0.shape), dt, dev, max_iter, m, beta, lam, lam_abs, returns,
           stop_mode, tracker.rule, steps)  # fmt: skip
    graph, st = graph_state(gmode, key)
    st["bufs"] = tracker.enable_device_mode(z0, st.get("bufs"))
    if "xs" not in st:
        st["xs"] = torch.empty_like(z0, memory_format=torch.contiguous_format)
        st["Fb"] = torch.empty(bsz, nc, m, cd, dtype=dt, device=dev)
        st["Gb"] = torch.empty(bsz, nc, m, cd, dtype=dt, device=dev)
        st["fallbacks"] = torch.empty(bsz, dtype=torch.int64, device=dev)
        # every tensor the captured step reads must live as long as the cached graph
        st["ones"] = torch.ones(bsz, m, 1, dtype=sdt, device=dev)
        st["ids"] = torch.arange(m, device=dev)
        st["alpha"] = torch.empty(bsz, m, dtype=dt, device=dev)
        st["Hs"] = torch.empty(bsz, m, m, dtype=sdt, device=dev)  # G G^T (fused kernels)
        st["rows"] = _row_buffer(bsz, nc, m, cd, dt, dev)
    xs, Fb, Gb, fallbacks = st["xs"], st["Fb"], st["Gb"], st["fallbacks"]
    ones, ids, alpha_buf = st["ones"], st["ids"], st["alpha"]
    Hs, rows = st["Hs"], st["rows"]
    Hs.zero_()
    it = tracker.dev_k  # evaluations made (advanced by device_record)
    xs.copy_(z0)
    Fb.zero_()
    Gb.zero_()
    fallbacks.zero_()
    Gn = Gb.view(bsz * nc, m, cd)
    Fn = Fb.view(bsz * nc, m, cd)

    fast = sdt == torch.float64 and fused.usable(Fb, Gb, xs, alpha_buf) and fused.usable(Hs)

    def body() -> None:
        fx = f(xs)
        tracker.device_record(xs, fx, None, slots=(Fb, Gb, m, cd))  # F, G at slot it % m
        if fast:  # the new row of G G^T, the weights, the mix: three kernels
            fused.anderson_row(Gb, rows, it, m)
            fused.anderson_weights(Hs, alpha_buf, fallbacks, it, m, lam, lam_abs, rows=rows)
            fused.anderson_mix(Fb, Gb, alpha_buf, xs, it, m, beta)
            return
        Hc = torch.bmm(Gn, Gn.transpose(1, 2))  # (B * nc, m, m): the chunks' Gram matrices
        if fused.usable(Hc, alpha_buf):
            fused.anderson_weights(Hc, alpha_buf, fallbacks, it, m, lam, lam_abs)
            alpha = alpha_buf.view(bsz, 1, 1, m)
        else:
            H = Hc.view(bsz, nc, m, m).to(sdt).sum(1)
            diag = H.diagonal(dim1=1, dim2=2)
            reg = diag.amax(dim=1, keepdim=True) * lam + lam_abs
            diag.add_(torch.where(ids >= it, 1e30, reg))  # unused slots: weight ~ 0
            onehot = (ids == (it - 1).remainder(m)).to(sdt).view(1, m, 1)
            alpha = _weights(H, ones, onehot, fallbacks, dt).view(bsz, 1, 1, m)
        alpha = alpha.expand(bsz, nc, 1, m).reshape(bsz * nc, 1, m)
        if beta == 1.0:
            torch.bmm(alpha, Fn, out=xs.view(bsz * nc, 1, cd))
        else:
            xn = torch.baddbmm(torch.bmm(alpha, Fn), alpha, Gn, alpha=beta - 1.0)
            xs.view(bsz * nc, 1, cd).copy_(xn)

    nstep = graph_loop(
        "anderson",
        tracker,
        body,
        max_iter,
        mode=gmode,
        key=key,
        graph=graph,
        state=st,
        steps=steps,
    )
    return nstep, fallbacks.clone()
