"""Evaluation tasks: real RULER (`ruler`, NVIDIA's generators and data), the built-in RULER-style generators
(`synthetic`), LongBench v1, AIME-24, and their metrics.

Each task yields plain dict samples (`task`, `input` = the exact prompt text, `answers`, `metric`,
`max_new_tokens`, ...) so the harness in `kascade_jax.evaluate` treats every family alike.
"""
