#!/usr/bin/env bash
# One device call: GPU kernel tests at real sizes, then the kernel benchmark. Logs under $OUT.
set -o pipefail
source .device-carry/gpu-env.sh || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -m gpu tests/kernels/test_paged_attention.py tests/kernels/test_store_triton.py 2>&1 | tail -25 | tee "$OUT/tests.log"
python3 benchmarks/kernels.py ${BENCH_ARGS:-} --json "$OUT/kernels.json" 2>&1 | tee "$OUT/bench.log"
