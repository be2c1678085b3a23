"""Decode-attention benchmark of the Kascade kernels against cuDNN dense decode, in the paper's Table 3 layout.

`python -m experiments.bench --phase=decode [--decode_* flags]`, or `python -m experiments.bench_decode`.
Rows: dense, A0 (anchor layer 0: dense output + scores + top-k), A (anchor: scores + top-k + sparse), R (reuse),
their ratios to dense, and the weighted Kascade time (1*A0 + (M-1)*A + (L-M)*R) / L with its speedup, for the
`--heads` shape and layer mix (default Llama-3.1-8B: (1*A0 + 4*A + 27*R) / 32). Writes <out>/decode.md/json/png, or
decode_<tag>.* with `--bench_tag` (required at any other shape or layer mix, so the default tables are never
overwritten by one). The measurement is kascade_jax/bench/decode.py; this parses the flags. Needs a GPU.
"""

from __future__ import annotations

from absl import app, flags

from experiments import cli
from experiments.timing import BENCH_TAG, shape_from_flags

CONTEXTS = flags.DEFINE_list("decode_contexts", ["8192", "16384", "32768", "65536", "131072"], "Cache lengths.")
BATCHES = flags.DEFINE_list("decode_batches", ["8", "64"], "Batch sizes.")
FRACS = flags.DEFINE_list("decode_topk_fracs", ["0.1", "0.2", "0.3"], "Top-k fractions.")
DTYPES = flags.DEFINE_list("decode_dtypes", ["bfloat16"], "Cache dtypes (bfloat16, float16).")
MIN_K = flags.DEFINE_integer("decode_min_k", 128, "Minimum Top-k budget.")
ITERS = flags.DEFINE_integer("decode_iterations", 10, "CUPTI iterations per measurement (median reported).")
CHECK = flags.DEFINE_boolean("decode_check", True, "Check the kernels against the references first.")
OUT = flags.DEFINE_string("decode_out", "benchmarks", "Output folder for decode[_<bench_tag>].md/json/png.")
RERANKS = flags.DEFINE_list("decode_reranks", [], "Also time the decode_rerank lever with these C (e.g. 2,4): "
                            "A0/A/R through the strategy, every reuse layer reranking, and its weighted speedup.")
WORST = flags.DEFINE_integer("decode_rerank_worst", 0, "With --decode_reranks: also time each C with only this many "
                             "reuse layers reranking (the recipe lever decode_rerank_worst): the anchors' candidate "
                             "ordering, a reranking layer and a non-reranking one, weighted over the layer mix. 0: off.",
                             lower_bound=0)
POOLS = flags.DEFINE_list("decode_pools", [], "Also time these selection pools through the strategy (gqa: Kascade's "
                          "per-KV-head selection, all: all_heads_pooled's one set for every head), e.g. gqa,all: "
                          "A0/A/R and the weighted speedup of each, like for like.")
SHORT = flags.DEFINE_list("decode_short_select", [], "Also time the anchors (A0, A) with each of these "
                          "DecodeTuning.short_select_max N (rows of <= N keys, padded to a power of two, take the "
                          "one-launch short select; 0: the four-launch pipeline), e.g. 0,32768, each at every "
                          "--decode_pools pool (else gqa), rows keyed ss<value>_<pool>. A value may add wW "
                          "(short_select_warps), dD (short_select_digit) and rR (short_select_rows: at most R rows "
                          "of batch x selection heads take it) and c (fused_combine: the split-K combine as one "
                          "launch; R is then re-timed too), e.g. 16384w16d2, 32768r1024, 32768c.")
TUNING = flags.DEFINE_string("decode_tuning", "", "DecodeTuning overrides, 'field=value,...' (e.g. "
                             "stream_block=256,stream_warps=8): every row's tuning, recorded in the table's header; "
                             "needs --bench_tag, so that the default tables are never overwritten by a variant.")
SCORE_FP8 = flags.DEFINE_boolean("decode_score_fp8", False, "Also time the anchor (A) scoring keys from an fp8 copy of "
                                "K widened to bf16 (the recipe lever decode_score_fp8; the copy is made outside the "
                                "timing, as the cache keeps it): A_fp8, weighted and speedup with the row's A0 and R; "
                                "the checks compare it with its reference. Tag the run (--bench_tag).")
