"""Captured training steps (``train.capture: true``): a DEQ training step as a few CUDA graphs
whose stop tests run on the device.

A step of a small DEQ is a few dozen tiny kernels separated by host work (the solvers'
bookkeeping, the implicit function's Python, the optimiser's loop, the stats and their host
reads), so the GPU idles most of it (docs: Benchmarks, "Training steps against their floor").
Here the step is the floor's work with the solvers' stop tests on the device:

1. ``prologue``: the injection u = inject(x) (with its autograd graph), z = z0(u), the forward
   solve's state reset;
2. forward chunks: n masked fixed-point steps z <- f(z, u) each (:class:`MaskedSolve`): every step
   measures the residual of its iterate, and once the stop rule holds (or the residual is
   non-finite or blown up, or the budget is spent) the iterate stays and the count stops, so the
   solve returns the iterate where the eager solver stops, whatever n;
3. ``middle``: the readout and loss with their backward (dL/dz* and the readout's gradients), f
   at z* recorded with grad, the adjoint solve's state reset;
4. adjoint chunks: masked fixed-point steps w <- J^T w + g (VJPs of that recording);
5. ``grads``: the cell's parameter VJP at w and the injection's backward; ``update``: the
   optimiser step (``capturable``) and the model's ``post_step`` hooks (captured again when the
   learning rate changes).

Each part is captured once (every chunk length of a solve at its first capture, so that no
capture falls between later steps as the counts move) in one memory pool and replayed; the host reads
one small tensor after the forward chunks (halted? diverged?) and one after the adjoint chunks
(halted? the loss and both solves' summaries), so a step costs about six graph launches and two
host reads where each solve fits its first chunk, a launch and a read more per further chunk.
The first chunk's length is the solve's count at the last step (rounded down to
:data:`LADDER`, which holds every length to 16), later chunks an eighth of it (at least one
step): a solve whose count holds from step to step at a length of the ladder (every count to
16) stops at the end of its first chunk, with no masked step past its stop and one host read
(:func:`plan`). On the CPU the same parts
run eagerly (no graphs): the tests compare them with the eager training path there.

A model with several DEQ layers in a chain (:meth:`~deqbench.core.deq.DEQModel.chain`: pcDEQ's
MC, three stages) takes the same parts per stage: after stage k's forward solve a ``link`` part
computes the next stage's injection from z_k* (the stage's finish and the next inject, with
their autograd graph from z_k*) and resets its solve; after the last, ``middle``; then from the
last stage back, its adjoint chunks, its ``grads`` (which also backpropagate the injection's
gradient through the link into z_{k-1}*), and a ``record`` part taking that gradient as the
previous stage's dL/dz* and recording f at its z*. A host read per solve.

What it supports (:func:`capture_problem` says why not otherwise): a model whose DEQ layers
form its :meth:`~deqbench.core.deq.DEQModel.chain` (one layer with ``inject``/``readout``/``z0``
by default), each with the ``fixed_point``
forward solver (no damping) and the ``ift`` backward with the ``fixed_point`` adjoint solver,
Adam or AdamW, no gradient clipping, no AMP or compiled cell, classification or regression
losses. The solves return their last iterate (the eager solvers' default is the per-sample
lowest; on a contraction they are the same iterate); every step's solves are judged converged
by their returned iterate's own residual under the declared stop rule, on the device, and
recorded in the solve ledger as the eager ones are.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..core import verdict
from ..core.deq import ChainStage, chain_problem, deq_layers
from ..solvers.stats import EPS, SolverStats, batch_norm, make_stats, rule_value
from . import captured_kernels

#: the chunk lengths (one captured graph each per solve): every length to 16, where the small
#: DEQs' solves end, then coarser steps to 64
LADDER = tuple(range(1, 17)) + (20, 24, 28, 32, 40, 48, 56, 64)


def chunk(count: int) -> int:
    """The longest chunk of :data:`LADDER` not above ``count`` (the shortest below it)."""
    return max([n for n in LADDER if n <= count] or [LADDER[0]])


def plan(last: int) -> tuple[int, int]:
    """The first chunk and the later chunks of a solve whose count at the last step was
    ``last``: the first the longest not above it (so that a solve that takes as many steps as
    the last, a count of the ladder, stops at the end of its first chunk: one host read, no
    masked step past the stop; above 16 the ladder is coarser, so a count between its lengths
    takes a later chunk or more), the later ones the longest not above an eighth of it (at
    least one step: a solve a step or two longer than the last costs a read or two, not half a
    chunk of masked steps)."""
    return chunk(last), chunk(max(1, last // 8))


def capture_problem(model: nn.Module, cfg: Any) -> str | None:
    """Why ``model`` trained with ``cfg`` (a TrainConfig) cannot take captured steps, or None."""
    if (why := chain_problem(model)) is not None:
        return why
    for layer in deq_layers(model):
        s, b = layer.solver_cfg, layer.backward_cfg
        if s.name != "fixed_point" or float(s.options.get("tau", 1.0)) != 1.0:
            return f"forward solver {s.name!r} (captured steps take fixed_point without damping)"
        if b.name != "ift" or b.solver != "fixed_point":
            return f"backward {b.name!r} / {b.solver!r} (captured steps take ift with fixed_point)"
        if float(b.options.get("tau", 1.0)) != 1.0:
            return "a damped adjoint solver"
        rt = layer.runtime
        if rt.amp != "none" or rt.backend is not None:
            return "AMP or a compiled cell"
    if cfg.optimizer not in ("adam", "adamw"):
        return f"optimizer {cfg.optimizer!r} (captured steps take adam or adamw)"
    if cfg.grad_clip:
        return "gradient clipping"
    return None


class MaskedSolve:
    """A fixed-point solve of ``fn`` on a static state, in masked steps that stop on the device.

    Static buffers: the state, whether it stopped, the f-evaluations made, the first abs
    residual, the residuals of the iterate it stops at, converged / diverged. Each step
    evaluates f at the state, measures that iterate's residual (abs and rel per sample, the stop
    rule's batch value), and then, unless the solve stopped before, counts the evaluation and
    either stops there (the stop rule holds, the residual is non-finite or exceeds
    ``protect`` times the first, or the budget is spent: the test the eager tracker makes, in
    that order) or takes f's value as the next iterate."""

    def __init__(self, state: Tensor, tol: float, stop_mode: str, rule: str, max_iter: int,
                 protect: float) -> None:  # fmt: skip
        self.z, dev = state, state.device
        self.tol, self.stop_mode, self.rule = float(tol), stop_mode, rule
        self.max_iter, self.protect = int(max_iter), float(protect)
        B = state.shape[0]
        self.halt = torch.zeros((), dtype=torch.bool, device=dev)
        self.nstep = torch.zeros((), dtype=torch.long, device=dev)
        self.abs0 = torch.zeros((), dtype=state.dtype, device=dev)
        self.abs_r = torch.zeros(B, dtype=state.dtype, device=dev)
        self.rel_r = torch.zeros(B, dtype=state.dtype, device=dev)
        self.value = torch.zeros((), dtype=state.dtype, device=dev)
        self.conv = torch.zeros((), dtype=torch.bool, device=dev)
        self.div = torch.zeros((), dtype=torch.bool, device=dev)
        #: the stop test in three Triton kernels (:mod:`deqbench.run.captured_kernels`; CUDA)
        self.fused = (
            captured_kernels.FusedTest(state, self.tol, self.protect, rule, stop_mode)
            if captured_kernels.usable(state, rule, stop_mode)
            else None
        )

    def reset(self) -> None:
        for t in (self.halt, self.nstep, self.conv, self.div):
            t.zero_()

    def steps(self, fn: Any, n: int) -> None:
        for _ in range(n):
            self.step(fn)

    def step(self, fn: Any) -> None:
        z = self.z
        fz = fn(z)
        if self.fused is not None:
            self.fused.step(self, fz)
            return
        a = batch_norm(fz - z)
        nrm = batch_norm(fz)
        r = a / (nrm + EPS)
        value = rule_value(a, r, self.rule, self.stop_mode, nrm)
        amax = a.amax()
        active = ~self.halt
        first = self.nstep == 0
        torch.where(first, amax, self.abs0, out=self.abs0)
        finite = torch.isfinite(a).all() & torch.isfinite(r).all()
        div_now = ~finite | ((self.abs0 != 0) & (amax > self.protect * self.abs0))
        conv_now = ~div_now & (value < self.tol)
        self.nstep.add_(active.long())
        stop_now = active & (div_now | conv_now | (self.nstep >= self.max_iter))
        torch.where(active, a, self.abs_r, out=self.abs_r)
        torch.where(active, r, self.rel_r, out=self.rel_r)
        torch.where(active, value, self.value, out=self.value)
        self.conv |= active & conv_now
        self.div |= active & div_now
        torch.where(active & ~stop_now, fz, z, out=z)  # in place: one pass, no copy
        self.halt |= stop_now

    def summary(self) -> list[Tensor]:
        """Device scalars the host reads once: halted, f-evaluations, converged, diverged, the
        stop rule's value, the max abs and rel residual of the returned iterate."""
        dt = self.abs_r.dtype
        return [self.halt.to(dt), self.nstep.to(dt), self.conv.to(dt), self.div.to(dt),
                self.value, self.abs_r.amax(), self.rel_r.amax()]  # fmt: skip

    def stats(self, row: list[float]) -> SolverStats:
        """The solve's :class:`SolverStats` (solver ``fixed_point``) from its summary ``row``
        (as :meth:`summary` ordered, read on the host), the per-sample residuals copied out of
        the static buffers, their batch maxima those of the row (so that the step's records
        read no device value: a read would wait for the parts queued after the solve, and the
        host could not queue the next step's meanwhile)."""
        _, nstep, conv, div, value, abs_max, rel_max = row[:7]
        B = self.abs_r.shape[0]
        empty = self.abs_r.new_zeros(0, B)
        st = make_stats(
            "fixed_point", int(nstep), empty, empty, self.abs_r.clone(), self.rel_r.clone(),
            self.tol, self.stop_mode, diverged=bool(div), converged=bool(conv), stop=self.rule,
            extra={"returned": "x", "stop_residual": value},
        )  # fmt: skip
        st.path, st.maxima = "captured", (abs_max, rel_max)
        return st


