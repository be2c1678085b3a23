"""Benchmark machinery (what is timed, how runs are stored and resumed, tables and plots) behind the experiments/
benchmark front ends."""
