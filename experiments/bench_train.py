"""Training throughput: tokens/s and MFU of the jitted train step for named presets.

MFU = model FLOPs (6·N per token for matmul parameters plus causal attention, see
`ModelConfig.flops_per_token`) × tokens/s ÷ peak. Two peaks: the H200 datasheet's dense bf16
989 TFLOP/s, and the bf16 matmul rate measured in the same run (an 8192³ matmul).

    python experiments/bench_train.py --presets small gpt2 350m --steps 10 --out benchmarks

Writes `train_<device>.json` to --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

from gendist.data.batches import random_batches
from gendist.presets import preset, replace
from gendist.timing import median_seconds, result_path
from gendist.training import train

DATASHEET_BF16 = 989e12  # H100/H200 SXM dense bf16 (NVIDIA datasheet)


def measured_matmul_peak(n: int = 8192, reps: int = 10) -> float:
    """bf16 matmul FLOP/s on this device (median of `reps` timed calls)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    return 2 * n ** 3 / median_seconds(jax.jit(lambda a, b: a @ b), a, b, n=reps, warm=1)


def parse_overrides(pairs: list[str]) -> dict:
    """["train.batch_size=16", "model.attention=pallas"] -> typed config overrides."""
    out = {}
    for kv in pairs:
        k, v = kv.split("=", 1)
        section, field = k.split(".")
        current = getattr(getattr(preset("tiny"), section), field)
        out[k] = v.lower() == "true" if isinstance(current, bool) else type(current)(v)
    return out


def build_bench(name: str, overrides: dict):
    """(config, setup, state, two random batches) for timing a preset's train step."""
    cfg = replace(preset(name), **overrides)
    setup = train.build(cfg)
    state = setup.init_state()
    batches = random_batches(cfg, setup.mesh)
    return cfg, setup, state, batches


def run_steps(step, state, batches, steps: int):
    """(state, last metrics, seconds per step) of `steps` calls of a compiled train step on
    alternating batches, synchronised once at the end (consecutive steps overlap, as in
    training)."""
    t0 = time.perf_counter()
    for i in range(steps):
        state, m = step(state, batches[i % 2])
    jax.block_until_ready(m)
    return state, m, (time.perf_counter() - t0) / steps


def bench_preset(name: str, overrides: dict, steps: int, warmup: int) -> dict:
    cfg, setup, state, batches = build_bench(name, overrides)
    t = cfg.train
    t0 = time.perf_counter()
    step = setup.step_fn.lower(state, batches[0]).compile()  # one compile: timed and measured
    state, m, _ = run_steps(step, state, batches, warmup)
    compile_s = time.perf_counter() - t0
    state, m, dt = run_steps(step, state, batches, steps)
    tokens = t.batch_size * t.seq_len
    flops = cfg.model.flops_per_token(t.seq_len) * tokens
    mem = step.memory_analysis()
    return {"preset": name, "params_M": cfg.model.num_params / 1e6,
            "batch": t.batch_size, "seq_len": t.seq_len, "attention": cfg.model.attention,
            "remat": cfg.model.remat, "dtype": cfg.model.dtype,
            "scan_unroll": cfg.model.scan_unroll,
            "fused_projections": cfg.model.fused_projections,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "step_s": dt,
            "tokens_per_s": tokens / dt, "model_tflops_per_s": flops / dt / 1e12,
            "mfu_datasheet": flops / dt / DATASHEET_BF16 / jax.device_count(),
            "loss": float(m["loss"]), "warmup_incl_compile_s": compile_s,
            "temp_GiB": getattr(mem, "temp_size_in_bytes", 0) / 2**30 if mem else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["small", "gpt2", "350m"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--set", nargs="*", default=[], help="overrides like train.batch_size=16")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    args = ap.parse_args()
    overrides = parse_overrides(args.set)
    dev = jax.devices()[0]
    res = {"device": dev.device_kind, "jax": jax.__version__, "num_devices": jax.device_count(),
           "overrides": overrides, "runs": []}
    if dev.platform == "gpu":
        res["matmul_bf16_tflops_measured"] = measured_matmul_peak() / 1e12
    print(res)
    for name in args.presets:
        try:
            r = bench_preset(name, overrides, args.steps, args.warmup)
        except Exception as e:  # noqa: BLE001 - report and go on to the next preset
            r = {"preset": name, "error": f"{type(e).__name__}: {str(e)[:400]}"}
        if "matmul_bf16_tflops_measured" in res and "model_tflops_per_s" in r:
            r["mfu_measured_peak"] = r["model_tflops_per_s"] / res["matmul_bf16_tflops_measured"]
        res["runs"].append(r)
        print(json.dumps(r), flush=True)
    print(f"\n{'preset':8} {'params':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6}")
    for r in res["runs"]:
        if "error" in r:
            print(f"{r['preset']:8} ERROR {r['error'][:80]}")
            continue
        print(f"{r['preset']:8} {r['params_M']:7.1f}M {r['tokens_per_s']:10.0f} "
              f"{r['model_tflops_per_s']:8.1f} {r['mfu_datasheet']:6.1%}")
    result_path(args.out, "train", args.tag).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
