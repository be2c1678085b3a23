#!/usr/bin/env bash
# One device call of `bench --phase=e2e` on the lent H200 (JAX preinstalled there), resumable across calls:
#   bash benchmarks/run_e2e.sh [--e2e_* flags]
# It copies benchmarks/e2e.json (the rows measured so far, carried in the working tree) into $OUT, runs with a
# deadline so the process ends cleanly inside the call, and leaves e2e.json/.md/.png in $OUT. After the call, copy
# those three files back into benchmarks/ before the next call. LIMIT (default 540 s) is a hard stop; DEADLINE
# (default 480 s) is when the script stops starting new measurements. JAX_COMPILATION_CACHE_DIR lets a later call on
# the same warm machine skip compiles it has done.
set -u
: "${OUT:?run on the device machine, where \$OUT is set}"
cp benchmarks/e2e.json "$OUT/" 2>/dev/null || true
export PYTHONPATH=.:${PYTHONPATH:-} JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$HOME/jaxcache} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "${LIMIT:-540}" python3 -m experiments.bench --phase=e2e --e2e_out="$OUT" --e2e_deadline_s="${DEADLINE:-480}" "$@" \
  2>&1 | grep -v "^[IW]1"
ls -la "$OUT"
