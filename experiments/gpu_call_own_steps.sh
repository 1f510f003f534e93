#!/usr/bin/env bash
# One H200 call (2026-12-02, afternoon; issue 20): the two backward kernels' new defaults,
# each consumer computing only its own rows' causal steps (`own_causal_steps`) and delta
# computed in the dQ kernel (`delta_in_dq`), beside each taken out (ours_block_steps,
# ours_xla_delta), both (ours_before_1202b) and cuDNN: the 1b step's attention (2k causal,
# batch 24 and 8), 4k with and without a mask; then the FlashAttention and sm90-lowering
# tests compiled.
#   OUT=$OUT bash experiments/gpu_call_own_steps.sh    (from the repository root, .anchors/ carried)
source "$(dirname "$0")/gpu_env.sh"
timeout 250 python3 experiments/bench_attention_mgpu.py --part fa --cases 11 10 0 1 \
    --impls ours ours_block_steps ours_xla_delta ours_before_1202b cudnn --pipelined --rounds 2 \
    --iters 10 > "$OUT/bench.log" 2>&1
tail -3 "$OUT/bench.log"
fa_rows "$OUT/attention_mgpu.json"
gpu_tests 200 fa_tests_mgpu_h200.log tests/test_flash_attention.py tests/test_mgpu_lowering.py -k "mosaic or Mosaic or persistent or lower"
