"""The paged report's writer, for serve_replay.py: `update(out_dir, section, payload)` replaces one section
("kernels" or "replay") of <out_dir>/paged.json and rewrites paged.md / paged.png. It lives in
kascade_jax/bench/paged.py (with the benchmark that writes the other section); this module only names it.
"""

from kascade_jax.bench.paged import STEM, update  # noqa: F401
