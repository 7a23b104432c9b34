"""deqbench plugin: TorchDEQ 0.1.0's solvers and IFT backward, registered through deqbench's
entry points (``deqbench.solvers``: ``torchdeq_anderson``, ``torchdeq_broyden``,
``torchdeq_fixed_point``; ``deqbench.models``: ``torchdeq_deq``)."""

from .layer import TorchDEQLayer, wrap
from .solvers import torchdeq_anderson, torchdeq_broyden, torchdeq_fixed_point

__version__ = "0.1.0"
__all__ = ["TorchDEQLayer", "wrap", "torchdeq_anderson", "torchdeq_broyden", "torchdeq_fixed_point"]
