"""Pipeline parallelism on real GPUs: tokens/s of pipeline stages against one GPU, per run.

Each variant runs in its own process (its own devices and XLA flags) through
`bench_train.bench_preset`, and the results land in one JSON with a table:

    python experiments/pipeline_speed.py --out $OUT                      # the default sweep
    python experiments/pipeline_speed.py --variants one_gpu pp2_1f1b_m16 --out $OUT

A variant is (visible GPUs, preset, config overrides). The default sweep, on a machine with
two GPUs: the 1b preset on one GPU (batch 24) against 1F1B over two stages (m = 16,
batch 48), GPipe at the same m, the three attention backends on a 4-layer cut of 1b
(that they compile and run inside pipeline stages), the 8b preset (Llama-3-8B's shape,
which does not fit one GPU) for 20 steps, the split-backward schedules (1F1B-split, ZB-H1),
interleaved 1F1B (two chunks a stage, against 1F1B on the same 24-layer model) and
TeraPipe's step time against its number of token slices at 4k-16k tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

PP2 = ["mesh.pipeline=2", "mesh.data=1"]
CUT = ["model.num_layers=4", "model.scan_unroll=4", "train.batch_size=16",
       "train.pipeline_microbatches=4"]
# name: (CUDA_VISIBLE_DEVICES, preset, overrides, timed steps)
VARIANTS = {
    "one_gpu": ("0", "1b", ["train.batch_size=24"], 5),
    "pp2_1f1b_m16": ("0,1", "1b", PP2 + ["train.batch_size=48", "train.pipeline_microbatches=16",
                                         "train.pipeline_schedule=1f1b"], 5),
    "pp2_gpipe_m16": ("0,1", "1b", PP2 + ["train.batch_size=48", "train.pipeline_microbatches=16",
                                          "train.pipeline_schedule=gpipe", "model.remat=full"], 5),
    "dp2": ("0,1", "1b", ["mesh.data=2", "train.batch_size=48"], 5),
    "cut_pp2_cudnn": ("0,1", "1b", PP2 + CUT + ["model.attention=cudnn"], 3),
    "cut_pp2_pallas": ("0,1", "1b", PP2 + CUT + ["model.attention=pallas"], 3),
    "cut_pp2_xla": ("0,1", "1b", PP2 + CUT + ["model.attention=xla"], 3),
    "8b_pp2": ("0,1", "8b", ["train.batch_size=16", "train.pipeline_microbatches=16"], 20),
}
VARIANTS["pp2_gpipe_m16_keep"] = ("0,1", "1b", PP2 + [
    "train.batch_size=48", "train.pipeline_microbatches=16", "train.pipeline_schedule=gpipe"], 5)
# The split-backward schedules at the same m, ZB-H1, and 1F1B in phases (all F or all B).
for _name in ("1f1b-split", "zb-h1", "1f1b-phased"):
    VARIANTS[f"pp2_{_name}_m16"] = ("0,1", "1b", PP2 + [
        "train.batch_size=48", "train.pipeline_microbatches=16",
        f"train.pipeline_schedule={_name}"], 5)
VARIANTS["pp2_1f1b-phased_m8"] = ("0,1", "1b", PP2 + [
    "train.batch_size=48", "train.pipeline_microbatches=8", "train.pipeline_schedule=1f1b-phased"], 5)
VARIANTS["pp2_1f1b-phased_m16_b96"] = ("0,1", "1b", PP2 + [
    "train.batch_size=96", "train.pipeline_microbatches=16", "train.pipeline_schedule=1f1b-phased"], 5)
for _b, _m in ((48, 16), (96, 16), (128, 16)):  # residuals: only the matmuls' outputs kept
    VARIANTS[f"pp2_1f1b-phased_m{_m}_b{_b}_savemm"] = ("0,1", "1b", PP2 + [
        f"train.batch_size={_b}", f"train.pipeline_microbatches={_m}",
        "train.pipeline_schedule=1f1b-phased", "model.remat=save_matmuls"], 5)
# Interleaved 1F1B (v = 2 chunks a stage) needs stages x chunks to divide the layers: 1b
# has 22, so a 24-layer 1b against 1F1B on the same 24 layers (m = 16, batch 48).
for _name, _extra in (("1f1b", []), ("interleaved-1f1b", ["train.pipeline_chunks=2"])):
    VARIANTS[f"pp2_{_name}_m16_l24"] = ("0,1", "1b", PP2 + [
        "model.num_layers=24", "model.scan_unroll=24", "train.batch_size=48",
        "train.pipeline_microbatches=16", f"train.pipeline_schedule={_name}", *_extra], 5)
# TeraPipe: a 4-layer cut of 350m (2 layers a stage), one sequence, k equal token slices.
for _seq, _ks in ((4096, (1, 2, 4, 8)), (8192, (1, 2, 4, 8)), (16384, (2, 8))):
    for _k in _ks:
        VARIANTS[f"terapipe_{_seq // 1024}k_{_k}"] = ("0,1", "350m", PP2 + [
            "model.num_layers=4", f"model.max_seq_len={_seq}", f"train.seq_len={_seq}",
            "train.batch_size=1", f"train.terapipe_slices={_k}", "model.attention=xla"], 3)

CHILD = """
import json, sys
sys.path.insert(0, {here!r})
import bench_train
r = bench_train.bench_preset({preset!r}, bench_train.parse_overrides({sets!r}), {steps}, 2)
print("RESULT " + json.dumps(r))
"""


def run_child(code: str, env: dict, timeout: float) -> tuple[object, list[dict], str, float]:
    """Run `code` in a fresh Python process: (exit code or "timeout", the JSON of each line
    it prints as "RESULT {...}", the tail of its output, wall seconds). A crash, an OOM or a
    timeout is recorded, not raised, so a sweep goes on."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        try:
            proc = subprocess.run([sys.executable, "-c", code], env=env, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout, text=True)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        log.seek(0)
        out = log.read()
    results = [json.loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")]
    return rc, results, out[-1500:], time.perf_counter() - t0


def run_variant(name: str, timeout: float) -> dict:
    gpus, preset, sets, steps = VARIANTS[name]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus)
    code = CHILD.format(here=str(HERE), preset=preset, sets=sets, steps=steps)
    rc, results, tail, wall = run_child(code, env, timeout)
    row = {"variant": name, "gpus": gpus, "preset": preset, "overrides": sets, "rc": rc,
           "wall_s": wall}
    if results:
        row.update(results[-1])
    else:
        row["error"] = tail
    return row


