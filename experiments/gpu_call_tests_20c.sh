#!/usr/bin/env bash
# One H200 call (issue 20, 2026-12-02 evening): the FlashAttention and sm90-lowering tests
# compiled with ds_in_hbm on by default (head dim 128 where its dS^T buffer fits 4 GiB).
#   OUT=$OUT bash experiments/gpu_call_tests_20c.sh    (from the repository root, .anchors/ carried)
source "$(dirname "$0")/gpu_env.sh"
gpu_tests 420 fa_tests_mgpu_h200_1202c.log tests/test_flash_attention.py tests/test_mgpu_lowering.py \
    -k "mosaic or Mosaic or persistent or lower"
