#!/usr/bin/env bash
# One H200 call (issue 20): the Mosaic GPU kernel tests compiled, FlashAttention beside cuDNN
# and tokamax with the fused backward (dQ by TMA reduce-add in the dK/dV kernel) as a variant
# (pipelined, 2 rounds), the 1b train step cuDNN vs ours x2. As run on 2026-12-01 the fused
# backward was the default ("ours") and the two-kernel form the variant: the same pair.
#   OUT=$OUT bash experiments/gpu_call_fused_bwd.sh     (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
mgpu_tests 160
timeout 170 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 20 --rounds 2 \
    --impls ours cudnn tokamax_mosaic ours_fused_bwd --budget 140 > "$OUT/fa.log" 2>&1
grep -A12 "====" "$OUT/fa.log"
train_1b_alternated
