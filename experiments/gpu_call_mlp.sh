#!/usr/bin/env bash
# One H200 call: the persistent decode MLP kernel's tests compiled (many blocks, the grid-wide
# barrier, TMA reduce-add), then the kernel against XLA's kernels over a preset's layers.
# (Whole decode steps through it: this script in commit 328416e, with decode_floor.py's +mlp.)
#   OUT=$OUT bash experiments/gpu_call_mlp.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
gpu_tests 150 mlp_tests_h200.log tests/test_mlp_mgpu.py
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 experiments/bench_mlp_mgpu.py --out "$OUT" \
    --variants kc64_st10_r64 kc64_st10_r64_nopf kc128_st8_r32 kc128_st8_r32_nopf kc64_st12_r32 \
    --profile xla ours kc64_st10_r64 > "$OUT/mlp_bench.log" 2>&1
echo "bench exit $?"; grep -v '^{' "$OUT/mlp_bench.log" | tail -5
python3 -c '
import json, sys
for r in json.load(open(sys.argv[1]))["cases"]:
    busy = r.get("profile", {}).get("busy_us_per_layer", 0)
    print(r["preset"], r["batch"], r["impl"], round(r["us_per_layer"], 2), round(r["tbps"], 2),
          "%.1e" % r["rel_err_vs_xla"], round(busy, 2))' "$OUT/mlp_mgpu.json"
pack_out
