#!/usr/bin/env bash
# One H200 call (issue 20): the Mosaic GPU kernels' tests compiled, then the FlashAttention
# forward variants (persistent grid, named-barrier ping-pong, each taken out in turn) beside
# cuDNN and tokamax in rounds, then paged decode with and without the manual barriers.
# Synchronised timing (as run on 2026-12-01).
#   OUT=$OUT bash experiments/gpu_call_mgpu_persistent.sh     (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
mgpu_tests 190
timeout 270 python3 experiments/bench_attention_mgpu.py --part fa --iters 10 --rounds 2 \
    --impls ours cudnn tokamax_mosaic ours_grid ours_mbar --budget 230 > "$OUT/fa.log" 2>&1
grep -A12 "====" "$OUT/fa.log"
timeout 120 python3 experiments/bench_attention_mgpu.py --part paged --budget 100 \
    --paged-variants default legacy bk128_st2_autobar bk64_st4 bk64_st4_autobar bk64_st5 \
    > "$OUT/paged.log" 2>&1
grep -A8 "====" "$OUT/paged.log"
