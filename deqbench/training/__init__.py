"""Training-dynamics family: the ``metrics`` and ``family_stats`` analyses (per epoch), with
their plots.
"""
