"""Splitting family: the ``splitting_sweep`` analysis (forward-backward vs Peaceman-Rachford on
a monDEQ), with its plot.
"""
