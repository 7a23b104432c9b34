"""KGLM family: kernels (``kernels``), the kGLM initialisations (``inits``: registered inits),
kernel logistic regression (``klr``) and the ``kglm`` analysis (``analysis``). ``deqbench.kernels`` and ``deqbench.klr`` are their public faces.
"""
