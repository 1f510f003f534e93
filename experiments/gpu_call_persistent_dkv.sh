#!/usr/bin/env bash
# One H200 call (2026-12-02, morning): the dK/dV kernel on the persistent schedule (pairs of
# one head's key blocks when causal: ours_dkv_persistent) beside one block per key block (ours,
# the default since it measured slower) and the dQ kernel's grid (ours_dq_grid), and cuDNN, at the 1b step's
# attention (2k causal, batch 24 and 8), 2k and 4k without a mask and 4k causal; the 1b step,
# cuDNN and ours alternated twice; the FlashAttention kernel tests compiled.
# Run at 7b34ace, when persistent dK/dV was the default ("ours") and "ours_dkv_grid" the grid.
#   OUT=$OUT bash experiments/gpu_call_persistent_dkv.sh    (from the repository root, .anchors/ carried)
source "$(dirname "$0")/gpu_env.sh"
timeout 170 python3 experiments/bench_attention_mgpu.py --part fa --cases 11 10 8 1 \
    --impls ours ours_dkv_persistent ours_dq_grid cudnn --pipelined --rounds 2 --iters 10 > "$OUT/bench.log" 2>&1
tail -2 "$OUT/bench.log"
fa_rows "$OUT/attention_mgpu.json"
train_1b_alternated
gpu_tests 230 fa_tests_mgpu_h200.log tests/test_flash_attention.py tests/test_mgpu_lowering.py -k "mosaic or Mosaic or persistent or lower"
