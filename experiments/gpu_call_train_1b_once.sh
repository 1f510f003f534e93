#!/usr/bin/env bash
# One short H200 call: the 1b step (batch 24), cuDNN then ours, one round (what device time was left).
#   OUT=$OUT bash experiments/gpu_call_train_1b_once.sh
source "$(dirname "$0")/gpu_env.sh"
for att in cudnn pallas; do
    timeout 60 python3 experiments/bench_train.py --presets 1b --steps 8 --set train.batch_size=24 \
        model.attention=$att --out "$OUT" --tag "_1b_${att}" 2>&1 | tail -1
done
