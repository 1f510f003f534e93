#!/usr/bin/env bash
# The GPU measurements behind benchmarks/*.md, one topic a run, from a checkout of this
# repository on a machine with one H200 (two for `pipeline`, `collectives`, `two_gpu`):
#
#   bash experiments/run_gpu.sh TOPIC [OUT]        # OUT: where the JSON/PNG go (default /tmp/gendist_TOPIC)
#
# TOPIC             what runs                                                      page
#   tests           the GPU tests of the Mosaic GPU kernels, the decode kernels and  -
#                   the float8 transpose
#   chain_tests     the decode megakernel against its reference, every option      -
#   attention       FlashAttention fwd / fwd+bwd: ours, cuDNN, tokamax               benchmarks/attention.md
#   attention_step  our attention's kernels alone and after matmuls; energy a call  benchmarks/attention.md
#   paged           paged decode attention against the read-only bandwidth         benchmarks/paged_decode.md
#   decode          the path `generate` takes and each path's speed; batch-1 decode benchmarks/decode.md
#                   steps: megakernel and fast path vs the floor;
#                   where a megakernel layer's time goes (trace); what a step
#                   runs besides the kernel (timeline)
#   handovers       the megakernel's weight tiles in flight (loads), in whole steps  benchmarks/decode.md
#   decode_long     megakernel against fast path after long prompts (auto's limit;  benchmarks/decode.md
#                   attention splits, att_splits)
#   decode_greedy   greedy steps inside the megakernel (steps=N) against a call a step:  benchmarks/decode.md
#                   its GPU tests, then 350m and Llama-3.2-1B's shape in whole steps
#   decode_seams    the seams between greedy steps traced (350m, 16 steps a launch) benchmarks/decode.md
#                   and a greedy call's device time by kernel kind (profile)
#   decode_prompt   a greedy call whole: the prompt's kernels, the loop, the host's  benchmarks/decode.md
#                   launch around them; then 350m and Llama-3.2-1B's shape in whole steps
#   handovers_trace loads traced: the ring's free slots against the default (each    benchmarks/decode.md
#                   reader's wait after its sources), and the chain without its RMSNorms
#   decode_tune     the megakernel's product splits searched in whole steps     benchmarks/decode.md
#                   (PRESETS="llama3.2-1b 350m": which; OPTIONS="tiles=2": every
#                   candidate's further options; prints the plan.MEASURED entry)
#   train           the 1b training step, cuDNN's attention and ours alternated    benchmarks/training.md
#   fp8             FP8 against bf16 training: step speed, FP8 GEMMs, 1000-step loss benchmarks/training.md
#                   (and the float8 transpose kernel against XLA's transpose)
#   serving         continuous batching vs static batching on one request trace    benchmarks/serving.md
#   speculative     speculative decoding, 1b target, batch 1, over the megakernel  benchmarks/speculative.md
#                   (KERNEL_STATE=1: the megakernel's state kept between steps;
#                   ALSO_OPTIONS=stacked: each row also compiled with the megakernel's XLA options)
#   pipeline        1F1B in phases on two GPUs against one GPU                     benchmarks/pipeline.md
#   collectives     NCCL collectives' bus bandwidth over all GPUs                  benchmarks/collectives.md
#   two_gpu         every parallel form on two GPUs beside one GPU                 -
#
# Peers: tokamax comes from the package index (`pip install -e ".[peers]"`); without it the
# benchmarks print one line and skip that peer. The machine's jax must have its CUDA plugin
# (`pip install -e ".[gpu]"`). Each run prints its table and writes its JSON under OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
TOPIC=${1:?usage: bash experiments/run_gpu.sh TOPIC [OUT] (topics: see the head of this file)}
OUT=${2:-/tmp/gendist_$TOPIC}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}

"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
"$PY" -c "import tokamax" 2>/dev/null || echo "tokamax not installed: its rows are skipped (pip install -e '.[peers]')"

train_1b() {  # train_1b ATTENTION ROUND: one run of the 1b step (batch 24, 6 steps), own process
    "$PY" experiments/bench_train.py --presets 1b --steps 6 --set train.batch_size=24 \
        model.attention="$1" --out "$OUT" --tag "_1b_$1_r$2"
}

