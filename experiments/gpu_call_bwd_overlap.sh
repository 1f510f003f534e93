#!/usr/bin/env bash
# One H200 call (issue 20): the overlapped backward (MosaicBlockSizes.overlap_bwd: each step's
# last matmuls left in flight, their slot freed by the next step) tested compiled on every GPU
# case, then forward+backward timed pipelined, best of 2 rounds, at 4k and 16k (no mask):
# ours, overlapped, cuDNN (ours_overlap_st3, 3 tiles in flight, is in the benchmark too).
#   OUT=$OUT bash experiments/gpu_call_bwd_overlap.sh    (at fc5a864: the overlapped form was 4-8%
#   slower and is removed since; benchmarks/attention_mgpu_h200_bwd_overlap.json)
source "$(dirname "$0")/gpu_env.sh"
gpu_tests 70 overlap_tests_h200.log tests/test_flash_attention.py -k overlapped
timeout 170 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 10 --rounds 2 \
    --cases 0 2 --impls ours ours_overlap cudnn --budget 140 > "$OUT/fa.log" 2>&1
grep -i "error" "$OUT/fa.log" | head -5
grep -A6 "====" "$OUT/fa.log"
