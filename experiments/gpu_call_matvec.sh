#!/usr/bin/env bash
# One H200 call (issues 19 and 20): the Mosaic GPU matrix-vector kernel's tests compiled, with
# the decode-path tests that use it (split products' partial sums summed inside the norm and
# attention kernels); the kernel timed against XLA's product and a read-only sum over the same
# weights (350m and 1b decode shapes; kernel time from a profile, as a decode step's CUDA graph
# pays it); whole decode steps with and without it, profiled (time per kernel kind).
#   OUT=$OUT bash experiments/gpu_call_matvec.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
gpu_tests 100 matvec_tests_h200.log tests/test_matvec_mgpu.py tests/test_decode_kernels.py \
    tests/test_decode_attention_parts.py
timeout 150 python3 experiments/bench_matvec_mgpu.py --out "$OUT" --copy-bytes 128e6 --program-bytes 128e6 \
    --variants n128_kc128_st4_s1 n128_kc128_st4_s2 n64_kc256_st3 n256_kc64_st4 --budget 120 > "$OUT/matvec.log" 2>&1
grep -A20 "====" "$OUT/matvec.log"
timeout 150 python3 experiments/decode_floor.py --presets 350m 1b --batches 1 --variants fast fast_mv \
    --reps 2 --profile-all --out "$OUT" > "$OUT/decode.log" 2>&1
grep "^|" "$OUT/decode.log"
python3 - "$OUT" <<'PY'
import json, sys, glob
for f in glob.glob(sys.argv[1] + "/decode_floor_*.json"):
    for c in json.load(open(f))["cases"]:
        print(c.get("preset"), c.get("variant"), c.get("ms_per_step"), {k: round(v, 4) for k, v in c.get("profile_ms_per_step", {}).items()})
        for o in c.get("profile_top_ops", [])[:8]: print("   ", o["op"][:60], o["kind"], round(o["s"] * 1e3 / 256, 4), "ms/step")
PY
