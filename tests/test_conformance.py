"""Conformance by registry: ``deqbench.testing``'s checks over every registered name
(a model's ``_tiny`` variant stands in for it), so a new built-in solver, model, init, analysis
or dataset is checked with no edit here; and each check shown to fail on a part that breaks its
clause.

Time budget: the whole file within 90 s on an idle 2-core machine (about 40 s measured: the
analyses run one tiny cell each through the runner; their ``example`` keeps them small)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import deqbench
from deqbench.core.registry import analyses, inits, models, solvers
from deqbench.errors import ConfigError
from deqbench.testing import (
    EXTRA_CLAUSES,
    ConformanceError,
    check_analysis,
    check_backward,
    check_dataset,
    check_init,
    check_model,
    check_solver,
    conformance_names,
    example_context,
)

# -- every registered name ----------------------------------------------------------------------


@pytest.mark.parametrize("name", conformance_names("solvers"))
def test_solver_conforms(name):
    check_solver(name)


@pytest.mark.parametrize("name", conformance_names("models"))
def test_model_conforms(name):
    check_model(name)


@pytest.mark.parametrize("name", conformance_names("inits"))
def test_init_conforms(name):
    check_init(name)


@pytest.mark.parametrize("name", conformance_names("analyses"))
def test_analysis_conforms(name, tmp_path):
    check_analysis(name, out=tmp_path)


@pytest.mark.parametrize("name", conformance_names("backward"))
def test_backward_mode_conforms(name):
    check_backward(name)


#: datasets read from files in their real formats (tests/test_data.py writes tiny ones)
FILE_DATASETS = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST", "cifar10": None, "svhn": None}


@pytest.mark.parametrize("name", conformance_names("datasets"))
def test_dataset_conforms(name, tmp_path, monkeypatch):
    params: dict = {}
    if name in FILE_DATASETS:
        import numpy as np
        from test_data import _write_cifar, _write_mnist_like

        params["root"] = str(tmp_path)
        if name == "cifar10":
            _write_cifar(tmp_path / "cifar-10-batches-py")
        elif name == "svhn":
            scipy_io = pytest.importorskip("scipy.io", reason="SVHN's .mat files need scipy")
            rng = np.random.default_rng(0)
            for split, n in (("train", 6), ("test", 3)):
                X = rng.integers(0, 256, (32, 32, 3, n)).astype(np.uint8)
                y = rng.integers(1, 11, (n, 1)).astype(np.uint8)
                scipy_io.savemat(tmp_path / f"{split}_32x32.mat", {"X": X, "y": y})
        else:
            _write_mnist_like(tmp_path / FILE_DATASETS[name] / "raw")
        if name in ("cifar10", "svhn"):  # tiny files cannot match the official md5 sums
            import torchvision.datasets.utils as tvu

            monkeypatch.setattr(tvu, "check_md5", lambda fpath, md5, **k: True)
    elif name in ("digits", "digits_klr", "mnist5k"):
        params = {"split": 0.5}
    check_dataset(name, **params)


def test_every_kind_is_covered():
    """A new kind of part would need a check here: the names cover every registry."""
    from deqbench.core.registry import REGISTRIES

    assert set(REGISTRIES) == {"models", "solvers", "inits", "analyses", "datasets", "backward"}
    assert len(conformance_names("models")) < len(models.names())  # _tiny stands in
    assert all(f"{n}_tiny" not in models.names() for n in conformance_names("models"))


# -- each check fails where its clause breaks -----------------------------------------------------


@pytest.fixture
def runtime_names():
    added: list[tuple] = []

    def add(reg, name, obj):
        reg.add(name, obj)
        added.append((reg, name))
        return name

    yield add
    for reg, name in added:
        reg.remove(name)


def _picard(check_opts: bool):
    from deqbench.solvers.base import check_budget, check_options, make_stats, residuals

    def solve(f, z0, *, max_iter=50, tol=1e-4, stop_mode="rel", **options):
        if check_opts:
            check_options("t_picard", options, set())
        check_budget("t_picard", max_iter, tol, stop_mode)
        z, a_tr, r_tr = z0, [], []
        for k in range(max_iter):
            fz = f(z)
            a, r = residuals(fz, z)
            a_tr.append(a)
            r_tr.append(r)
            if float(r.max()) < tol or k == max_iter - 1:
                break
            z = fz
        return z, make_stats("t_picard", len(a_tr), a_tr, r_tr, a_tr[-1], r_tr[-1], tol,
                             stop_mode, diverged=False)  # fmt: skip

    return solve


def test_check_solver_catches_a_solver_that_swallows_options(runtime_names):
    check_solver(runtime_names(solvers, "t_good_picard", _picard(True)))
    name = runtime_names(solvers, "t_lax_picard", _picard(False))
    with pytest.raises(ConformanceError, match=r"\[solver.options\] accepted the unknown option"):
        check_solver(name)


def test_check_solver_catches_a_broken_return(runtime_names):
    name = runtime_names(solvers, "t_only_z", lambda f, z0, **kw: f(z0))
    with pytest.raises(ConformanceError, match=r"\[solver.returns\]"):
        check_solver(name)


class _NaNGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * math.nan


def test_check_model_catches_non_finite_gradients(runtime_names):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(_NaNGrad.apply(x.flatten(1)) * 1.0) + 0 * self.lin.weight.sum()

    class Bad(Net):
        def forward(self, x):
            return _NaNGrad.apply(self.lin(x.flatten(1)))

    good = runtime_names(models, "t_plain", lambda in_shape=(4,), num_outputs=3: Net())
    check_model(good)
    bad = runtime_names(models, "t_nan_grad", lambda in_shape=(4,), num_outputs=3: Bad())
    with pytest.raises(ConformanceError, match=r"\[model.backward\] non-finite gradients"):
        check_model(bad)


def test_check_model_catches_a_wrong_output_shape(runtime_names):
    name = runtime_names(
        models, "t_wrong_rows", lambda in_shape=(4,), num_outputs=3: nn.Linear(4, 2)
    )
    with pytest.raises(ConformanceError, match=r"\[model.forward\].*expected 2 rows of"):
        check_model(name)


def test_check_backward_catches_missing_gradients_and_ascent(runtime_names):
    from deqbench.backward import BackwardMode, registry

    class Detached(BackwardMode):
        name = "t_detached"

        def apply(self, layer, u, z0):
            z, _ = layer.solve(u, z0)
            return z + 0 * u  # no gradient reaches the cell

    class Ascent(BackwardMode):
        name = "t_ascent"

        def apply(self, layer, u, z0):
            z, _ = layer.solve(u, z0)
            z = z.detach()
            return 2 * z - layer.f(z, u)  # the JFB gradient, negated

    with pytest.raises(ConformanceError, match=r"\[backward.grad\]"):
        check_backward(runtime_names(registry, "t_detached", Detached))
    with pytest.raises(ConformanceError, match=r"\[backward.descent\] cosine"):
        check_backward(runtime_names(registry, "t_ascent", Ascent))
    with pytest.raises(ConformanceError, match=r"\[backward.class\]"):
        check_backward(runtime_names(registry, "t_not_a_mode", lambda: None))


def test_check_init_catches_the_global_rng(runtime_names):
    def global_rng(model, *, seed=0):
        for p in model.parameters():
            p.copy_(torch.randn_like(p))  # ignores seed

    def seeded(model, *, seed=0):
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))

    check_init(runtime_names(inits, "t_seeded", seeded))
    name = runtime_names(inits, "t_global_rng", global_rng)
    with pytest.raises(ConformanceError, match=r"\[init.seeded\] seed 0 twice gave different"):
        check_init(name)


def test_check_analysis_catches_unexplained_nan_and_loose_params(runtime_names):
    from deqbench.analyses.base import Analysis, Row

    class Silent(Analysis):
        name = "t_silent"
        needs_training = False

        def after_training(self, ctx):
            yield Row("nothing", math.nan)

    class Explained(Silent):
        def after_training(self, ctx):
            yield Row("nothing", math.nan, note="nothing to measure on this cell")

    class Loose(Explained):
        class Params(Analysis.Params):
            model_config = {"extra": "allow"}

    check_analysis(runtime_names(analyses, "t_explained", Explained), train={"epochs": 0})
    name = runtime_names(analyses, "t_silent", Silent)
    with pytest.raises(ConformanceError, match=r"\[analysis.rows\] status ok with a non-finite"):
        check_analysis(name, train={"epochs": 0})
    name = runtime_names(analyses, "t_loose", Loose)
    with pytest.raises(ConformanceError, match=r"\[analysis.params\] Params accepts unknown"):
        check_analysis(name)


def test_check_dataset_catches_labels_out_of_range():
    from deqbench.data.base import DATASETS, DataBundle

    def bad(n: int = 8):
        x = torch.rand(n, 3)
        y = torch.arange(n) % 5  # up to 4, but num_outputs says 3
        return DataBundle("t_bad", (x, y), (x, y), (3,), 3)

    DATASETS["t_bad"] = bad
    try:
        with pytest.raises(ConformanceError, match=r"\[dataset.bundle\] train labels span"):
            check_dataset("t_bad")
    finally:
        del DATASETS["t_bad"]


@pytest.mark.parametrize(
    "targets, why",
    [
        (lambda x: (x.sum(1, keepdim=True) > 0).long(), "train regression targets are torch.int64"),
        (lambda x: torch.where(x[:, :1] > 0.5, float("nan"), x[:, :1]), "not finite"),
    ],
)
def test_check_dataset_checks_regression_targets(targets, why):
    from deqbench.data.base import DATASETS, DataBundle

    def bad(n: int = 8):
        x = torch.rand(n, 3)
        y = targets(x)
        return DataBundle("t_badreg", (x, y), (x, y), (3,), 1, "regression")

    DATASETS["t_badreg"] = bad
    try:
        with pytest.raises(ConformanceError, match=rf"\[dataset.bundle\] .*{why}"):
            check_dataset("t_badreg")
    finally:
        del DATASETS["t_badreg"]


def test_check_dataset_accepts_image_shaped_regression_targets():
    from deqbench.data.base import DATASETS, DataBundle

    def images(n: int = 8):
        y = torch.rand(n, 1, 6, 6)
        x = y + 0.1 * torch.randn(n, 1, 6, 6)
        return DataBundle("t_images", (x, y), (x, y), (1, 6, 6), 36, "regression")

    DATASETS["t_images"] = images
    try:
        check_dataset("t_images")
    finally:
        del DATASETS["t_images"]


def test_clauses_are_distinct_from_validates():
    from deqbench.contracts import CLAUSES

    assert not set(EXTRA_CLAUSES) & set(CLAUSES)
    assert all(k.split(".")[0] in {"solver", "model", "init", "analysis", "dataset", "backward"}
               for k in EXTRA_CLAUSES)  # fmt: skip


def test_example_context_is_what_the_runner_builds():
    ctx = example_context("fc_deq_tiny", seed=3)
    assert ctx.cell_id.startswith("fc_deq_tiny-") and ctx.seed == 3
    assert ctx.data.in_shape == (64,) or ctx.data.in_shape == (1, 8, 8)
    out = ctx.evaluate("test", max_samples=8)
    assert 0.0 <= out["accuracy"] <= 1.0 and math.isfinite(out["loss"])
    with pytest.raises(ConfigError):
        example_context("fc_deq_tiny", solver={"name": "anderson", "no_such": 1})
    assert deqbench.testing.analysis_example("splitting_sweep")["model"] == "mondeq_fc_tiny"
