#!/usr/bin/env bash
# One H200 call: every Mosaic GPU kernel's tests compiled (FlashAttention forward and backward,
# paged decode, the matrix-vector kernel, their sm90 lowering), log in $OUT.
#   OUT=$OUT bash experiments/gpu_call_kernel_suite.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
gpu_tests 420 kernel_tests_mgpu_h200.log tests/test_flash_attention.py tests/test_paged_attention.py \
    tests/test_matvec_mgpu.py tests/test_mgpu_lowering.py -k "mosaic or Mosaic or linearly or matvec or lower"
