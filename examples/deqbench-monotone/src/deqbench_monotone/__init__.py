"""deqbench adapter of the standalone ``monotone_net`` package (which is left unchanged)."""
