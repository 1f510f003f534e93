#!/usr/bin/env bash
# One H200 call: the decode chain megakernel's per-layer critical path from its own stamps
# (experiments/trace_chain.py: 350m and 1b, norms and attention at position POS).
#   OUT=$OUT bash experiments/gpu_call_chain_trace.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TRACE_S:-200} python3 experiments/trace_chain.py \
    --pos ${POS:-160} --out "$OUT" ${TRACE_ARGS:-} 2>&1 | grep -v "^WARNING\|^I0000" | tail -24
