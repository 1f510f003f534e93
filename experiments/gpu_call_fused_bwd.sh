#!/usr/bin/env bash
# One H200 call (issue 20): the Mosaic GPU kernel tests compiled, FlashAttention beside cuDNN
# and tokamax with the fused backward (dQ by TMA reduce-add in the dK/dV kernel) as a variant
# (pipelined, 2 rounds), the 1b train step cuDNN vs ours x2. As run on 2026-12-01 the fused
# backward was the default ("ours") and the variant was ours_two_kernel_bwd: the same pair.
#   OUT=$OUT bash experiments/gpu_call_fused_bwd.sh     (from the repository root)
set -u
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .anchors/wheels/*.whl > "$OUT/pip.log" 2>&1
export PYTHONPATH=/tmp/site:.anchors/stubs:.
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout 160 python3 -m pytest -n 4 -q -rA \
    -p no:cacheprovider tests/test_flash_attention.py tests/test_paged_attention.py \
    -k "mosaic or Mosaic or linearly" > "$OUT/kernel_tests_mgpu_h200.log" 2>&1
tail -4 "$OUT/kernel_tests_mgpu_h200.log"
timeout 170 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 20 --rounds 2 \
    --impls ours cudnn tokamax_mosaic ours_fused_bwd --budget 140 > "$OUT/fa.log" 2>&1
grep -A12 "====" "$OUT/fa.log"
for round in 1 2; do
    for att in cudnn pallas; do
        timeout 70 python3 experiments/bench_train.py --presets 1b --steps 6 --set train.batch_size=24 \
            model.attention=$att --out "$OUT" --tag "_1b_${att}_r${round}" 2>&1 | tail -1
    done
done
