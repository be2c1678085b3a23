"""Benchmarks against cuDNN in the same run: `python -m experiments.bench --phase=decode|prefill|e2e [flags]`.

Thin dispatcher: the decode and prefill benchmarks live in experiments/bench_decode.py and bench_prefill.py, which
define their own flags (see `--helpfull`); both take the shared `--heads=Q,KV,D`, `--num_layers`, `--num_anchors` and
`--bench_tag` of experiments/timing.py, e.g. `--phase=decode --heads=14,2,64 --num_layers=24 --bench_tag=qwen05`.
`--phase=e2e` (experiments/bench_e2e.py, `--e2e_*` flags) times the whole model: TTFT and decode ms/step, on one GPU
or on a `--mesh=data:D,model:M` of several (experiments/devices.py; the kernel phases ignore --mesh).
"""

from __future__ import annotations

import sys

from absl import flags

from experiments import cli, devices  # noqa: F401  (devices: --mesh / --distributed, defined before parsing)

PHASE = flags.DEFINE_enum("phase", "decode", ["decode", "prefill", "e2e"],
                          "Which benchmark: decode or prefill kernels, or e2e (the whole model: TTFT and decode steps, "
                          "experiments/bench_e2e.py).")


def main(argv):
    if PHASE.value != "e2e" and devices.MESH.value:
        raise ValueError(f"--mesh={devices.MESH.value} is for --phase=e2e; the {PHASE.value} kernel benchmark runs on "
                         f"one device")
    if PHASE.value == "decode":
        from experiments import bench_decode as mod
    elif PHASE.value == "e2e":
        from experiments import bench_e2e as mod
    else:
        from experiments import bench_prefill as mod
    return mod.main(argv)


if __name__ == "__main__":
    # Import both so `--help` lists every flag.
    for name in ("experiments.bench_decode", "experiments.bench_prefill", "experiments.bench_e2e"):
        try:
            __import__(name)
        except ImportError:
            pass
    cli.run(main, argv=sys.argv)
