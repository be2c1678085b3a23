"""Prefill-attention benchmark of the Kascade kernels against cuDNN causal flash attention, Table 3 layout.

`python -m experiments.bench --phase=prefill [--prefill_* flags]`, or `python -m experiments.bench_prefill`.
Rows: dense, A0, A, R, their ratios, the weighted Kascade time (1*A0 + (M-1)*A + (L-M)*R)/L and its speedup for the
`--heads` shape and layer mix, plus the anchor pipeline's extra device memory. Writes <out>/prefill.md/json/png, or
prefill_<tag>.* with `--bench_tag` (required at any other shape or layer mix). `--prefill_tuning="field=value,..."`
sets the kernels' PrefillTuning; `--prefill_sweep="spec;spec;..."` A/Bs tuning variants on top of it and writes
<out>/prefill_sweep[_<tag>].md/json; with `--prefill_contexts= --prefill_long_contexts=` only the sweep runs.
The measurement is kascade_jax/bench/prefill.py; this parses the flags. Needs a GPU.
"""

from __future__ import annotations

from absl import flags

from experiments import cli
from experiments.timing import BENCH_TAG, shape_from_flags

CONTEXTS = flags.DEFINE_list("prefill_contexts", ["8192", "32768", "131072"], "Prompt lengths.")
LONG = flags.DEFINE_list("prefill_long_contexts", ["262144"], "Prompt lengths timed at the first top-k and dtype only.")
FRACS = flags.DEFINE_list("prefill_topk_fracs", ["0.1"], "Top-k fractions.")
DTYPES = flags.DEFINE_list("prefill_dtypes", ["bfloat16"], "dtypes (bfloat16, float16).")
MIN_K = flags.DEFINE_integer("prefill_min_k", 128, "Minimum Top-k budget.")
TILE = flags.DEFINE_integer("prefill_tile_size", 32, "Query tile size.")
ITERS = flags.DEFINE_integer("prefill_iterations", 5, "CUPTI iterations per measurement (median reported).")
CHECK = flags.DEFINE_boolean("prefill_check", False, "Check the kernels against the references at 8K first "
                              "(the --prefill_tuning and each --prefill_sweep variant).")
OUT = flags.DEFINE_string("prefill_out", "benchmarks", "Output folder for prefill[_<bench_tag>].md/json/png.")
TUNE = flags.DEFINE_integer("prefill_tune", 0, "If > 0: first time the tuning variants at this context and use the "
                            "fastest setting of each kernel for the table.")
TUNING = flags.DEFINE_string("prefill_tuning", "", "PrefillTuning overrides, 'field=value,...': the table's tuning "
                             "(on top of the defaults, or of the --prefill_tune result) and the --prefill_sweep base.")
SWEEP = flags.DEFINE_string("prefill_sweep", "", "Tuning variants to A/B, ';'-separated 'field=value,...' specs, "
                            "each applied on top of --prefill_tuning and timed against it at --prefill_sweep_contexts "
                            "(bf16, first top-k); writes <out>/prefill_sweep[_<bench_tag>].{md,json}. Only the "
                            "kernels a variant touches are re-timed.")
SWEEP_CONTEXTS = flags.DEFINE_list("prefill_sweep_contexts", ["32768"], "Contexts of the --prefill_sweep.")
KEY_BLOCK = flags.DEFINE_enum("prefill_key_block", "1", ["1", "8", "16", "32", "64"],
                              "The anchors select aligned blocks of this many keys (1: single keys); on Hopper the "
                              "reuse runs prefill_mgpu.reuse_blocks (reuse_backend=auto; =triton: the Triton reuse). "
                              "Tag the run (--bench_tag): the table's file names do not say it.")
SCORE_FP8 = flags.DEFINE_boolean("prefill_score_fp8", False, "The anchors other than layer 0 score keys from fp8 "
                                 "copies of q and the mean-centred k (the recipe lever prefill_score_fp8; on fp8 in "
                                 "the Mosaic GPU passes, the default on Hopper: anchor_backend=auto). Tag the run.")

for _name, _kind, _example in (("prefill_contexts", "int", "8192,32768"), ("prefill_long_contexts", "int", "262144"),
                               ("prefill_topk_fracs", "frac", "0.1,0.2"), ("prefill_sweep_contexts", "int", "32768")):
    cli.number_list(_name, _kind, _example)


def main(argv):
    del argv
    from kascade_jax.bench import prefill

    prefill.run([int(c) for c in CONTEXTS.value], [float(f) for f in FRACS.value], list(DTYPES.value),
                long_contexts=[int(c) for c in LONG.value], min_k=MIN_K.value, tile=TILE.value, iters=ITERS.value,
                out_dir=OUT.value, check_first=CHECK.value, tune_at=TUNE.value, tuning_spec=TUNING.value,
                sweep_specs=[x for x in SWEEP.value.split(";") if x.strip()],
                sweep_contexts=[int(c) for c in SWEEP_CONTEXTS.value], shape=shape_from_flags(), tag=BENCH_TAG.value,
                key_block=int(KEY_BLOCK.value), score_fp8=SCORE_FP8.value)


if __name__ == "__main__":
    cli.run(main)
