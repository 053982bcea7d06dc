#!/usr/bin/env bash
# Runs the CPU test suite (GPU tests skip without CUDA); exit code 5 (nothing selected) is success.
set -uo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export TRITON_INTERPRET=1 PYTHONUNBUFFERED=1
# Two worker processes of one thread each (pytest-xdist): on CI's 2 cores the suite takes ~650 s
# instead of ~940 s in one process (workers with torch's default threads oversubscribe the cores
# and ran slower than one process). TQSERVE_TEST_WORKERS=0 runs it in this process.
# On a 2-core machine without AVX-512 (bf16 linear on F.linear): 1,642 s (877 passed) at the forty-fifth
# session's start, 1,332 s (885 passed) after the faster reference codec and the cached interpreter walk, 1,118 s
# (885 passed, forty-sixth session) with the launch's language patches reused and numpy dtypes cached.
workers=${TQSERVE_TEST_WORKERS:-2}
par=()
if [ "$workers" != 0 ] && python -c "import xdist" 2>/dev/null; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
  par=(-n "$workers")
fi
python -m pytest -q --durations=15 ${par[@]+"${par[@]}"} "$@"
rc=$?
[ $rc -eq 5 ] && rc=0
exit $rc
