#!/usr/bin/env bash
# One H200 call (issue 20): the Mosaic GPU FlashAttention tests compiled (the backward
# kernels' ping-pong, dQ and dK/dV, now the default), then forward+backward timed pipelined,
# best of 2 rounds, ours beside ours with both backward kernels serial and cuDNN, at 4k, 16k
# and 4k causal.
#   OUT=$OUT bash experiments/gpu_call_pingpong_bwd.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -n 4 -q -rA \
    -p no:cacheprovider tests/test_flash_attention.py -k "Mosaic" > "$OUT/fa_tests_mgpu_h200.log" 2>&1
tail -3 "$OUT/fa_tests_mgpu_h200.log"
timeout 150 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 10 --rounds 2 \
    --cases 0 2 1 --impls ours ours_serial_bwd cudnn --budget 130 > "$OUT/fa.log" 2>&1
grep -A6 "====" "$OUT/fa.log"
