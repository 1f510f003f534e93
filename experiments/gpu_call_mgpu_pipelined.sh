#!/usr/bin/env bash
# One H200 call (issue 20), timings pipelined (n calls back to back, one sync): FlashAttention
# (ours, its variants, cuDNN, tokamax) in 3 rounds; paged decode tilings; the 1b train step
# with cuDNN and with our attention, alternated twice.
#   OUT=$OUT bash experiments/gpu_call_mgpu_pipelined.sh     (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
timeout 260 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 20 --rounds 3 \
    --impls ours cudnn tokamax_mosaic ours_grid ours_bwd_autobar --budget 225 > "$OUT/fa.log" 2>&1
grep -A12 "====" "$OUT/fa.log"
timeout 110 python3 experiments/bench_attention_mgpu.py --part paged --pipelined --budget 90 \
    --paged-variants default legacy bk128_st2_autobar bk64_st4 bk64_st4_autobar bk64_st5 \
    > "$OUT/paged.log" 2>&1
grep -A8 "====" "$OUT/paged.log"
train_1b_alternated
