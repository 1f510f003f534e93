#!/usr/bin/env bash
# One H200 call (issue 20): the 1b training step (batch 24) profiled with cuDNN's attention and
# with ours: kernel time per kind of op and the costliest ops, to find where ours loses ~12 ms
# a step when its attention alone is level with cuDNN's at 2k causal.
#   OUT=$OUT bash experiments/gpu_call_train_1b_profile.sh
source "$(dirname "$0")/gpu_env.sh"
profile_1b 120
pack_out