def plot_terapipe(rows: list[dict], path: Path) -> None:
    """TeraPipe's step time against its number of token slices, one line per length."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by_seq: dict[int, list] = {}
    for r in rows:
        if r["variant"].startswith("terapipe_") and "step_s" in r:
            k = int(r["variant"].rsplit("_", 1)[1])
            by_seq.setdefault(r["seq_len"], []).append((k, r["step_s"] * 1e3))
    if not by_seq:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for seq, pts in sorted(by_seq.items()):
        pts.sort()
        ax.plot([k for k, _ in pts], [t for _, t in pts], "o-", label=f"{seq // 1024}k tokens")
        for (k, t), (_, t0) in zip(pts[1:], pts[:1] * (len(pts) - 1), strict=True):
            ax.annotate(f"{t0 / t:.2f}x", (k, t), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("token slices per sequence")
    ax.set_ylabel("step time (ms)")
    ax.set_title("TeraPipe on 2 stages (2 H200s): gain over the fewest slices")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--timeout", type=float, default=240, help="seconds per variant")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    ap.add_argument("--name", default="pipeline_speed")
    ap.add_argument("--replot", help="only redraw the TeraPipe plot of this JSON")
    args = ap.parse_args()
    if args.replot:
        src = Path(args.replot)
        plot_terapipe(json.loads(src.read_text())["runs"], src.with_name(f"{src.stem}_terapipe.png"))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.variants:
        rows.append(run_variant(name, args.timeout))
        r = rows[-1]
        print(json.dumps({k: v for k, v in r.items() if k != "error"}), flush=True)
        if "error" in r:
            print("  error:", r["error"][-600:], flush=True)
        (out / f"{args.name}.json").write_text(json.dumps({"runs": rows}, indent=1))
    base = next((r for r in rows if r["variant"] == "one_gpu" and "tokens_per_s" in r), None)
    print(f"\n{'variant':16} {'tokens/s':>10} {'vs 1 GPU':>9} {'MFU':>6} {'step s':>7}")
    for r in rows:
        if "tokens_per_s" not in r:
            print(f"{r['variant']:16} FAILED ({r['rc']})")
            continue
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        print(f"{r['variant']:16} {r['tokens_per_s']:10.0f} {ratio:9.2f} "
              f"{r['mfu_datasheet']:6.1%} {r['step_s']:7.3f}")
    plot_terapipe(rows, out / f"{args.name}_terapipe.png")


if __name__ == "__main__":
    main()
