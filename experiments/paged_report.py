"""The paged report's writer, for serve_replay.py: `update(out_dir, section, payload)` merges a run into one section
("kernels" or "replay") of <out_dir>/paged.json and rewrites paged.md / paged.png; `check_replay_target` refuses,
before a replay runs, a folder that holds a replay of another trace. It lives in
kascade_jax/bench/paged.py (with the benchmark that writes the other section); this module only names it.
"""

from kascade_jax.bench.paged import STEM, check_replay_target, update  # noqa: F401
