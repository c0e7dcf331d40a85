"""Tools the training runtime never imports: benchmarks and simulations, each a `python -m` command."""
