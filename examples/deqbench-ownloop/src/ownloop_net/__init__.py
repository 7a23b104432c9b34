"""ownloop_net: a small implicit conv classifier that knows nothing of deqbench.

It stands for a third-party network as people write them: conv layers with normalisation, its
own fixed-point loop (damped Picard iteration with a relative-residual stop) and its own
Jacobian-free backward (one differentiable application of the map at the fixed point, Fung et
al. 2022). ``deqbench_ownloop`` adapts it without editing this package.
"""

from .net import ImplicitConvNet

__all__ = ["ImplicitConvNet"]