class _Recapture(Exception):
    """A part could not be captured: the step starts again on the eager parts."""


class _Equilibrium:
    """One stage of the chain in a captured step: its :class:`ChainStage`, its injection (with
    its autograd graph) and the static buffers of its solves and of f at its z* (made at the
    first, eager, step: :meth:`alloc`)."""

    def __init__(self, stage: ChainStage) -> None:
        self.stage = stage
        self.layer: Any = stage.layer
        self.u: Any = None  # the injection, with its autograd graph (to the previous z* or x)
        self.ud: Any = None  # the same, detached: the solves' input
        self.zr: Any = None  # z* as a leaf with grad: the next stage's link starts from it
        self.fzr: Any = None  # f at z* recorded with grad (the adjoint's and grads' VJPs)

    def alloc(self, u: Tensor) -> None:
        """The solves' and the recording's static buffers, shaped as the injection ``u``."""
        s, b = self.layer.solver_cfg, self.layer.backward_cfg
        prot_s = float(s.options.get("protect_thres", 1e6))
        prot_b = float(b.options.get("protect_thres", 1e6))
        self.z = torch.zeros_like(u)
        self.w = torch.zeros_like(u)
        self.g = torch.zeros_like(u)
        self.fwd = MaskedSolve(self.z, s.tol, s.stop_mode, s.options.get("stop", "sample_max"),
                               s.max_iter, prot_s)  # fmt: skip
        self.adj = MaskedSolve(self.w, b.tol, b.stop_mode, b.options.get("stop", "sample_max"),
                               b.max_iter, prot_b)  # fmt: skip
        # f at z* with grad, on static leaves whose version counters are their own (``.data``:
        # the storage of z*, u and the cell's parameters and buffers): a part captured at a
        # later step (a new chunk length) differentiates the recording made earlier, after the
        # optimiser and the solves changed those tensors in place, without autograd refusing
        cell = self.layer.cell
        self.zl = torch.zeros_like(u).requires_grad_()
        self.ul = torch.zeros_like(u).requires_grad_(u.requires_grad)
        self.leaves = {n: p.data.requires_grad_() for n, p in cell.named_parameters()}
        self.tensors = dict(self.leaves)
        self.tensors.update({n: b.data for n, b in cell.named_buffers()})
        named = dict(cell.named_parameters())
        self.cell_pairs = [(named[n], q) for n, q in self.leaves.items() if named[n].requires_grad]

    def enter(self, h: Tensor) -> None:
        """The stage's injection from ``h`` (the previous stage's output, or the batch), its
        iterate's start z0(u) and its forward solve's reset."""
        self.u = self.stage.inject(h)
        self.ud = self.u.detach()
        if not hasattr(self, "fwd"):  # the first (eager) step
            self.alloc(self.u)
        with torch.no_grad():
            self.z.copy_(self.stage.z0(self.ud))
        self.fwd.reset()

    def leave(self) -> Tensor:
        """z* as a leaf with grad, and the stage's output from it (its finish, with grad)."""
        self.zr = self.z.detach().requires_grad_()
        fin = self.stage.finish
        return self.zr if fin is None else fin(self.zr)

    def f(self, z: Tensor) -> Tensor:
        with torch.no_grad():
            return self.layer.cell(z, self.ud)

    def record(self) -> None:
        """dL/dz* into ``g`` (from the gradient of z*'s leaf, which the head's or the next
        stage's backward wrote), f at z* recorded with grad (from the static leaves) and the
        adjoint's start and reset."""
        self.g.copy_(self.zr.grad)
        self.zl.data.copy_(self.z)
        self.ul.data.copy_(self.ud)
        with torch.enable_grad():
            self.fzr = functional_call(self.layer.cell, self.tensors, (self.zl, self.ul))
        with torch.no_grad():
            if self.layer.backward_cfg.b_init == "grad":
                self.w.copy_(self.g)
            else:
                self.w.zero_()
        self.adj.reset()

    def adj_map(self, w: Tensor) -> Tensor:
        (gz,) = torch.autograd.grad(self.fzr, self.zl, w, retain_graph=True)
        return gz + self.g

    def grads(self) -> None:
        """The parameters' gradients at w: the cell's (a VJP of the recording) and, through the
        injection's backward from u, those of the stage's inject and of what comes before it
        (the previous stage's finish; its z*'s leaf ``zr`` gets dL/dz*)."""
        wants_u = self.ul.requires_grad
        leaves = [q for _, q in self.cell_pairs]
        inputs = ([self.ul] if wants_u else []) + leaves
        gs = list(
            torch.autograd.grad(self.fzr, inputs, self.w, retain_graph=True, allow_unused=True)
        )
        gu = gs.pop(0) if wants_u else None
        with torch.no_grad():
            for (p, _), gp in zip(self.cell_pairs, gs):
                if gp is not None:
                    p.grad.add_(gp)  # type: ignore[union-attr]
        if gu is not None:
            torch.autograd.backward(self.u, gu, retain_graph=True)

    def drop(self) -> None:
        """Let go of the autograd graphs (an eager step's, before a capture)."""
        self.u = self.ud = self.zr = self.fzr = None


