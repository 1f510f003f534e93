#!/usr/bin/env bash
# Every GPU measurement of issue 19 in one run on one H200 (jax 0.11.2); the parts' time
# limits add up to 540 s:
#   1. decode_floor.py   plain greedy decoding against the memory floor (350m, 1b; batch 1/8/64;
#                        the fused decode kernels and, at batch 1 and 64, the path before them)
#   2. serve_trace.py    continuous batching (engine) vs static batching at one KV budget
#   3. speculative_speedup.py   speculative decoding on the fast path, target clearly better
# Each part has a hard time limit and writes its JSON after every case, so a part cut short
# still leaves its figures. Files under $OUT (6): decode_floor_*.json, serve_trace_*.json/.png,
# speculative_*.json/.png, issue19_log.txt.
#
#   OUT=/tmp/out bash experiments/decode_gpu_suite.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/issue19}"
mkdir -p "$OUT"
{
  date
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv || true
  python3 -c "import jax; print(jax.__version__, jax.devices())"
  echo "== 1. decode floor"
  timeout 130 python3 experiments/decode_floor.py --presets 350m 1b --batches 1 8 64 \
      --extra 350m:1:fast_unfused 1b:1:fast_unfused 1b:64:fast_unfused --profile \
      --budget-s 100 --out "$OUT"
  echo "== 2. serving trace"
  timeout 90 python3 experiments/serve_trace.py --preset 350m --requests 200 --rate 50 \
      --max-len 1024 --max-prompt 256 --budget-seqs 16 --slots 64 --page-size 64 --out "$OUT"
  echo "== 3. speculative decoding"
  timeout 320 python3 experiments/speculative_speedup.py --target 1b --steps 1100 \
      --seq-len 256 --batch-size 32 --draft-width 1024 --draft-layers 2 \
      --draft-round-steps 300 --draft-rounds 5 --gammas 4 --adaptive --batches 1 8 \
      --temperatures 0 1 --prompts-b1 2 --new-tokens 128 --budget-s 290 --tag _1b --out "$OUT"
  date
} 2>&1 | tee "$OUT/issue19_log.txt"
