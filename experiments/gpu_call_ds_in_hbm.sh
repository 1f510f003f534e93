#!/usr/bin/env bash
# One H200 call (issue 20, 2026-12-02 evening): the backward through dS in global memory
# (`MosaicBlockSizes.ds_in_hbm`: the dK/dV kernel stores dS^T, a memory-bound kernel then
# computes dQ = dS K): its tests compiled; each attention kernel's device time at the 1b
# step's shape, alone and after ~20 ms of matmuls, against today's defaults and cuDNN; the
# 1b step (batch 24) with cuDNN, ours, and ours with ds_in_hbm, alternated twice.
#   OUT=$OUT bash experiments/gpu_call_ds_in_hbm.sh    (from the repository root, .anchors/ carried)
source "$(dirname "$0")/gpu_env.sh"
gpu_tests 150 ds_tests_h200.log tests/test_flash_attention.py -k "ds_in_hbm or custom_sm_scale"
timeout 200 python3 experiments/attention_in_step.py --impls ours ours_ds cudnn \
    --settings alone after_matmul --rounds 2 --out "$OUT" 2>&1 | grep -v "^WARNING" | tail -13
for round in 1 2; do
    train_1b "cudnn_r$round"
    train_1b "pallas_r$round"
    train_1b "pallas_ds_r$round" ds_in_hbm=True
done
pack_out
