"""Does FP8 training pay on a Hopper GPU, and does it keep the loss?

Speed: for each shape, the bf16 train step and the FP8 ones (`train.matmul_precision=fp8`;
`fp8`: delayed scaling, as a run on one GPU gets it; `fp8_current`: current scaling;
`fp8_xla_transpose`: XLA's transposes of the float8 GEMM operands instead of the Pallas
kernel; `fp8_fused`: q|k|v and gate|up as one product each) built in one process and timed
in alternating rounds; tokens/s, MFU against the dense bf16
peak (989 TFLOP/s) and the dense FP8 peak (1,979 TFLOP/s; H100/H200 SXM datasheet), and the
compiled step's GEMMs by operand type (cuBLASLt custom calls whose operands are f8 against
the others): the FP8 products must compile to FP8 GEMMs, not bf16 dots with casts around them;
and the transposes of float8 tensors XLA added to the step.

Quality: the same model trained twice from one initialisation on one data order (the bundled
corpus), bf16 and FP8; validation losses, the last ones' ratio and both curves in one plot.

    python experiments/fp8_training.py --out benchmarks            # GPU: the measured sizes
    python experiments/fp8_training.py --tiny --out /tmp/fp8       # CPU: the same code, tiny

Writes fp8_training_<device>.json (and fp8_loss_<device>.png) to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

import jax

from gendist.data.batches import random_batches
from gendist.presets import preset, replace
from gendist.timing import result_path
from gendist.training import train

PEAK = {"bf16": 989e12, "fp8": 1979e12}  # dense, H100/H200 SXM datasheet

# (name, preset, overrides): the 1b preset, Llama-3-8B's layer shape (width 4096, 32/8
# heads of 128, SwiGLU 14336) in 4 layers, where the products are most of the step, and the
# 350m-moe preset (every 2nd block's MLP 8 experts, top-2: the experts' products batched).
SHAPES = [
    ("1b", "1b", {"train.batch_size": 8, "train.seq_len": 2048}),
    ("8b-layers-4", "8b", {"model.num_layers": 4, "model.remat": "none", "model.scan_unroll": 4,
                           "mesh.pipeline": 1, "train.batch_size": 8, "train.seq_len": 2048}),
    ("350m-moe", "350m-moe", {"train.batch_size": 8, "train.seq_len": 1024}),
]
TINY = [("tiny", "tiny", {"train.batch_size": 8, "train.seq_len": 64})]


def f8_transposes(hlo: str) -> int:
    """Fusions of a compiled module whose root is a transpose to a float8 type (XLA's own
    transposes of FP8 GEMM operands; the Pallas kernel's are custom calls)."""
    comps = re.findall(r"^(%[\w.\-]+) \([^)]*\) -> (\S+) \{\n(.*?)\n\}", hlo, flags=re.M | re.S)
    roots = {name for name, ret, body in comps if re.match(r"f8e[45]m[23]", ret)
             and re.search(r"ROOT [^\n]*= \S+ transpose\(", body)}
    return sum(1 for m in re.finditer(r"^\s*(?:ROOT )?%\S+ = \S+ fusion\(.*calls=(%[\w.\-]+)", hlo,
                                      flags=re.M) if m.group(1) in roots)


def gemm_counts(hlo: str) -> dict:
    """The GEMMs of a compiled module by operand type, f8 (FP8 GEMMs) or not: cuBLAS custom
    calls (their operands' types looked up by name) and Triton GEMM fusions (their
    computation's parameter types)."""
    types = dict(re.findall(r"^\s*(?:ROOT )?%(\S+) = (\S+)", hlo, flags=re.M))
    out = {"f8": 0, "other": 0}
    for line in hlo.splitlines():
        if 'custom_call_target="__cublas' in line:
            names = re.findall(r"%([\w.\-]+)", line.split("custom-call(", 1)[1].split(")", 1)[0])
            operand_types = " ".join(types.get(n, "") for n in names)
        elif re.match(r"^%gemm_fusion\S*computation", line):
            operand_types = line.split(")", 1)[0]
        else:
            continue
        out["f8" if re.search(r"f8e[45]m[23]", operand_types) else "other"] += 1
    return out


VARIANTS = {"bf16": {"train.matmul_precision": "bf16"},
            "fp8": {"train.matmul_precision": "fp8", "train.fp8_recipe": "delayed"},
            "fp8_current": {"train.matmul_precision": "fp8", "train.fp8_recipe": "current"},
            "fp8_xla_transpose": {"train.matmul_precision": "fp8", "train.fp8_transpose": "xla"},
            "fp8_fused": {"train.matmul_precision": "fp8", "model.fused_projections": True}}
WARMUP = 4  # steps run before timing


def bench_shape(name, base, overrides, rounds: int, steps: int, out: Path | None = None,
                variants=("bf16", "fp8")) -> dict:
    res = {"shape": name, "preset": base, "overrides": overrides, "rounds": []}
    runs = {}
    for prec in variants:
        cfg = replace(preset(base), **{**overrides, **VARIANTS[prec]})
        setup = train.build(cfg)
        state = setup.init_state()
        batches = random_batches(cfg, setup.mesh)
        t0 = time.perf_counter()
        compiled = setup.step_fn.lower(state, batches[0]).compile()
        res[f"compile_s_{prec}"] = time.perf_counter() - t0
        hlo = compiled.as_text()
        res[f"gemms_{prec}"] = gemm_counts(hlo)
        res[f"f8_transposes_{prec}"] = f8_transposes(hlo)
        if prec == "fp8" and out is not None:  # the evidence: GEMM calls and float8 lines
            keep = [ln for ln in hlo.splitlines() if "__cublas" in ln or "f8e" in ln]
            (out / f"fp8_gemm_lines_{name}.txt").write_text("\n".join(keep[:2000]))
        mem = compiled.memory_analysis()
        res[f"temp_GiB_{prec}"] = getattr(mem, "temp_size_in_bytes", 0) / 2**30 if mem else None
        for i in range(WARMUP):
            state, m = compiled(state, batches[i % 2])
        jax.block_until_ready(m)
        runs[prec] = [cfg, compiled, state, batches]
        res["params_M"] = cfg.model.num_params / 1e6
    tokens = runs["bf16"][0].train.batch_size * runs["bf16"][0].train.seq_len
    flops = runs["bf16"][0].model.flops_per_token(runs["bf16"][0].train.seq_len) * tokens
    for r in range(rounds):
        row = {"round": r + 1}
        for prec in variants:
            cfg, compiled, state, batches = runs[prec]
            t0 = time.perf_counter()
            for i in range(steps):
                state, m = compiled(state, batches[i % 2])
            jax.block_until_ready(m)
            dt = (time.perf_counter() - t0) / steps
            runs[prec][2] = state
            row[prec] = {"step_s": dt, "tokens_per_s": tokens / dt,
                         "mfu_bf16_peak": flops / dt / PEAK["bf16"],
                         "mfu_fp8_peak": flops / dt / PEAK["fp8"], "loss": float(m["loss"]),
                         "finite": bool(m["finite"])}
        for prec in variants[1:]:
            row[f"{prec}_over_bf16"] = row[prec]["tokens_per_s"] / row["bf16"]["tokens_per_s"]
        res["rounds"].append(row)
        print(json.dumps({"shape": name, **row}), flush=True)
    del runs
    return res


def quality(base: str, overrides: dict) -> dict:
    import tempfile

    from gendist import run

    curves = {}
    with tempfile.TemporaryDirectory(prefix="fp8_quality_") as tmp:  # the runs' checkpoints
        for prec in ("bf16", "fp8"):
            curves[prec] = _quality_run(run, base, overrides, prec, Path(tmp))
    a, b = curves["bf16"]["final_val_loss"], curves["fp8"]["final_val_loss"]
    return {"preset": base, "overrides": overrides, "curves": curves,
            "fp8_over_bf16_final_val_loss": b / a}


def _quality_run(run, base: str, overrides: dict, prec: str, runs: Path) -> dict:
    """One training run of the quality comparison: its validation curve and skipped steps."""
    cfg = replace(preset(base), **{**overrides, "train.matmul_precision": prec,
                                   "train.out_dir": str(runs / f"fp8_quality_{prec}"),
                                   "train.resume": False, "train.progress": False,
                                   "train.tensorboard": False, "train.checkpoint_every": 0})
    t0 = time.perf_counter()
    result = run(cfg)
    records = [json.loads(line) for line in
               (Path(cfg.train.out_dir) / "metrics.jsonl").read_text().splitlines()]
    vals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    curve = {"steps_val_loss": vals, "seconds": time.perf_counter() - t0,
             "final_val_loss": vals[-1][1] if vals else None,
             "skipped_steps": sum(1 for h in result.history if h.get("finite") is False)}
    print(json.dumps({"quality": prec, **curve}), flush=True)
    return curve


def plot(q: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for prec, c in q["curves"].items():
        s, v = zip(*c["steps_val_loss"], strict=True)
        ax.plot(s, v, marker="o", ms=3, label=prec)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"{q['preset']}: bf16 and FP8 from one initialisation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU check of the code)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--quality-steps", type=int, default=1000)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--shapes", nargs="+", default=[n for n, _, _ in SHAPES],
                    choices=[n for n, _, _ in SHAPES], help="shapes timed (GPU sizes)")
    ap.add_argument("--variants", nargs="+",
                    default=["bf16", "fp8", "fp8_xla_transpose", "fp8_fused"],
                    choices=list(VARIANTS), help="steps timed (bf16 first: the ratios' base)")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    args = ap.parse_args()
    if args.variants[0] != "bf16":
        ap.error("--variants starts with bf16 (the ratios' base)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    res = {"device": dev.device_kind, "jax": jax.__version__, "peaks": PEAK, "speed": []}
    if not args.skip_speed:
        for name, base, ov in (TINY if args.tiny else
                               [x for x in SHAPES if x[0] in args.shapes]):
            try:
                res["speed"].append(bench_shape(name, base, ov, args.rounds, args.steps, out,
                                                args.variants))
            except Exception as e:  # noqa: BLE001 - report and go on to the next shape
                res["speed"].append({"shape": name, "error": f"{type(e).__name__}: {str(e)[:600]}"})
                print(res["speed"][-1], flush=True)
            # written after each shape: kept if the quality runs are cut
            result_path(out, "fp8_training").write_text(json.dumps(res, indent=1))
    if args.skip_quality:
        return report(res, args.variants)
    qbase, qov = ("tiny", {"train.batch_size": 8, "train.seq_len": 64}) if args.tiny else (
        "350m", {"train.batch_size": 8, "train.seq_len": 512})
    qov = {**qov, "train.steps": args.quality_steps, "train.warmup_steps": 50,
           "train.eval_every": max(args.quality_steps // 10, 1), "train.eval_batches": 4,
           "train.log_every": max(args.quality_steps // 10, 1)}
    res["quality"] = quality(qbase, qov)
    plot(res["quality"], result_path(out, "fp8_loss", ext="png"))
    result_path(out, "fp8_training").write_text(json.dumps(res, indent=1))
    report(res, args.variants)


def report(res: dict, variants) -> None:
    for s in res["speed"]:
        if "rounds" in s:
            for prec in variants[1:]:
                ratios = [r[f"{prec}_over_bf16"] for r in s["rounds"]]
                print(f"{s['shape']}: {prec}/bf16 tokens/s {min(ratios):.3f}-{max(ratios):.3f}; "
                      f"GEMMs bf16 step {s['gemms_bf16']}, {prec} step {s[f'gemms_{prec}']}, "
                      f"float8 transposes by XLA {s[f'f8_transposes_{prec}']}")
    if "quality" in res:
        print(f"quality: FP8/bf16 final validation loss "
              f"{res['quality']['fp8_over_bf16_final_val_loss']:.4f}")


if __name__ == "__main__":
    main()
