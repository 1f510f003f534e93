#!/usr/bin/env bash
# One H200 call (issue 20, not yet run): the 1b training step (batch 24) with cuDNN's attention
# and with ours, alternated twice, under XLA's default command buffers and with them off
# (XLA_FLAGS=--xla_gpu_enable_command_buffer=): 2026-12-02's profile ran ours at 660.1 ms a
# step with them off against 672.6 ms with them on (two calls), cuDNN not run off.
#   OUT=$OUT bash experiments/gpu_call_train_1b_cmdbuf.sh
source "$(dirname "$0")/gpu_env.sh"
for flags in "" "--xla_gpu_enable_command_buffer="; do
    tag=$([ -z "$flags" ] && echo cmdbuf || echo nocmdbuf)
    for round in 1 2; do
        for att in cudnn pallas; do
            XLA_FLAGS=$flags timeout 75 python3 experiments/bench_train.py --presets 1b --steps 6 \
                --set train.batch_size=24 model.attention=$att --out "$OUT" \
                --tag "_1b_${att}_${tag}_r${round}" 2>&1 | tail -1
        done
    done
done
pack_out
