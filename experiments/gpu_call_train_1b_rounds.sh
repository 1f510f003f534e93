#!/usr/bin/env bash
# One H200 call (issue 20): the 1b training step (batch 24) with cuDNN's attention and with
# ours, alternated for three rounds in one process-per-run call, so the ratio rests on more
# than one pair of runs.
#   OUT=$OUT bash experiments/gpu_call_train_1b_rounds.sh    (from the repository root, .anchors/ carried)
source "$(dirname "$0")/gpu_env.sh"
train_1b_alternated 3
pack_out
