#!/usr/bin/env bash
# One H200 call (issue 20, 2026-12-02 afternoon): why the 1b step with our attention is only
# level with cuDNN's when our kernels alone are ~1.1x faster at its shape: (1) energy per
# forward+backward call at that shape, ours (today's defaults, fused backward, the backward
# before own-steps/delta) against cuDNN, board power sampled; (2) the 1b step profiled at
# today's defaults with each attention (kernel time by kind).
#   OUT=$OUT bash experiments/gpu_call_energy_profile.sh    (from the repository root, .anchors/ carried)
source "$(dirname "$0")/gpu_env.sh"
timeout 150 python3 experiments/attention_energy.py --out "$OUT" 2>&1 | grep -v "^WARNING" | tail -9
profile_1b 130
pack_out
