#!/usr/bin/env bash
# One H200 call (issue 20): the 1b training step (batch 24) profiled with cuDNN's attention and
# with ours: kernel time per kind of op and the costliest ops, to find where ours loses ~12 ms
# a step when its attention alone is level with cuDNN's at 2k causal.
#   OUT=$OUT bash experiments/gpu_call_train_1b_profile.sh
source "$(dirname "$0")/gpu_env.sh"
for att in cudnn pallas; do
    mkdir -p "$OUT/$att"
    timeout 120 python3 experiments/profile_train.py --preset 1b --steps 3 \
        --set train.batch_size=24 model.attention=$att --out "$OUT/$att" > "$OUT/profile_$att.log" 2>&1
    echo "$att rc $?"; tail -12 "$OUT/profile_$att.log"
done
pack_out
