"""Benchmarks of memstrata (run with `python -m bench.<name>`; results in `bench/results/`)."""
