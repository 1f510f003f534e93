"""How close does each parallel form on two GPUs come to twice one GPU? Every form beside one
GPU in one run, with `plan`'s predicted communication.

Rows (each in its own process with its own devices, a timeout, and a failure such as an
out-of-memory recorded as the row's error while the rest go on):

    one_gpu           1 GPU, batch b                      (the dense baseline)
    dp2               data 2, batch 2b
    dp2_zero3         data 2, ZeRO-3, batch 2b
    tp2               tensor 2, batch 2b
    tp2_sp            tensor 2 + sequence parallelism, batch 2b
    tp2_collective    tensor 2 + sequence parallelism as collective matmuls
                      (train.tp_comm=collective), batch 2b
    moe_one_gpu       --moe-preset (default `350m-moe`: 8 experts, top-2, every 2nd layer)
                      on 1 GPU, batch m (`--moe-preset ""`: --preset with that MoE)
    moe_ep2           the same on expert 2, batch 2m (the same batch per GPU)

Each two-GPU row is compared with its one-GPU row: `vs_2x` = tokens/s / (2 x one GPU's),
the figure to judge a form by (targets: tensor 2 >= 90%, ZeRO-3 >= 97%, expert 2 >= 1.8/2). Beside
the measured step time stands `accounting.predict`'s communication (what `python -m gendist
plan` prints) per step: payload bytes by collective and mesh axis, and the ring's wire bytes
per device, with the time those take at the NVLink bus bandwidths measured on this machine
(`benchmarks/collectives_2xh200.json`) - the lower bound that overlap can hide.

    python experiments/two_gpu_table.py --out $OUT                        # 1b, seq 2048, b 8
    python experiments/two_gpu_table.py --preset tiny --moe-preset "" --cpu --steps 1 --out /tmp/t

`--cpu` simulates the GPUs with CPU devices (the XLA_FLAGS device count per row; other flags kept). Writes
`two_gpu_table.json` and `two_gpu_table.png` (tokens/s per row, the 2x line, predicted
communication time) under --out, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from pipeline_speed import run_child  # noqa: E402 - the one subprocess runner

from gendist.launcher import host_device_flags  # noqa: E402

# Bus bandwidth (bytes/s) measured on two H200s over NVLink (benchmarks/collectives.md).
NVLINK_BUS = {"all-reduce": 246e9, "all-gather": 237e9, "reduce-scatter": 205e9,
              "all-to-all": 252e9, "collective-permute": 237e9}
MOE = ["model.moe_experts=8", "model.moe_top_k=2", "model.moe_every=2"]
# name: (devices, overrides, per-GPU batch multiplier, baseline row)
ROWS = {
    "one_gpu": (1, [], 1, None),
    "dp2": (2, ["mesh.data=2"], 2, "one_gpu"),
    "dp2_zero3": (2, ["mesh.data=2", "train.zero_stage=3"], 2, "one_gpu"),
    "tp2": (2, ["mesh.data=1", "mesh.tensor=2"], 2, "one_gpu"),
    "tp2_sp": (2, ["mesh.data=1", "mesh.tensor=2", "mesh.sequence_parallel=true"], 2,
               "one_gpu"),
    "tp2_collective": (2, ["mesh.data=1", "mesh.tensor=2", "mesh.sequence_parallel=true",
                           "train.tp_comm=collective"], 2, "one_gpu"),
    "moe_one_gpu": (1, MOE, 1, None),
    "moe_ep2": (2, MOE + ["mesh.data=1", "mesh.expert=2"], 2, "moe_one_gpu"),
}

CHILD = """
import json, sys
sys.path.insert(0, {here!r})
import bench_train
from gendist import accounting, collectives
from gendist.training import train
from gendist.presets import preset, replace
sets = bench_train.parse_overrides({sets!r})
setup = train.build(replace(preset({preset!r}), **sets))
pred = accounting.predict(setup)
n = {{a: setup.mesh.shape[a] for a in setup.mesh.axis_names}}
comm = [dict(kind=k, axes=a, payload=b,
             wire=collectives.wire_bytes(k, b, max(n[x] for x in a.split("+"))))
        for (k, a), b in sorted(pred["comm"].items())]
print("RESULT " + json.dumps({{"predicted": dict(comm=comm, assumes=pred["assumes"],
      memory_GiB={{k: v / 2**30 for k, v in pred["memory"].items()}})}}), flush=True)
