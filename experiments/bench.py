"""Kernel benchmarks against cuDNN in the same run: `python -m experiments.bench --phase=decode|prefill [flags]`.

Thin dispatcher: the decode and prefill benchmarks live in experiments/bench_decode.py and bench_prefill.py, which
define their own flags (see `--helpfull`); both take the shared `--heads=Q,KV,D`, `--num_layers`, `--num_anchors` and
`--bench_tag` of experiments/timing.py, e.g. `--phase=decode --heads=14,2,64 --num_layers=24 --bench_tag=qwen05`.
"""

from __future__ import annotations

import sys

from absl import flags

from experiments import cli

PHASE = flags.DEFINE_enum("phase", "decode", ["decode", "prefill"], "Which kernels to benchmark.")


def main(argv):
    if PHASE.value == "decode":
        from experiments import bench_decode as mod
    else:
        from experiments import bench_prefill as mod
    return mod.main(argv)


if __name__ == "__main__":
    # Import both so `--help` lists every flag.
    for name in ("experiments.bench_decode", "experiments.bench_prefill"):
        try:
            __import__(name)
        except ImportError:
            pass
    cli.run(main, argv=sys.argv)
