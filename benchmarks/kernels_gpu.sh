#!/usr/bin/env bash
# One device call: GPU kernel tests at real sizes (a timeout per file: the whole set compiles for more
# than 5 minutes), the decode A/B of the sliced kernel (CUDA-graph replays), then the kernel benchmark.
# Logs under $OUT. KERNEL_TESTS / BENCH_ARGS / AB_ARGS override the parts.
set -o pipefail
source .device-carry/gpu-env.sh || exit 1
export PYTHONPATH="$PWD/tests:$PWD/benchmarks:$PYTHONPATH"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
# Tests run in TEST_WORKERS processes (pytest-xdist, in the device image): the time goes to compiling, on
# the CPU. The whole of test_paged_decode ran past 240 and 300 s in one process on an H100 (twenty-second
# session); test_store_triton -m gpu takes 38-45 s with 8 workers (twenty-fourth session).
# test_paged_attention's real-size extend cases build torch references of several GB: with 8 processes on one
# H100, test_extend_gpu_real_sizes[tq3-64-8-128] ran out of memory once (twenty-fifth session; alone it
# passes), so that file takes ATTN_TEST_WORKERS.
for f in ${KERNEL_TESTS:-test_paged_decode test_float32_models test_paged_attention test_paged_fuzz test_store_triton}; do
  workers=${TEST_WORKERS:-8}
  [ "$f" = test_paged_attention ] && workers=${ATTN_TEST_WORKERS:-4}
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -n "$workers" -m "gpu or not gpu" "tests/kernels/$f.py" -p no:cacheprovider 2>&1 \
    | grep -vE "^[.s]+ *(\[ *[0-9]+%\])?$" | tail -12 | tee "$OUT/tests_$f.log"
done
timeout 240 python3 benchmarks/decode_ab.py --no-checks --graphs --lookups shfl ${AB_ARGS:-} --json "$OUT/decode_ab.json" \
  2>&1 | grep -v Warn | tee "$OUT/decode_ab.log"
python3 benchmarks/kernels.py ${BENCH_ARGS:-} --json "$OUT/kernels.json" 2>&1 | tee "$OUT/bench.log"
