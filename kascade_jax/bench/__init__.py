"""Benchmark machinery shared by the experiments/ front ends (issue 24: benchmarks as a library)."""
