#!/usr/bin/env bash
# One H200 call (issue 20): the Mosaic GPU kernels' tests compiled, then the FlashAttention
# forward variants (persistent grid, named-barrier ping-pong, each taken out in turn) beside
# cuDNN and tokamax in rounds, then paged decode with and without the manual barriers.
#   OUT=$OUT bash experiments/gpu_call_mgpu_persistent.sh     (from the repository root)
set -u
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .anchors/wheels/*.whl > "$OUT/pip.log" 2>&1
export PYTHONPATH=/tmp/site:.anchors/stubs:.
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
git log -1 --format=%H > "$OUT/head.txt" 2>/dev/null
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout 190 python3 -m pytest -n 4 -q -rA \
    -p no:cacheprovider tests/test_flash_attention.py tests/test_paged_attention.py \
    -k "mosaic or Mosaic or linearly" > "$OUT/kernel_tests_mgpu_h200.log" 2>&1
tail -3 "$OUT/kernel_tests_mgpu_h200.log"
timeout 270 python3 experiments/bench_attention_mgpu.py --part fa --iters 10 --rounds 2 \
    --impls ours cudnn tokamax_mosaic ours_grid ours_mbar --budget 230 > "$OUT/fa.log" 2>&1
grep -A12 "====" "$OUT/fa.log"
timeout 120 python3 experiments/bench_attention_mgpu.py --part paged --budget 100 \
    --paged-variants default legacy bk128_st2_autobar bk64_st4 bk64_st4_autobar bk64_st5 \
    > "$OUT/paged.log" 2>&1
grep -A8 "====" "$OUT/paged.log"
