"""Training metrics: train/test loss and accuracy (classification) or MSE (regression) per epoch,
and PSNR (dB) and SSIM where the regression targets are images.

Rows (analysis ``metrics``), ``step`` = epoch (0 = before training when ``train.eval_before``):
``loss``, ``accuracy`` or ``mse`` (and ``psnr``, ``ssim`` for image-shaped regression targets:
:mod:`deqbench.core.image_metrics`; evaluation passes only), variant ``train`` (epoch 0: an evaluation pass over the
train set; later epochs: the mean over the epoch's training batches, in train mode) and ``test``
(an evaluation pass over the test set).

Example:
    >>> from deqbench.training.metrics import metric_rows
    >>> [r.metric for r in metric_rows({"loss": 0.3, "accuracy": 0.9}, "test", step=1)]
    ['loss', 'accuracy']
"""

from __future__ import annotations

from collections.abc import Mapping

from ..analyses.base import Analysis, CellContext, EpochInfo, Row
from ..core.registry import analyses

#: the metrics of an evaluation pass: loss, accuracy (classification) or mse (regression); psnr
#: and ssim where the regression targets are images (deqbench.core.image_metrics)
METRICS = ("loss", "accuracy", "mse", "psnr", "ssim")
UNITS = {"accuracy": "fraction", "psnr": "dB"}


def metric_rows(stats: Mapping[str, float], variant: str, step: int | None = None) -> list[Row]:
    """Rows for the loss/accuracy/MSE entries of an :func:`deqbench.core.evaluation.evaluate` dict."""
    return [
        Row(k, stats[k], variant=variant, step=step, unit=UNITS.get(k, ""))
        for k in METRICS
        if k in stats
    ]


@analyses.register("metrics")
class MetricsAnalysis(Analysis):
    """Train/test loss and accuracy (or MSE) per epoch."""

    name = "metrics"
    version = "1"

    def on_epoch(self, ctx: CellContext, info: EpochInfo):
        return metric_rows(info.train, "train", info.epoch) + metric_rows(
            info.test, "test", info.epoch
        )
