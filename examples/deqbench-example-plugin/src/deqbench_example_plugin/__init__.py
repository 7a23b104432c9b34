"""Example deqbench plugin: a model and a solver registered through entry points."""
