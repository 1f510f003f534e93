"""Where a training step's time goes: device time and FLOPs split by kind of op.

Set against the lecture's figure (Ivanov et al. 2021, "Data Movement Is All You Need":
tensor contractions are 99.8% of a BERT layer's FLOPs but 61% of its runtime).

    python experiments/profile_train.py --preset 1b --set train.batch_size=16 --out $OUT

Compiles the step, maps every HLO instruction to a kind (`gendist.profiling.classify_hlo`),
traces a few steps with `jax.profiler`, sums kernel time per kind and writes
`profile_<preset>_<device>.json` (with the 40 costliest ops) and prints a table. FLOPs per
kind are the model's: 6 per matmul parameter per token, and causal attention's
(`ModelConfig.flops_per_token`); elementwise work is under 1% of FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import DATASHEET_BF16, build_bench, parse_overrides, run_steps  # noqa: E402

from gendist import profiling  # noqa: E402


def _hlo_flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        return float(cost.get("flops", 0.0)) or None
    except Exception:  # noqa: BLE001 - cost analysis is optional information
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--set", nargs="*", default=[], help="overrides like train.batch_size=16")
    ap.add_argument("--steps", type=int, default=3, help="traced steps")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    ap.add_argument("--trace-dir", default="", help="also export the trace here (xprof)")
    args = ap.parse_args()

    cfg, setup, state, batches = build_bench(args.preset, parse_overrides(args.set))
    # Run the very program that is classified (a second compile could name ops otherwise).
    compiled = setup.step_fn.lower(state, batches[0]).compile()
    kinds = profiling.classify_hlo(compiled.as_text())
    state, _, _ = run_steps(compiled, state, batches, 2)  # warm-up
    state, _, step_s = run_steps(compiled, state, batches, args.steps)
    with profiling.trace(args.trace_dir or None) as prof:
        run_steps(compiled, state, batches, args.steps)
    split = profiling.time_by_kind(prof.profile_data, kinds)

    mc, t = cfg.model, cfg.train
    tokens = t.batch_size * t.seq_len
    matmul_flops = 6.0 * mc.num_matmul_params_per_token * tokens
    total_flops = mc.flops_per_token(t.seq_len) * tokens
    attn_flops = total_flops - matmul_flops
    per_step = {k: v / args.steps for k, v in split["seconds"].items()}
    kernel_s = split["total_s"] / args.steps
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "preset": args.preset, "overrides": args.set, "tokens_per_step": tokens,
           "step_s": step_s, "kernel_s_per_step": kernel_s,
           "mfu_datasheet": total_flops / step_s / DATASHEET_BF16,
           "seconds_per_step": per_step, "time_fraction": split["fraction"],
           "flops": {"matmul": matmul_flops, "attention": attn_flops,
                     "hlo_cost_analysis_total": _hlo_flops(compiled)},
           "flop_fraction": {"matmul": matmul_flops / total_flops,
                             "attention": attn_flops / total_flops},
           "achieved_tflops": {
               "matmul": matmul_flops / per_step["matmul"] / 1e12 if per_step["matmul"] else None,
               "attention": (attn_flops / per_step["attention"] / 1e12
                             if per_step["attention"] else None)},
           "top_ops": [dict(o, s=o["s"] / args.steps) for o in split["top_ops"]]}
    print(f"{args.preset} {args.set}: step {step_s * 1e3:.1f} ms, kernels "
          f"{kernel_s * 1e3:.1f} ms, MFU {res['mfu_datasheet']:.1%}")
    print(f"{'kind':15} {'ms/step':>8} {'time':>6} {'FLOPs':>6}")
    for k in profiling.KINDS:
        ff = res["flop_fraction"].get(k)
        print(f"{k:15} {per_step[k] * 1e3:8.1f} {split['fraction'][k]:6.1%} "
              f"{'' if ff is None else f'{ff:6.1%}'}")
    print("achieved TFLOP/s:", {k: v and round(v, 1) for k, v in res["achieved_tflops"].items()})
    for o in res["top_ops"][:15]:
        print(f"  {o['s'] * 1e3:7.2f} ms  {o['kind']:14} {o['op']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = res["device"].replace(" ", "_").lower()
    (out / f"profile_{args.preset}_{tag}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
