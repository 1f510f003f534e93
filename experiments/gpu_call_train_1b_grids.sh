#!/usr/bin/env bash
# One H200 call (issue 20, 2026-12-02 afternoon): the 1b step (batch 24) with cuDNN, with ours
# at today's defaults, with ours on one block per tile for the forward and dQ kernels (no
# persistent grid: does a persistent grid lose in the step, where the kernel before it still
# holds some SMs when it starts?) and with the fused 5-matmul backward, alternated twice.
#   OUT=$OUT bash experiments/gpu_call_train_1b_grids.sh    (from the repository root, .anchors/ carried)
source "$(dirname "$0")/gpu_env.sh"
for round in 1 2; do
    train_1b "cudnn_r$round"
    train_1b "pallas_r$round"
    train_1b "pallas_grid_r$round" persistent=False persistent_dq=False
    train_1b "pallas_fused_r$round" fused_bwd=True
done
pack_out
