#!/usr/bin/env bash
# One H200 call (issue 20): the 1b training step with cuDNN's attention and with ours (Mosaic
# GPU), alternated twice in one call (batch 24, 6 steps each); JSON per run in $OUT.
#   OUT=$OUT bash experiments/gpu_call_train_1b.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
train_1b_alternated
