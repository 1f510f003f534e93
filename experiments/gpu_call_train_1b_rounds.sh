#!/usr/bin/env bash
# One H200 call (issue 20): the 1b training step (batch 24) with cuDNN's attention and with
# ours, alternated for three rounds in one process-per-run call, so the ratio rests on more
# than one pair of runs.
#   OUT=$OUT bash experiments/gpu_call_train_1b_rounds.sh    (from the repository root, .anchors/ carried)
source "$(dirname "$0")/gpu_env.sh"
for round in 1 2 3; do
    for att in cudnn pallas; do
        timeout 85 python3 experiments/bench_train.py --presets 1b --steps 6 --set train.batch_size=24 \
            model.attention=$att --out "$OUT" --tag "_1b_${att}_r${round}" 2>&1 | tail -1
    done
done
pack_out
