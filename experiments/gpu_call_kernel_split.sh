#!/usr/bin/env bash
# One H200 call (issue 20, 2026-12-02 evening): each attention kernel's device time alone, after
# ~20 ms of matmuls, and inside the 1b step (batch 24), ours and cuDNN's, now that our
# kernels carry their own names in a profile (flash_attention_{fwd,bwd_dq,bwd_dkv}).
#   OUT=$OUT bash experiments/gpu_call_kernel_split.sh    (from the repository root, .anchors/ carried)
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active \
    --format=csv -lms 100 > "$OUT/smi.csv" 2>&1 &
SMI=$!
phase() { echo "$(date +%s.%N) $*" >> "$OUT/phases.txt"; echo "== $*"; }
phase attention_in_step
timeout 170 python3 experiments/attention_in_step.py --impls ours cudnn --settings alone after_matmul \
    --rounds 2 --out "$OUT" 2>&1 | grep -v "^WARNING" | tail -10
phase profile_1b
profile_1b 120
kill $SMI
pack_out