case "$TOPIC" in
tests)
    JAX_PLATFORMS=cuda "$PY" -m pytest -n 4 -q -rA -p no:cacheprovider \
        tests/test_flash_attention.py tests/test_paged_attention.py tests/test_mgpu_lowering.py \
        -k "mosaic or Mosaic or linearly or lower"
    JAX_PLATFORMS=cuda "$PY" -m pytest -q -rA -p no:cacheprovider \
        tests/test_decode_kernels.py tests/test_megakernel_decode.py
    JAX_PLATFORMS=cuda "$PY" -m pytest -q -rA -p no:cacheprovider tests/test_fp8.py -k kernel ;;
chain_tests)
    # -v: a line a test as it ends, so a run cut short still says which passed and which failed
    JAX_PLATFORMS=cuda "$PY" -m pytest -v -rA -p no:cacheprovider tests/test_chain_mgpu.py -k gpu
    # the decode front door through the kernel itself (on a CPU these run its XLA reference)
    JAX_PLATFORMS=cuda "$PY" -m pytest -v -rA -p no:cacheprovider tests/test_megakernel_decode.py \
        "tests/test_speculative.py::test_greedy_with_a_megakernel_draft_equals_plain_greedy" ;;
attention)
    # compiled first, the order turned each round, best of 4 rounds; ours_no_ds: the backward
    # without dS in global memory (the form at 16k, where dS would exceed its 4 GiB cap)
    OUT=$OUT "$PY" experiments/bench_attention_mgpu.py --part fa --pipelined --iters 10 --rounds 4 \
        --rotate --cases 11 1 4 0 2 3 --impls ours ours_no_ds cudnn tokamax_mosaic ;;
attention_step)
    "$PY" experiments/attention_in_step.py --impls ours ours_ds cudnn --settings alone after_matmul \
        --rounds 2 --out "$OUT"
    "$PY" experiments/attention_energy.py --out "$OUT" ;;
paged)
    OUT=$OUT "$PY" experiments/bench_attention_mgpu.py --part paged --pipelined --paged-rounds 2 \
        --paged-variants default bk128_st2_streamonly ;;
decode)
    "$PY" experiments/decode_paths.py --out "$OUT"
    "$PY" experiments/head_kernel.py --out "$OUT"
    # chain+fresh: the kernel's words fresh each step (the output layer inside the kernel from
    # 32k tokens); +state: its state kept between steps (+fused+state: and the output layer
    # inside at any vocabulary); chain@inflight=N: N tensor-core products left running before a ring slot
    # is freed; chain@blocks=N: a grid of N blocks (fewer sources a handover at 350m)
    "$PY" experiments/decode_floor.py --presets llama3.2-1b 1b 350m --batches 1 --reps 3 --out "$OUT" \
        --variants chain+fresh chain+state chain+fused+state fast chain@inflight=2+state chain@inflight=3+state \
        --extra 350m:1:chain@blocks=66+state 350m:1:chain@blocks=100+state
    "$PY" experiments/trace_chain.py --spare auto --pos 160 --inflight 1 2 3 --out "$OUT"
    "$PY" experiments/trace_chain.py --presets llama3.2-1b --pos 160 --vocab 128256 --state 0 1 --out "$OUT/head"
    "$PY" experiments/decode_step_timeline.py --presets 1b 350m llama3.2-1b --kernel-state 0 1 --out "$OUT" ;;
handovers)
    JAX_PLATFORMS=cuda "$PY" -m pytest -v -rA -p no:cacheprovider tests/test_chain_mgpu.py -k "scheduling_options"
    # chain: the defaults (plan.default_loads weight tiles in flight); loads=0: as many as the ring's free slots
    "$PY" experiments/decode_floor.py --presets llama3.2-1b 1b 350m --batches 1 --reps 3 --out "$OUT" \
        --variants chain chain@loads=0 chain@loads=2 chain@loads=4 chain@loads=6 fast ;;
decode_long)
    # after a 1,984- and a 960-token prompt: the megakernel unsplit (att_splits=1: 16 greedy
    # steps a launch), its default (`megakernel.att_splits_for`: split from 1,024 positions),
    # 4 and 8 splits and its attention blocks uncapped, against the fast path, where
    # `megakernel.LONGEST_CONTEXT` draws auto's line
    JAX_PLATFORMS=cuda "$PY" -m pytest -v -rA -p no:cacheprovider tests/test_chain_mgpu.py -k "split_attention"
    for P in 1984 960; do
        "$PY" experiments/decode_floor.py --presets 350m 1b llama3.2-1b --batches 1 --reps 2 --prompt $P \
            --new-tokens 64 --variants chain@att_splits=1 chain chain@att_splits=4 chain@att_splits=8 \
            chain@att_loads=0 fast --out "$OUT/prompt$P"
    done ;;
