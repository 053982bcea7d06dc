#!/usr/bin/env bash
# One device call: GPU engine tests, then the engine benchmarks. Logs go to $OUT.
# Needs .device-carry (whl, model part1, gpu-env.sh) and /tmp/carry/part0 from the previous call.
source .device-carry/gpu-env.sh || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
python3 -m pytest -q -x -m gpu tests/engine/test_gpu_engine.py tests/engine/test_hybrid_engine_gpu.py 2>&1 | tail -30 | tee $OUT/gpu_tests.log
python3 -m tqserve.cli bench throughput --batch 1 16 --new-tokens 128 --json $OUT/throughput.json 2>&1 | grep -v INFO | tee $OUT/throughput.log
python3 -m tqserve.cli bench throughput --batch 64 --prompt-len 4096 --new-tokens 32 --skip-transformers \
  --kv-cache-dtype auto tq4 turboquant_4bit_nc --json $OUT/decode64x4k.json 2>&1 | grep -v INFO | tee $OUT/decode64x4k.log
