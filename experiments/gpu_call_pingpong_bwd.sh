#!/usr/bin/env bash
# One H200 call (issue 20): the Mosaic GPU FlashAttention tests compiled (the dK/dV kernel's
# ping-pong, MosaicBlockSizes.pingpong_dkv, among them), then forward+backward timed
# pipelined, best of 2 rounds, ours beside ours with the dK/dV ping-pong and cuDNN, at 4k,
# 16k and 4k causal. (The committed `attention_mgpu_h200_pingpong_bwd.json` timed the dQ
# kernel's ping-pong too, variants ours_pingpong_dq / ours_pingpong_bwd, removed after: 92d21ed.)
#   OUT=$OUT bash experiments/gpu_call_pingpong_bwd.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
gpu_tests 200 fa_tests_mgpu_h200.log tests/test_flash_attention.py -k Mosaic
timeout 230 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 10 --rounds 2 \
    --cases 0 2 1 --impls ours ours_pingpong_dkv cudnn --budget 200 > "$OUT/fa.log" 2>&1
grep -A6 "====" "$OUT/fa.log"