decode_greedy)
    # the tokens, cache and x_L of N steps a call against one-step calls; then in whole steps
    JAX_PLATFORMS=cuda "$PY" -m pytest -v -rA -p no:cacheprovider tests/test_chain_greedy.py \
        tests/test_megakernel_decode.py -k "greedy_steps"
    "$PY" experiments/decode_floor.py --presets 350m llama3.2-1b --batches 1 --reps 3 --out "$OUT" \
        --variants chain chain+fused+state chain+fused+state+steps4 chain+fused+state+steps8 \
        chain+fused+state+steps16 fast ;;
decode_seams)
    # each seam between greedy steps (the head, the choice, layer 0's input) against a layer;
    # then what a 256-token call spends outside the kernel (the prompt's forward, the idle)
    "$PY" experiments/trace_chain.py --presets 350m --vocab 256 --state 1 --steps 16 --calls 4 --out "$OUT"
    rm -f "$OUT"/*.npy
    "$PY" experiments/decode_floor.py --presets 350m --batches 1 --reps 3 --profile --out "$OUT" \
        --variants chain fast ;;
decode_prompt)
    # a default greedy call whole (the prompt's kernels, the loop, the host around them), then
    # the megakernel and the fast path in whole steps
    "$PY" experiments/decode_step_timeline.py --presets 350m --whole-generate 1 0 --out "$OUT"
    "$PY" experiments/decode_floor.py --presets 350m llama3.2-1b --batches 1 --reps 3 --out "$OUT" \
        --variants chain fast ;;
handovers_trace)
    # a picture and the raw stamps a case: more files than a device run brings back, so they travel as one tgz
    T=$(mktemp -d)
    "$PY" experiments/trace_chain.py --presets 350m 1b llama3.2-1b --pos 160 --loads 0 auto --out "$T"
    # without the RMSNorms: is down's slow poll the norm factor's (every reader polls the same words)?
    "$PY" experiments/trace_chain.py --presets 350m llama3.2-1b --pos 160 --norms 0 --out "$T/nonorms"
    cp "$T/trace_chain.json" "$OUT/" && tar czf "$OUT/handovers_trace.tgz" -C "$T" . ;;
decode_tune)
    # one preset a call fits the 10-minute limit: ~20 candidates of ~7 s (compile + 256 tokens)
    for p in ${PRESETS:-llama3.2-1b}; do
        "$PY" experiments/tune_chain_splits.py --preset "$p" --rounds 1 --alternatives 2 ${OPTIONS:+--options "$OPTIONS"} --out "$OUT"
    done ;;
train)
    for round in 1 2 3; do train_1b cudnn "$round"; train_1b pallas "$round"; done ;;
serving)
    "$PY" experiments/serve_trace.py --preset 350m --requests 200 --rate 50 --max-len 1024 \
        --max-prompt 256 --budget-seqs 16 --slots 64 --page-size 64 --systems engine static engine_sync \
        --out "$OUT" ;;
speculative)
    "$PY" experiments/speculative_speedup.py --target 1b --steps 1100 --seq-len 256 --batch-size 32 \
        --draft-width 1024 --draft-layers 2 --draft-round-steps 300 --draft-rounds 5 --gammas 6 8 10 12 \
        --batches 1 --temperatures 0 1 --prompts-b1 8 --new-tokens 128 --tag _1b ${KERNEL_STATE:+--kernel-state} \
        ${ALSO_OPTIONS:+--also-options $ALSO_OPTIONS} \
        --out "$OUT" ;;
pipeline)
    "$PY" experiments/pipeline_speed.py --variants one_gpu pp2_1f1b-phased_m16 \
        pp2_1f1b-phased_m16_b96_savemm pp2_1f1b-phased_m16_b128_savemm --out "$OUT" ;;
collectives)
    "$PY" experiments/collectives_bandwidth.py --out "$OUT" ;;
two_gpu)
    "$PY" experiments/two_gpu_table.py --out "$OUT" ;;
fp8)
    "$PY" experiments/fp8_transpose.py --out "$OUT"
    "$PY" experiments/fp8_training.py --shapes 1b 8b-layers-4 --out "$OUT" ;;
*)
    echo "unknown topic '$TOPIC' (see the head of experiments/run_gpu.sh)" >&2; exit 2 ;;
esac
echo "results in $OUT:"; ls "$OUT"
