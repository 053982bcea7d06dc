#!/usr/bin/env bash
# One device call for the hybrid models: GDN kernel + engine GPU tests, then the engine-level benchmark.
set -o pipefail
source .device-carry/gpu-env.sh || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -m gpu tests/kernels/test_gdn_gpu.py tests/engine/test_hybrid_engine_gpu.py 2>&1 | tail -25 | tee "$OUT/tests.log"
PYTHONPATH="$PYTHONPATH:$PWD/tests" python3 benchmarks/hybrid_bench.py --kv-cache-dtype auto tq4 --out "$OUT/hybrid.json" ${BENCH_ARGS:-} 2>&1 \
  | grep -v "is deprecated\|return forward_call" | tee "$OUT/bench.log"
