"""Tuning sweep of the train step: each variant (config overrides and XLA flags) in its own
process, since XLA reads its flags once at start-up.

    python experiments/tune_train.py --preset 1b --out $OUT
    python experiments/tune_train.py --preset 1b --variants base unroll_all --out $OUT

Writes `train_tuning_<preset>.json` with every variant's tokens/s and MFU and prints a table
sorted by MFU. A variant that fails (an unknown flag on this XLA, out of memory) is
reported with its error and the sweep goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name: (config overrides, extra XLA flags)
VARIANTS = {
    "base": ([], ""),
    "unroll_all": (["model.scan_unroll=64"], ""),
    "fused": (["model.fused_projections=true"], ""),
    "fused_unroll": (["model.fused_projections=true", "model.scan_unroll=64"], ""),
    "no_triton_gemm": ([], "--xla_gpu_enable_triton_gemm=false"),
    "cublaslt": ([], "--xla_gpu_enable_cublaslt=true"),
    "pallas_attention": (["model.attention=pallas"], ""),
    "batch_24": (["train.batch_size=24"], ""),
    "unroll_batch_24": (["model.scan_unroll=64", "train.batch_size=24"], ""),
    "unroll_batch_32": (["model.scan_unroll=64", "train.batch_size=32"], ""),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--set", nargs="*", default=["train.batch_size=16"],
                    help="overrides applied to every variant (before the variant's own)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--timeout", type=int, default=150, help="seconds per variant")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    args = ap.parse_args()
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    rows = []
    for name in args.variants:
        sets, flags = VARIANTS[name]
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
        tmp = tempfile.mkdtemp(prefix=f"tune_{name}_")
        cmd = [sys.executable, str(HERE / "bench_train.py"), "--presets", args.preset,
               "--steps", str(args.steps), "--warmup", "2", "--out", tmp,
               "--set", *args.set, *sets]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                               timeout=args.timeout)
            files = list(Path(tmp).glob("train_*.json"))
            if files:
                run = json.loads(files[0].read_text())["runs"][0]
            else:
                run = {"error": (p.stderr or p.stdout)[-600:]}
        except subprocess.TimeoutExpired:
            run = {"error": f"timed out after {args.timeout} s"}
        row = {"variant": name, "overrides": args.set + sets, "xla_flags": flags, **run}
        rows.append(row)
        print(json.dumps({k: row.get(k) for k in ("variant", "tokens_per_s", "mfu_datasheet",
                                                    "temp_GiB", "error")}), flush=True)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"train_tuning_{args.preset}.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'variant':18} {'tokens/s':>9} {'MFU':>6} {'temp GiB':>8}")
    for r in sorted(rows, key=lambda r: -r.get("mfu_datasheet", 0)):
        if "error" in r:
            print(f"{r['variant']:18} ERROR {r['error'][-100:]!r}")
        else:
            print(f"{r['variant']:18} {r['tokens_per_s']:9.0f} {r['mfu_datasheet']:6.1%} "
                  f"{r['temp_GiB']:8.1f}")


if __name__ == "__main__":
    main()
