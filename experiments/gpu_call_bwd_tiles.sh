#!/usr/bin/env bash
# One H200 call (issue 20): forward+backward timed pipelined, best of 2 rounds, at 4k, 16k and
# 4k causal: ours beside ours with the dQ kernel on 128-key steps (block_kv_dq=128: wgmma N
# 128, half the steps) and cuDNN. (The committed run also timed it with the dK/dV kernel's
# ping-pong, removed after: that variant is in 197818e.)
#   OUT=$OUT bash experiments/gpu_call_bwd_tiles.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
timeout 260 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 10 --rounds 2 \
    --cases 0 2 1 --impls ours ours_dq_bk128 cudnn --budget 230 > "$OUT/fa.log" 2>&1
grep -i "error" "$OUT/fa.log" | head -5
grep -A6 "====" "$OUT/fa.log"
