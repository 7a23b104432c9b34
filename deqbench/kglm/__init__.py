"""KGLM family: kernels (``kernels``), kernel logistic regression (``klr``) and the ``kglm``
analysis (``analysis``). ``deqbench.kernels`` and ``deqbench.klr`` are their public faces.
"""
