"""Over-relaxed Picard iteration z <- (1 - w) z + w f(z), following deqbench's solver contract."""

from __future__ import annotations

import torch

from deqbench.solvers.base import make_stats, residuals


@torch.no_grad()
def relaxed_picard(f, z0, *, max_iter=50, tol=1e-4, stop_mode="rel", omega=0.9):
    z = z0
    abs_tr, rel_tr = [], []
    a = r = None
    for k in range(max_iter):
        fz = f(z)
        a, r = residuals(fz, z)
        abs_tr.append(a)
        rel_tr.append(r)
        if float((r if stop_mode == "rel" else a).max()) < tol or k == max_iter - 1:
            break  # return the iterate whose residual was measured
        z = (1 - omega) * z + omega * fz
    return z, make_stats(
        "relaxed_picard",
        len(abs_tr),
        abs_tr,
        rel_tr,
        a,
        r,
        tol,
        stop_mode,
        diverged=False,
        lowest_step=len(abs_tr) - 1,
    )
