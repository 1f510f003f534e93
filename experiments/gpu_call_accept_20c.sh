#!/usr/bin/env bash
# One H200 call (issue 20, 2026-12-02 evening): the acceptance table with ds_in_hbm on by
# default where its dS^T buffer fits 4 GiB (the 4k cases and the 1b step's 2k x 24; 16k keeps
# the fused backward): ours, ours without it (the previous default), cuDNN and tokamax, forward
# and forward+backward pipelined, every implementation compiled first, the order turned each
# round, best of 4 rounds; then the 1b training step (batch 24), cuDNN and ours alternated,
# three rounds, one process per run.
#   OUT=$OUT bash experiments/gpu_call_accept_20c.sh    (from the repository root, .anchors/ carried)
source "$(dirname "$0")/gpu_env.sh"
timeout 300 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 10 --rounds 4 \
    --rotate --cases 11 1 4 0 2 3 --budget 280 --impls ours ours_no_ds cudnn tokamax_mosaic \
    > "$OUT/bench.log" 2>&1
grep -i "error\|deadline" "$OUT/bench.log" | head -5
fa_rows "$OUT/attention_mgpu.json"
train_1b_alternated 3
pack_out
