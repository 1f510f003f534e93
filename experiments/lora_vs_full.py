"""LoRA fine-tuning against full fine-tuning of one preset in the same run: tokens/s, peak
device memory, and the training state's bytes against theory.

Theory (ZeRO stage 0, one device): full fine-tuning keeps fp32 master weights and AdamW's m
and v, 12 bytes a parameter (Rajbhandari et al. 2020, section 3.1: "K = 12" for mixed-precision
Adam, the fp16 copy aside); LoRA (Hu et al. 2021) keeps those 12 bytes for each adapter
parameter only, and the frozen base in train.lora_base_dtype (2 bytes a parameter in bf16), with
no gradient or optimizer state for it. Each mode runs in its own process (the device's peak
memory is per process) on the same random batches:

    python experiments/lora_vs_full.py --preset 1b --rank 16 --steps 6 --out benchmarks

Writes lora_vs_full_<device>.json to --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

TARGETS = "q,k,v,o,gate,up,down"


def one_mode(args) -> dict:
    import jax

    from gendist.data.batches import random_batches
    from gendist.presets import preset, replace
    from gendist.training import lora, train

    over = {"train.batch_size": args.batch, "train.zero_stage": 0, "mesh.data": 1}
    if args.seq_len:
        over["train.seq_len"] = args.seq_len
    if args.tiny:  # a CPU check of this script: the preset's kind, tiny shapes
        over.update({"model.d_model": 64, "model.num_layers": 2, "model.num_heads": 2,
                     "model.num_kv_heads": 2, "model.head_dim": 32, "model.d_ff": 128,
                     "model.scan_unroll": 1, "model.attention": "xla",
                     "model.max_seq_len": 64, "train.seq_len": 64})
    if args.mode == "lora":
        over.update({"train.lora_rank": args.rank, "train.lora_alpha": 2.0 * args.rank,
                     "train.lora_targets": TARGETS, "train.lora_base_dtype": "bfloat16"})
    cfg = replace(preset(args.preset), **over)
    setup = train.build(cfg)
    state = setup.init_state()
    t = cfg.train
    batches = random_batches(cfg, setup.mesh)
    t0 = time.perf_counter()
    step = setup.step_fn.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    ma = step.memory_analysis()
    for i in range(args.warmup):
        state, m = step(state, batches[i % 2])
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    losses = []
    for i in range(args.steps):
        state, m = step(state, batches[i % 2])
        losses.append(m["loss"])
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t0) / args.steps
    def nbytes(tree):
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    trainable = sum(x.size for x in jax.tree.leaves(state["params"]))
    n_model = cfg.model.num_params
    stats = jax.devices()[0].memory_stats() or {}
    out = {
        "mode": args.mode, "preset": args.preset, "params": n_model, "trainable": trainable,
        "batch": t.batch_size, "seq_len": t.seq_len, "compile_s": compile_s, "step_s": dt,
        "tokens_per_s": t.batch_size * t.seq_len / dt,
        "losses": [float(x) for x in jax.device_get(losses)],
        "bytes": {
            "trained params (fp32)": nbytes(state["params"]),
            "optimizer state": nbytes(state["opt_state"]),
            "frozen base": nbytes(state.get("base", {})),
        },
        "theory_bytes": {
            "trained params + m + v (12 B each)": 12 * trainable,
            "frozen base (bf16 matrices, fp32 vectors)": sum(
                math.prod(x.shape) * (2 if len(x.shape) >= 2 else 4)
                for x in jax.tree.leaves(state["base"])) if "base" in state else 0,
        },
        "compiled": {"argument_bytes": ma.argument_size_in_bytes,
                     "temp_bytes": ma.temp_size_in_bytes,
                     "output_bytes": ma.output_size_in_bytes,
                     "alias_bytes": ma.alias_size_in_bytes},
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "device": jax.devices()[0].device_kind, "jax": jax.__version__,
    }
    if args.mode == "lora":
        out["lora"] = {"rank": args.rank, "alpha": 2.0 * args.rank, "targets": TARGETS,
                       "adapter_params": sum(math.prod(s.shape) for s in jax.tree.leaves(
                           lora.shapes(cfg.model, cfg.train)))}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=0, help="0: the preset's")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU check)")
    ap.add_argument("--mode", choices=["full", "lora"], help="run one mode (a child process)")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    args = ap.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(one_mode(args)), flush=True)
        return
    runs = []
    for mode in ("full", "lora"):
        cmd = [sys.executable, __file__, "--mode", mode, *sys.argv[1:]]
        p = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            runs.append({"mode": mode, "error": (p.stderr or p.stdout)[-1500:]})
        else:
            runs.append(json.loads(line[-1][7:]))
        print(json.dumps(runs[-1])[:600], flush=True)
    res = {"preset": args.preset, "runs": runs}
    ok = [r for r in runs if "error" not in r]
    if len(ok) == 2:
        full, lo = ok
        res["lora_over_full"] = {
            "tokens_per_s": lo["tokens_per_s"] / full["tokens_per_s"],
            "peak_bytes": (lo["peak_bytes_in_use"] / full["peak_bytes_in_use"]
                           if full["peak_bytes_in_use"] else None),
            "optimizer_state_bytes": (lo["bytes"]["optimizer state"]
                                      / full["bytes"]["optimizer state"]),
        }
    print(f"\n{'mode':6} {'trainable':>12} {'tokens/s':>10} {'peak GiB':>9} {'opt state GiB':>14} "
          f"{'12 B/trained GiB':>17}")
    for r in ok:
        peak = (r["peak_bytes_in_use"] or 0) / 2**30
        st = (r["bytes"]["trained params (fp32)"] + r["bytes"]["optimizer state"]) / 2**30
        print(f"{r['mode']:6} {r['trainable']:12,} {r['tokens_per_s']:10.0f} {peak:9.2f} "
              f"{st:14.3f} {12 * r['trainable'] / 2**30:17.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = ok[0]["device"] if ok else "unknown"
    name = f"lora_vs_full_{dev.replace(' ', '_').lower()}.json"
    (out / name).write_text(json.dumps(res, indent=1))
    print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
