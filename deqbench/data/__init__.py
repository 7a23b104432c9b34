"""Dataset machinery (:mod:`deqbench.data.base`) and the image datasets
(:mod:`deqbench.data.images`). :mod:`deqbench.run.data` registers every built-in dataset and
re-exports these names; use ``deqbench.run.data.load_data``."""
