#!/usr/bin/env bash
# One H200 call: every Mosaic GPU kernel's tests compiled (FlashAttention forward and backward,
# paged decode, the matrix-vector kernel, their sm90 lowering), log in $OUT.
#   OUT=$OUT bash experiments/gpu_call_kernel_suite.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
kernel_suite 420
