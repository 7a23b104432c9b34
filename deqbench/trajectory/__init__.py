"""Trajectory family: the ``trajectory`` analysis (``analysis``) and its plots (``plots``)."""
