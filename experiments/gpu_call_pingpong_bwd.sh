#!/usr/bin/env bash
# One H200 call (issue 20): the Mosaic GPU FlashAttention tests compiled (with the backward
# kernels' ping-pong, MosaicBlockSizes.pingpong_dq / pingpong_dkv, among them), then
# forward+backward timed pipelined, best of 2 rounds, ours beside ours with the ping-pong in
# the dQ kernel and in both backward kernels and cuDNN, at 4k, 16k and 4k causal.
#   OUT=$OUT bash experiments/gpu_call_pingpong_bwd.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
gpu_tests 120 fa_tests_mgpu_h200.log tests/test_flash_attention.py -k Mosaic
timeout 230 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 10 --rounds 2 \
    --cases 0 2 1 --impls ours ours_pingpong_dq ours_pingpong_bwd cudnn --budget 200 > "$OUT/fa.log" 2>&1
grep -A6 "====" "$OUT/fa.log"
