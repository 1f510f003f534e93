#!/usr/bin/env bash
# One H200 call (issue 20, 2026-12-02 afternoon): the 1b step (batch 24) with cuDNN, with ours
# at today's defaults, with ours on one block per tile for the forward and dQ kernels (no
# persistent grid: does a persistent grid lose in the step, where the kernel before it still
# holds some SMs when it starts?) and with the fused 5-matmul backward, alternated twice.
#   OUT=$OUT bash experiments/gpu_call_train_1b_grids.sh    (from the repository root, .anchors/ carried)
source "$(dirname "$0")/gpu_env.sh"
common=(--presets 1b --steps 6 --out "$OUT" --set train.batch_size=24)
for round in 1 2; do
    timeout 85 python3 experiments/bench_train.py "${common[@]}" model.attention=cudnn \
        --tag "_1b_cudnn_r$round" 2>&1 | tail -1
    timeout 85 python3 experiments/bench_train.py "${common[@]}" model.attention=pallas \
        --tag "_1b_pallas_r$round" 2>&1 | tail -1
    timeout 85 python3 experiments/bench_train_blocks.py persistent=False persistent_dq=False -- \
        "${common[@]}" model.attention=pallas --tag "_1b_pallas_grid_r$round" 2>&1 | tail -1
    timeout 85 python3 experiments/bench_train_blocks.py fused_bwd=True -- \
        "${common[@]}" model.attention=pallas --tag "_1b_pallas_fused_r$round" 2>&1 | tail -1
done
pack_out
