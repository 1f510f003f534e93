"""A small MoE against a dense model with the same active parameters, on the corpus.

Dense: the `tiny` preset. MoE: the same model with every second MLP replaced by E experts of
the same width, routed top-1 (Switch), so each token runs the same FLOPs (active
parameters) while the model holds E times the MLP weights in those layers. Both train the
same steps on the same batches; validation loss is compared and the curves are plotted.

    python experiments/moe_vs_dense.py --steps 200 --experts 4 --out benchmarks
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from gendist.presets import preset, replace
from gendist.training import loop


def train(cfg, name, steps, out):
    cfg = replace(cfg, **{"train.steps": steps,
                          "train.out_dir": tempfile.mkdtemp(prefix=f"moe_vs_dense_{name}_"),
                          "train.resume": False, "train.eval_every": max(steps // 4, 1),
                          "train.checkpoint_every": 0, "train.tensorboard": False,
                          "train.eval_batches": 4})
    evals = []
    t0 = time.perf_counter()

    def log(msg):
        if "val_loss" in msg:
            evals.append((int(msg.split()[1].rstrip(":")), float(msg.split()[3])))

    r = loop.run(cfg, log=log)
    m = cfg.model
    active = m.num_active_params
    return {"name": name, "total_params": _total_params(r.state["params"]),
            "active_params": active, "val_loss": r.val_loss, "evals": evals,
            "train_loss": [h["loss"] for h in r.history],
            "drop_fraction": [h.get("moe_drop_fraction") for h in r.history],
            "seconds": time.perf_counter() - t0}


def _total_params(params):
    import jax
    return int(sum(x.size for x in jax.tree.leaves(params)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--out", default="benchmarks")
    args = ap.parse_args()
    base = preset("tiny")
    moe = replace(base, **{"model.moe_experts": args.experts, "model.moe_top_k": 1,
                           "model.moe_every": 2, "model.moe_capacity_factor": args.capacity_factor})
    res = {"steps": args.steps, "runs": [train(base, "dense", args.steps, args.out),
                                         train(moe, f"moe{args.experts}_top1", args.steps, args.out)]}
    for r in res["runs"]:
        print(f"{r['name']:12} total {r['total_params'] / 1e6:.2f}M active "
              f"{r['active_params'] / 1e6:.2f}M val_loss {r['val_loss']:.4f} ({r['seconds']:.0f}s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_vs_dense.json").write_text(json.dumps(res, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in res["runs"]:
        ax.plot(range(1, len(r["train_loss"]) + 1), r["train_loss"], alpha=0.4, label=f"{r['name']} train")
        ax.plot([s for s, _ in r["evals"]], [v for _, v in r["evals"]], "o-", label=f"{r['name']} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title("MoE (top-1) vs dense, equal active parameters")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "moe_vs_dense.png", dpi=120)


if __name__ == "__main__":
    main()
