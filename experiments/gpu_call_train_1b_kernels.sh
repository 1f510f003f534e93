#!/usr/bin/env bash
# One H200 call (issue 20): our attention kernels alone at the 1b training shape (2k causal, D 128,
# batch 24) beside cuDNN, profiled per kernel, then the 1b training step with ours profiled with
# XLA's command buffers off, so that each kernel keeps its HLO name (forward, dQ, dK/dV).
#   OUT=$OUT bash experiments/gpu_call_train_1b_kernels.sh
source "$(dirname "$0")/gpu_env.sh"
mkdir -p "$OUT/bench" "$OUT/train"
OUT=$OUT/bench timeout 90 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 10 \
    --rounds 2 --cases 11 --profile --impls ours cudnn > "$OUT/fa.log" 2>&1
fa_rows "$OUT/bench/attention_mgpu.json"
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 110 python3 experiments/profile_train.py --preset 1b \
    --steps 3 --set train.batch_size=24 model.attention=pallas --out "$OUT/train" > "$OUT/profile.log" 2>&1
echo "profile rc $?"; grep -E "step|mosaic|mpmd|attention" "$OUT/profile.log" | head -12
pack_out
