#!/usr/bin/env bash
# Kernel speed at the Qwen attention shapes (issue 17 item 3), CUPTI vs cuDNN in the same run, on an otherwise idle
# H200: decode at batch 8 and 32 (Top-k 10, 15, 20%: the decode_topk_frac candidates), prefill at batch 1 (10%), 16K
# and 32K. Output: OUTDIR/{decode,prefill}_qwen*.
# `bench_shapes.sh OUTDIR rerank` times the decode_rerank lever's price instead (issue 21; needs no model): plain
# Kascade and C = 2, 4 (every reuse layer reranks, through the strategy's path, and only the 5 worst:
# decode_rerank_worst) at batch 32, 16K/32K, Top-k 10%, into OUTDIR/decode_qwen*_rr.*. `bench_shapes.sh OUTDIR
# pool` times the selection pools gqa (Kascade) and all (all_heads_pooled) through the strategy, into
# OUTDIR/decode_qwen*_pool.*; `bench_shapes.sh OUTDIR pool 0.1,0.2,0.3 poolk` the same at those decode budgets
# (the dps_all_dec* candidates), into OUTDIR/decode_qwen*_poolk.* (first in the report's --speed_bench decode list:
# its plain rows at 0.2 and 0.3 are then measured, not scaled from 10%). `bench_shapes.sh OUTDIR mgpu [CONTEXTS]`
# A/Bs the anchor layers on the Mosaic GPU passes (`--prefill_sweep=anchor_backend=mgpu`, both checked at 8K first)
# against Triton at the three shapes, 32K and 128K, batch 1, into OUTDIR/prefill_sweep_{qwen05,qwen15,llama8b}_mgpu.*.
# `bench_shapes.sh OUTDIR short [SETTINGS]` times the anchors with the short-row select (`--decode_short_select`,
# default 0,32768: the four-launch select and the short one up to 32K keys) at both Qwen shapes, 16K/32K, batch 8/32,
# pool all, into OUTDIR/decode_qwen*_short.* (checked on the GPU first: --decode_check).
# `bench_shapes.sh OUTDIR fp8 [FRACS]` times the anchor on an fp8 copy of K (`--decode_score_fp8`, checked first) at
# both Qwen shapes, 16K/32K, batch 32, Top-k 10/20/30%, into OUTDIR/decode_qwen*_fp8.*; `fp8f16` the same with the
# float16 variant beside it (`--decode_fp8_f16`: DecodeTuning.stream_fp8_f16), into OUTDIR/decode_qwen*_fp8f16.*.
set -u
OUTDIR=${1:?output dir}
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=$HOME/jaxcache
if [ "${2:-}" = mgpu ]; then  # issue 22: the anchor layer on the Triton vs the Mosaic GPU passes, like for like
  for shape in "qwen05_mgpu 14,2,64 24" "qwen15_mgpu 12,2,128 28" "llama8b_mgpu 32,8,128 32"; do
    read -r tag heads layers <<< "$shape"
    python3 -m experiments.bench --phase=prefill --heads=$heads --num_layers=$layers --num_anchors=5 \
      --bench_tag=$tag --prefill_contexts= --prefill_long_contexts= --prefill_check \
      --prefill_sweep=anchor_backend=mgpu --prefill_sweep_contexts=${3:-32768,131072} --prefill_iterations=3 \
      --prefill_out="$OUTDIR" 2>&1 | grep -v "^[IW]1" | tail -n 16
  done
  exit 0
fi
if [ "${2:-}" = pool ]; then  # Kascade's per-KV-head selection vs all_heads_pooled's shared set, like for like
  fracs=${3:-0.1}; suffix=${4:-pool}
  for shape in "qwen05_$suffix 14,2,64 24" "qwen15_$suffix 12,2,128 28"; do
    read -r tag heads layers <<< "$shape"
    python3 -m experiments.bench --phase=decode --heads=$heads --num_layers=$layers --num_anchors=5 \
      --bench_tag=$tag --decode_contexts=16384,32768 --decode_batches=32 --decode_topk_fracs=$fracs \
      --decode_pools=gqa,all --decode_iterations=5 --decode_check=false \
      --decode_out="$OUTDIR" 2>&1 | grep -v "^[IW]1" | tail -n 16
  done
  exit 0
fi
if [ "${2:-}" = short ]; then  # issue 22 item 3: the short-row select vs the four-launch one, same run (pool all)
  for shape in "qwen05_short 14,2,64 24" "qwen15_short 12,2,128 28"; do
    read -r tag heads layers <<< "$shape"
    python3 -m experiments.bench --phase=decode --heads=$heads --num_layers=$layers --num_anchors=5 \
      --bench_tag=$tag --decode_contexts=16384,32768 --decode_batches=8,32 --decode_topk_fracs=0.1 \
      --decode_pools=all --decode_short_select=${3:-0,32768} --decode_iterations=5 \
      --decode_out="$OUTDIR" 2>&1 | grep -v "^[IW]1" | tail -n 30
  done
  exit 0
fi
if [ "${2:-}" = fp8 ] || [ "${2:-}" = fp8f16 ]; then  # issue 22 / 21: the anchors' scores from an fp8 K copy
  f16=""; [ "$2" = fp8f16 ] && f16=--decode_fp8_f16  # (--decode_score_fp8), same run; fp8f16: also widened to f16
  for shape in "qwen05 14,2,64 24" "qwen15 12,2,128 28"; do
    read -r tag heads layers <<< "$shape"
    python3 -m experiments.bench --phase=decode --heads=$heads --num_layers=$layers --num_anchors=5 \
      --bench_tag=${tag}_$2 --decode_contexts=16384,32768 --decode_batches=32 --decode_topk_fracs=${3:-0.1,0.2,0.3} \
      --decode_score_fp8 $f16 --decode_iterations=5 --decode_out="$OUTDIR" 2>&1 | grep -v "^[IW]1" | tail -n 30
  done
  exit 0
fi
if [ "${2:-}" = rerank ]; then
  for shape in "qwen05_rr 14,2,64 24" "qwen15_rr 12,2,128 28"; do
    read -r tag heads layers <<< "$shape"
    python3 -m experiments.bench --phase=decode --heads=$heads --num_layers=$layers --num_anchors=5 \
      --bench_tag=$tag --decode_contexts=16384,32768 --decode_batches=32 --decode_topk_fracs=0.1 \
      --decode_reranks=2,4 --decode_rerank_worst=5 --decode_iterations=5 --decode_check=false \
      --decode_out="$OUTDIR" 2>&1 | grep -v "^[IW]1" | tail -n 24
  done
  exit 0
fi
for shape in "qwen05 14,2,64 24" "qwen15 12,2,128 28"; do
  read -r tag heads layers <<< "$shape"
  python3 -m experiments.bench --phase=decode --heads=$heads --num_layers=$layers --num_anchors=5 --bench_tag=$tag \
    --decode_contexts=16384,32768 --decode_batches=8,32 --decode_topk_fracs=0.1,0.15,0.2 --decode_iterations=5 \
    --decode_check=false --decode_out="$OUTDIR" 2>&1 | grep -v "^[IW]1" | tail -n 12
  python3 -m experiments.bench --phase=prefill --heads=$heads --num_layers=$layers --num_anchors=5 --bench_tag=$tag \
    --prefill_contexts=16384,32768 --prefill_long_contexts= --prefill_topk_fracs=0.1 --prefill_iterations=3 \
    --prefill_out="$OUTDIR" 2>&1 | grep -v "^[IW]1" | tail -n 12
done