class CapturedStep:
    """Training steps of ``model`` as captured parts (module docstring); ``step`` runs one."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Any, task: str,
                 after_step: list[Any]) -> None:  # fmt: skip
        self.model: Any = model  # a DEQModel (capture_problem)
        self.opt, self.loss_fn, self.task = opt, loss_fn, task
        self.after_step = after_step
        stages, self.head = model.chain()  # type: ignore[operator]
        self.eqs = [_Equilibrium(st) for st in stages]
        self.cuda = next(model.parameters()).is_cuda
        self.params = [p for g in opt.param_groups for p in g["params"]]
        for p in self.params:  # static gradients, accumulated into by the captured parts
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.graphs: dict[Any, Any] = {}
        self.pool: Any = None
        self.lr: list[float] = []
        #: the last step's count of each solve (kind, stage): its first chunk
        self.last_count: dict[tuple[str, int], int] = {}
        #: whether a step was made (the parts are captured from the second step on: the first,
        #: eager, creates the optimiser's state and lets the libraries pick their kernels)
        self.warm = False
        #: whether the last captured step added no part (an LR change's new ``update`` aside):
        #: the next captures none unless the LR changes
        self.settled = False
        self.x: Tensor | None = None  # the static batch (the first batch's shapes)
        self.y: Tensor | None = None
        self.loss: Tensor | None = None
        self.acc: Tensor | None = None
        if self.cuda:
            # the recorded f at z* of one batch shape's captured parts keeps the parameters'
            # AccumulateGrad nodes (made on the capture stream); another shape's eager first
            # step meets them on the default stream, and torch warns of a possible extra
            # synchronisation (the values are the same; a failed capture has its own warning)
            warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream")

    # -- the parts ---------------------------------------------------------------------------
    def _prologue(self) -> None:
        for p in self.params:
            p.grad.zero_()  # type: ignore[union-attr]
        self.eqs[0].enter(self.x)  # type: ignore[arg-type]
        if self.loss is None:
            self.loss = self.eqs[0].z.new_zeros(())
            self.acc = self.eqs[0].z.new_zeros(())

    def _link(self, k: int) -> None:
        """Stage k's injection from stage k-1's z* (its finish and stage k's inject)."""
        self.eqs[k].enter(self.eqs[k - 1].leave())

    def _middle(self) -> None:
        """The head and loss with their backward (the head's and the last finish's gradients,
        dL/dz* of the last stage), then the last stage's recording."""
        last = self.eqs[-1]
        out = self.head(last.leave())
        loss = self.loss_fn(out, self.y)
        loss.backward()
        assert self.loss is not None and self.acc is not None
        self.loss.copy_(loss.detach())
        if self.task == "classification":
            self.acc.copy_((out.detach().argmax(1) == self.y).to(self.acc.dtype).mean())
        last.record()

    def _back(self, k: int) -> None:
        """Stage k's dL/dz* (its leaf's gradient, from stage k+1's grads) and recording."""
        self.eqs[k].record()

    def _update(self) -> None:
        """The optimiser step and the model's post_step hooks (captured again when the LR
        changes: a captured step holds it as a constant)."""
        self.opt.step()
        for fn in self.after_step:
            fn()

    def _summary(self, solve: MaskedSolve, tail: Sequence[Tensor]) -> Tensor:
        return torch.stack([t.to(solve.z.dtype) for t in solve.summary() + list(tail)])

    # -- running them ------------------------------------------------------------------------
    def _run(self, key: Any, fn: Any) -> None:
        """Run part ``key`` (a callable doing it): eagerly on the CPU; on CUDA its captured
        graph (captured on first use, in the shared pool)."""
        if not self.cuda or not self.warm:
            fn()
            return
        g = self.graphs.get(key)
        if g is None:
            g = self._capture(key, fn)
        g.replay()

    def _capture(self, key: Any, fn: Any) -> Any:
        """Capture part ``key`` (recorded, not run) into the shared pool (the eager steps before
        it dropped their autograd graphs: :meth:`step`)."""
        try:
            g = self._record(fn)
        except Exception as exc:  # noqa: BLE001 - not capturable: eager from now on
            why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
            warnings.warn(f"captured training steps: {why}; eager parts from now on",
                          RuntimeWarning, stacklevel=2)  # fmt: skip
            self.cuda = False
            self.graphs.clear()
            raise _Recapture from exc
        if self.pool is None:
            self.pool = g.pool()
        self.graphs[key] = g
        return g

    def _record(self, fn: Any) -> Any:
        """A CUDA graph of ``fn`` (recorded, not run) in the shared pool."""
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            fn()
        return g

    def _solve(
        self, kind: str, k: int, solve: MaskedSolve, fn: Any, tail: list[Tensor]
    ) -> list[float]:
        """Chunks of masked steps until the device says the solve stopped; the summary row."""
        n, more = plan(self.last_count.get((kind, k)) or 8)
        if self.cuda and self.warm and (kind, k, n) not in self.graphs:
            # every chunk length of the solve at once: a length first met mid-run (the counts
            # move as the model trains) would otherwise be captured then, between timed steps
            for m in LADDER:
                if (kind, k, m) not in self.graphs and m <= solve.max_iter:
                    self._capture((kind, k, m), lambda m=m: solve.steps(fn, m))
        self._run((kind, k, n), lambda: solve.steps(fn, n))
        while True:
            row = self._summary(solve, tail).tolist()
            if row[0] or row[1] >= solve.max_iter:
                break
            self._run((kind, k, more), lambda: solve.steps(fn, more))
        self.last_count[(kind, k)] = int(row[1])
        return row

    def step(
        self, xb: Tensor, yb: Tensor
    ) -> tuple[float, float, list[SolverStats], list[SolverStats] | None]:
        """One training step on batch (xb, yb): (loss, accuracy, the forward solves' stats in
        stage order, the adjoint solves' stats in the order they ran (last stage first), or
        None where training must stop before the backward: a diverged forward solve or a
        non-finite loss, in which case no parameter was changed)."""
        eager = not (self.cuda and self.warm)
        lrs = [float(g["lr"]) for g in self.opt.param_groups]
        # a step that may capture a part (the first captured step, the one after it, a new LR)
        # keeps the model's buffers: where a capture fails, the parts replayed before it have
        # run (the injections' and the head's BatchNorm statistics moved), and the step starts
        # again on the eager parts from the buffers it started with
        keep = None
        if not eager and (not self.settled or lrs != self.lr):
            keep = [b.detach().clone() for b in self.model.buffers()]
        n_graphs = len(self.graphs)
        try:
            try:
                out = self._step(xb, yb, lrs)
            except _Recapture:  # nothing of the step ran on the device past the failed capture
                if keep is not None:
                    with torch.no_grad():
                        for b, v in zip(self.model.buffers(), keep):
                            b.copy_(v)
                out = self._step(xb, yb, lrs)
            self.settled = not eager and self.cuda and len(self.graphs) == n_graphs
            return out
        finally:
            if eager and self.cuda and len(self.graphs) == 0:
                # an eager step's autograd graphs (the injections', f at z*'s) hold the
                # parameters' AccumulateGrad nodes, made on the default stream: dropped, so that
                # a capture (of this or another batch shape's parts) makes its own
                for e in self.eqs:
                    e.drop()

    def _step(
        self, xb: Tensor, yb: Tensor, lrs: list[float]
    ) -> tuple[float, float, list[SolverStats], list[SolverStats] | None]:
        if self.x is None or self.y is None:
            self.x, self.y = xb.clone(), yb.clone()
        if self.cuda and self.warm and lrs != self.lr:  # a new LR: the step is captured again
            self.graphs.pop("update", None)
        self.lr = lrs
        self.x.copy_(xb)
        self.y.copy_(yb)
        self._run("prologue", self._prologue)
        fsts, diverged = [], False
        for k, e in enumerate(self.eqs):
            if k:
                self._run(("link", k), lambda k=k: self._link(k))
            row = self._solve("forward", k, e.fwd, e.f, [])
            fsts.append(e.fwd.stats(row))
            diverged |= bool(row[3])
        if diverged:  # no backward (the eager path's rule; it solves every stage first too)
            return math.nan, math.nan, fsts, None
        self._run("middle", self._middle)
        assert self.loss is not None and self.acc is not None
        asts, loss, acc = [], math.nan, math.nan
        for k in reversed(range(len(self.eqs))):
            e = self.eqs[k]
            if k < len(self.eqs) - 1:
                self._run(("back", k), lambda k=k: self._back(k))
            tail = [self.loss, self.acc] if k == len(self.eqs) - 1 else []
            row = self._solve("adjoint", k, e.adj, e.adj_map, tail)
            if k == len(self.eqs) - 1:
                loss, acc = row[-2], row[-1]
                if not math.isfinite(loss):
                    return loss, acc, fsts, None
            asts.append(e.adj.stats(row))
            self._run(("grads", k), e.grads)
        self._run("update", self._update)
        self.warm = True
        return loss, acc, fsts, asts

    def record(self, fsts: list[SolverStats], asts: list[SolverStats] | None) -> None:
        """The step's solves into the solve ledger (checked against their tolerance as the
        eager solves are: the forward solves in stage order, then the adjoints as they ran)
        and onto the layers (``last_forward_stats`` / ``last_backward_stats``, which the step's
        records and the analyses read)."""
        # converged is the device's test of the returned iterate's own residual (not a
        # solver's claim to check again: that would read it once more); the ledger keeps it
        for e, fst in zip(self.eqs, fsts):
            verdict.record("forward", fst, e.layer.solver_cfg.max_iter)
            e.layer.__dict__["last_forward_stats"] = fst
        if asts is not None:
            for e, ast in zip(reversed(self.eqs), asts):
                verdict.record("adjoint", ast, e.layer.backward_cfg.max_iter)
                e.layer.__dict__["last_backward_stats"] = ast
