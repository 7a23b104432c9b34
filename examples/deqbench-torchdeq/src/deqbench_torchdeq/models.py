"""Model factory ``torchdeq_deq``: any deqbench DEQ family computed by TorchDEQ.

``torchdeq_deq(base="conv_deq", core="sliced", **base_params)`` builds the deqbench model
``base`` with ``base_params`` and swaps its DEQ layers for :class:`TorchDEQLayer` around the same
cells. Built under the same seed it has the same initial parameters as ``base`` (nothing else
draws random numbers), so a suite can put ``conv_deq`` and ``torchdeq_deq`` side by side.

``torchdeq_deq(wrap=model)`` converts an existing model in place instead (parameters shared):
the *wrapper protocol* that lets an analysis compare implementations on the same trained cell
(``backward: {modes: [{name: ift, wrapper: torchdeq_deq}]}``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from deqbench.models import declare_defaults

from .layer import SOLVER_KEYS
from .layer import wrap as _wrap


# Compatibility (deqbench.contracts): the solvers with a TorchDEQ counterpart, and the backward
# modes TorchDEQ has (no unrolled); `deqbench validate` refuses other cells up front.
@declare_defaults(solvers=sorted(SOLVER_KEYS), backward_modes=("ift", "jfb", "phantom"))
def torchdeq_deq(
    in_shape: Any = (3, 32, 32),
    num_outputs: int = 10,
    base: str = "conv_deq",
    core: str = "sliced",
    wrap: nn.Module | None = None,
    **base_params: Any,
) -> nn.Module:
    """deqbench model ``base`` (built with ``base_params``) whose DEQ layers run on TorchDEQ.

    Args:
        in_shape, num_outputs: filled by the runner from the dataset (passed to ``base``).
        base: a registered deqbench model with DEQ layers.
        core: TorchDEQ core, ``sliced`` (default) or ``indexing``.
        wrap: an already built model to convert in place (then ``base`` is ignored).
        **base_params: the base factory's parameters.
    """
    if wrap is not None:
        return _wrap(wrap, core=core)
    import deqbench

    if base == "torchdeq_deq":
        from deqbench.errors import ConfigError

        raise ConfigError("torchdeq_deq: base must be a deqbench model, not torchdeq_deq")
    model = deqbench.models.create(base, in_shape=in_shape, num_outputs=num_outputs, **base_params)
    return _wrap(model, core=core)


torchdeq_deq.wraps = True  # type: ignore[attr-defined]  # accepts wrap=model (wrapper protocol)