FP8_F16 = flags.DEFINE_boolean("decode_fp8_f16", False, "With --decode_score_fp8, also time the anchor with the copy "
                               "widened to float16 against a float16 q (DecodeTuning.stream_fp8_f16: one conversion "
                               "per two values instead of three; the kernels' default): A_fp8f16, weighted and speedup, "
                               "after its own check.")
REUSE_SWEEP = flags.DEFINE_string("decode_reuse_sweep", "", "Also time A and R at each of these reuse kernel "
                                   "tunings, ';'-separated DecodeTuning overrides of reuse_block / reuse_splits / "
                                   "reuse_warps / reuse_stages (e.g. 'reuse_splits=10;reuse_splits="
                                   "20;reuse_block=128,reuse_warps=8'), each checked first; needs --bench_tag.")
MAX_GB = flags.DEFINE_float("decode_max_cache_gb", 80.0, "Skip shapes whose K+V caches exceed this (GB).")


cli.number_list("decode_contexts", "int", "8192,32768")
cli.number_list("decode_batches", "int", "8,64")
cli.number_list("decode_topk_fracs", "frac", "0.1,0.2")


@flags.validator("decode_reranks", message="--decode_reranks takes integers >= 2 (the candidates per key), e.g. 2,4")
def _check_reranks(values):
    return all(str(v).strip().isdigit() and int(v) >= 2 for v in values)


@flags.validator("decode_pools", message="--decode_pools takes gqa, all or pre_softmax, e.g. gqa,all")
def _check_pools(values):
    from kascade_jax.config import POOLS  # noqa: PLC0415  (here, so that importing the flags stays jax-free)

    return all(v in POOLS for v in values)


@flags.validator("decode_short_select", message="--decode_short_select takes N[wW][dD][rR][c] with N 0 or a power "
                 "of two <= 65536, W a power of two <= 32, D 1-3, R >= 1, c: the fused combine, e.g. "
                 "0,32768,16384w16d2,32768r1024,32768c")
def _check_short_select(values):
    if not values:
        return True
    from kascade_jax.bench.decode import short_select_tuning  # noqa: PLC0415  (imports jax: only when given)

    try:
        for v in values:
            short_select_tuning(v)
    except ValueError:
        return False
    return True


def main(argv):
    del argv
    if WORST.value and not RERANKS.value:
        raise app.UsageError("--decode_rerank_worst needs --decode_reranks (the C values to time)")
    if TUNING.value.strip() and not BENCH_TAG.value:
        raise app.UsageError("--decode_tuning needs --bench_tag (the table's file names do not say the tuning)")
    if REUSE_SWEEP.value.strip() and not BENCH_TAG.value:
        raise app.UsageError("--decode_reuse_sweep needs --bench_tag (the default tables hold the plain rows)")
    if FP8_F16.value and not SCORE_FP8.value:
        raise app.UsageError("--decode_fp8_f16 times a variant of the fp8 rows: it needs --decode_score_fp8")
    if SCORE_FP8.value and not BENCH_TAG.value:
        raise app.UsageError("--decode_score_fp8 needs --bench_tag (the default tables hold the plain rows)")
    from kascade_jax.bench import decode
    from kernels_pallas import decode as dec

    try:
        tuning = dec.tuning_from_string(TUNING.value)
    except ValueError as e:
        raise app.UsageError(f"--decode_tuning: {e}") from None
    try:
        reuse_sweep = decode.reuse_tunings(REUSE_SWEEP.value, tuning)
    except ValueError as e:
        raise app.UsageError(f"--decode_reuse_sweep: {e}") from None

    decode.run([int(c) for c in CONTEXTS.value], [int(b) for b in BATCHES.value], [float(f) for f in FRACS.value],
               DTYPES.value, min_k=MIN_K.value, iters=ITERS.value, do_check=CHECK.value, out_dir=OUT.value,
               max_cache_gb=MAX_GB.value, tuning=tuning,
               shape=shape_from_flags(), tag=BENCH_TAG.value, reranks=[int(c) for c in RERANKS.value],
               rerank_worst=WORST.value, pools=list(POOLS.value), short_selects=list(SHORT.value),
               score_fp8=SCORE_FP8.value, score_fp8_f16=FP8_F16.value,
               reuse_sweep=reuse_sweep)


if __name__ == "__main__":
    cli.run(main)
