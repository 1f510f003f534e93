#!/usr/bin/env bash
# One H200 call (2026-12-02 evening): the paged-decode and matrix-vector Mosaic GPU kernels
# compiled after they took names for profiles (`_mgpu.launch(name=...)`), with the decode paths
# that call them.
#   OUT=$OUT bash experiments/gpu_call_named_kernels.sh    (from the repository root, .anchors/ carried)
source "$(dirname "$0")/gpu_env.sh"
gpu_tests 200 named_kernels_tests_h200.log tests/test_paged_attention.py tests/test_matvec_mgpu.py \
    tests/test_decode_fast.py -k "mosaic or Mosaic or matvec or fast"