del setup
r = bench_train.bench_preset({preset!r}, sets, {steps}, {warmup})
print("RESULT " + json.dumps(r), flush=True)
"""


def row_setup(name: str, args) -> tuple[str, list[str]]:
    """(preset, overrides) of a row: the MoE rows take --moe-preset when it is given."""
    _, sets, mult, _ = ROWS[name]
    moe = name.startswith("moe")
    if moe and args.moe_preset:
        sets = [s for s in sets if s not in MOE]
    b = (args.moe_batch if moe else args.batch) * mult
    preset = args.moe_preset if moe and args.moe_preset else args.preset
    return preset, [*args.set, *sets, f"train.batch_size={b}"]


def run_row(name: str, args) -> dict:
    devices = ROWS[name][0]
    preset, sets = row_setup(name, args)
    env = dict(os.environ)
    if args.cpu:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=host_device_flags(env.get("XLA_FLAGS", ""), devices))
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(devices))
        if args.xla_flags:
            env["XLA_FLAGS"] = args.xla_flags
    code = CHILD.format(here=str(HERE), preset=preset, sets=sets, steps=args.steps,
                        warmup=args.warmup)
    rc, results, tail, wall = run_child(code, env, args.timeout)
    row = {"row": name, "preset": preset, "devices": devices, "overrides": sets, "rc": rc, "wall_s": wall}
    for r in results:
        row.update(r)
    if "tokens_per_s" not in row:
        row["error"] = tail
    comm = row.get("predicted", {}).get("comm", [])
    row["predicted_wire_GB"] = sum(c["wire"] for c in comm) / 1e9
    row["predicted_comm_ms"] = 1e3 * sum(c["wire"] / NVLINK_BUS[c["kind"]] for c in comm)
    return row


def compare(rows: list[dict]) -> None:
    """vs_2x: a two-device row's tokens/s over twice its one-device baseline's."""
    by = {r["row"]: r for r in rows}
    for r in rows:
        base = by.get(ROWS[r["row"]][3] or "")
        if base and "tokens_per_s" in r and "tokens_per_s" in base:
            r["vs_2x"] = r["tokens_per_s"] / (2 * base["tokens_per_s"])


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["row"] for r in rows]
    tps = [r.get("tokens_per_s", 0.0) for r in rows]
    ax.bar(names, tps, color=["C3" if "error" in r else "C0" for r in rows])
    by = {r["row"]: r for r in rows}
    for i, r in enumerate(rows):
        base = by.get(ROWS[r["row"]][3] or "")
        if base and "tokens_per_s" in base:
            ax.plot([i - 0.4, i + 0.4], [2 * base["tokens_per_s"]] * 2, "k--", lw=1)
        label = "failed" if "error" in r else f"{r['vs_2x']:.0%} of 2x" if "vs_2x" in r else ""
        ax.annotate(label, (i, tps[i]), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens/s (dashed: 2 x one device)")
    ax.tick_params(axis="x", rotation=40)
    step_ms = [1e3 * r.get("step_s", 0.0) for r in rows]
    x = range(len(rows))
    bx.bar([i - 0.2 for i in x], step_ms, 0.4, label="measured step")
    bx.bar([i + 0.2 for i in x], [r["predicted_comm_ms"] for r in rows], 0.4,
           label="predicted communication (plan, NVLink bus bw)")
    bx.set_xticks(list(x), names, rotation=40)
    bx.set_ylabel("ms per step")
    bx.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--moe-preset", default="350m-moe", help='"": --preset with 8 experts')
    ap.add_argument("--batch", type=int, default=8, help="dense batch per GPU")
    ap.add_argument("--moe-batch", type=int, default=4, help="MoE batch per GPU")
    ap.add_argument("--set", nargs="*", default=[], help="overrides for every row")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=150, help="seconds per row")
    ap.add_argument("--cpu", action="store_true", help="simulate the GPUs with CPU devices")
    ap.add_argument("--xla-flags", default="", help="XLA_FLAGS for every GPU row")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.rows:
        rows.append(run_row(name, args))
        r = rows[-1]
        print(json.dumps({k: v for k, v in r.items() if k not in ("error", "predicted")}),
              flush=True)
        if "error" in r:
            print("  error:", r["error"][-600:], flush=True)
        compare(rows)
        (out / "two_gpu_table.json").write_text(json.dumps(
            {"preset": args.preset, "args": vars(args), "nvlink_bus_Bps": NVLINK_BUS,
             "rows": rows}, indent=1))
    print(f"\n{'row':15} {'tokens/s':>10} {'vs 2x':>6} {'step ms':>8} {'pred comm ms':>12} "
          f"{'pred wire GB':>12}")
    for r in rows:
        tps = f"{r['tokens_per_s']:10.0f}" if "tokens_per_s" in r else f"{'FAILED':>10}"
        vs = f"{r['vs_2x']:6.0%}" if "vs_2x" in r else f"{'':6}"
        print(f"{r['row']:15} {tps} {vs} {1e3 * r.get('step_s', float('nan')):8.1f} "
              f"{r['predicted_comm_ms']:12.2f} {r['predicted_wire_GB']:12.3f}")
    plot(rows, out / "two_gpu_table.png", f"{args.preset}: two devices against one")
    return rows


if __name__ == "__main__":
    main()
