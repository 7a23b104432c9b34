"""A monotone operator equilibrium network (monDEQ), standalone: it imports only torch."""

from .net import MonotoneFcNet, MonotoneLinear, PeacemanRachford, ReLU

__all__ = ["MonotoneFcNet", "MonotoneLinear", "PeacemanRachford", "ReLU"]
