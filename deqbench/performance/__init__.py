"""Performance family: timing and memory (``measure``, ``memory``), gradient references
(``gradients``) and the analyses ``throughput``, ``backward``, ``solver_overhead``,
``solver_stats`` and ``unroll_compare`` with their plots (``plots``).
"""
