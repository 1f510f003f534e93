"""Loss curves of synchronous and asynchronous pipelines on the bundled corpus.

A 4-stage pipeline trains gendist's transformer (untied embeddings: stage 0 owns the
embedding, stage 3 the output layer) on the same stream of microbatches, each method
with the same per-stage Adam:

* sequential - one microbatch in flight, an update after each: no staleness (the
  statistical reference; its pipeline idles (p-1)/p of the time);
* flush 1F1B - synchronous (PipeDream-Flush / Megatron-LM): one update per p microbatches;
* PipeDream, weight stashing - 1F1B without flush, an update after each microbatch; a
  forward on stage s sees weights min(i, p-1-s) updates old (stale, but consistent);
* PipeDream, no stashing - same, but the backward uses newer weights than its forward;
* PipeDream-2BW - gradient accumulated over p microbatches, one update per window,
  forward and backward both on the version one window old.

Run (CPU, 8 simulated devices, several minutes):
    python experiments/pipedream_staleness.py --out benchmarks/

Writes benchmarks/pipedream_staleness.json and .png: the per-microbatch training loss
(smoothed), the final validation loss, and the staleness of each stage.

Result (384 microbatches, Adam lr 1e-2, committed JSON): validation loss sequential 2.68,
flush 1F1B 2.67, PipeDream with stashing 2.89, without stashing 2.99, 2BW 3.33. Staleness
costs progress at this learning rate, inconsistent weights (no stashing) cost more, and
2BW pays for both its delay and its 4x fewer updates; flush 1F1B makes 4x fewer updates
than sequential yet matches it here, with the bubble (p-1)/(m+p-1) instead of (p-1)/p.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from gendist.config import Config, DataConfig, MeshConfig, ModelConfig, TrainConfig  # noqa: E402
from gendist.data.batches import TextData  # noqa: E402
from gendist.models import transformer  # noqa: E402
from gendist.parallel.pipeline import model as stage_model  # noqa: E402
from gendist.parallel.pipeline import pipedream as PD  # noqa: E402
from gendist.parallel.pipeline import schedules as S  # noqa: E402
from gendist.sharding import make_mesh, rules_for  # noqa: E402
from gendist.training import train  # noqa: E402


def config(args) -> Config:
    model = ModelConfig(d_model=args.d_model, num_layers=args.stages, num_heads=4,
                        num_kv_heads=4, head_dim=args.d_model // 4, d_ff=2 * args.d_model,
                        max_seq_len=args.seq, tie_embeddings=False)
    return Config(model=model, mesh=MeshConfig(data=-1, pipeline=args.stages),
                  data=DataConfig(), train=TrainConfig(seq_len=args.seq))


def stream(data: TextData, num, shards, mb, seq, split="train", first=0):
    """Microbatches first..first+num-1 in the executor's layout: shard d's rows hold its
    share of every microbatch in order, so microbatch i is the same rows for all methods."""
    win = [data.global_batch(first + i, shards * mb, seq, split) for i in range(num)]
    out = {}
    for key in ("inputs", "targets"):
        arr = np.stack([w[key] for w in win]).reshape(num, shards, mb, seq)
        out[key] = arr.transpose(1, 0, 2, 3).reshape(shards * num * mb, seq)
    return out


def run_async(cfg, mesh, params, batch, opt, m, mode, schedule, window=1):
    sched = S.make(schedule, mesh.shape["pipeline"], m)
    update = stage_model.pipedream_engine(cfg.model, mesh, rules_for(cfg.mesh), opt, sched,
                                          mode, window)
    new, _, losses = jax.jit(update)(params, opt.init(params), batch)
    return new, np.asarray(losses)


def run_flush(cfg, mesh, params, batch, opt, m, p):
    """Synchronous 1F1B: p microbatches per update, flushed between updates."""
    st = stage_model.stage_setup(cfg.model, mesh, rules_for(cfg.mesh))
    sched = S.make("1f1b", mesh.shape["pipeline"], p)
    grad = jax.jit(lambda prm, b: (lambda r: (r[0], r[2]))(
        stage_model.loss_and_grads(st, prm, b, sched)))
    step = jax.jit(lambda prm, st, g: (lambda u: (optax.apply_updates(prm, u[0]), u[1]))(
        opt.update(g, st, prm)))
    rows = batch["inputs"].shape[0]
    per_shard = rows // mesh.shape["data"]
    state, losses = opt.init(params), []
    for j in range(m // p):
        # microbatches j*p .. j*p+p-1 of every shard, kept in the executor's layout
        sel = np.concatenate([np.arange(d * per_shard + j * p * per_shard // m,
                                        d * per_shard + (j + 1) * p * per_shard // m)
                              for d in range(mesh.shape["data"])])
        b = {k: v[sel] for k, v in batch.items()}
        loss, g = grad(params, b)
        params, state = step(params, state, g)
        losses += [float(loss)] * p
    return params, np.asarray(losses)


def val_loss(cfg, params, data, args):
    f = jax.jit(lambda prm, b: train.loss_fn(cfg, prm, b))
    return float(np.mean([f(params, data.global_batch(i, 16, args.seq, "val"))
                          for i in range(args.val_batches)]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=384)
    ap.add_argument("--mb-size", type=int, default=4, help="sequences per microbatch per shard")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--val-batches", type=int, default=8)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    p, m = args.stages, args.microbatches
    cfg = config(args)
    mesh = make_mesh(cfg.mesh)
    shards = mesh.shape["data"]
    data = TextData.from_config(cfg.data)
    batch = stream(data, m, shards, args.mb_size, args.seq)
    params0 = transformer.init_params(cfg.model, 0)
    opt = optax.adam(args.lr)
    methods = {
        "sequential (no staleness)": lambda: run_async(cfg, mesh, params0, batch, opt, m, "stash", "sequential"),
        "flush 1F1B (update per p)": lambda: run_flush(cfg, mesh, params0, batch, opt, m, p),
        "PipeDream, stashing": lambda: run_async(cfg, mesh, params0, batch, opt, m, "stash", "1f1b"),
        "PipeDream, no stashing": lambda: run_async(cfg, mesh, params0, batch, opt, m, "nostash", "1f1b"),
        "PipeDream-2BW (window p)": lambda: run_async(cfg, mesh, params0, batch, opt, m, "2bw", "1f1b", p),
    }
    rows = {}
    for name, fn in methods.items():
        t0 = time.perf_counter()
        params, losses = fn()
        rows[name] = {"loss": losses.tolist(), "val_loss": val_loss(cfg, params, data, args),
                      "seconds": time.perf_counter() - t0}
        print(f"{name:28s} last-32 train loss {losses[-32:].mean():.4f}  val "
              f"{rows[name]['val_loss']:.4f}  ({rows[name]['seconds']:.0f} s)", flush=True)
    staleness = {mode: (PD.version_plan(S.one_f_one_b(p, m), mode).bwd_version
                        - PD.version_plan(S.one_f_one_b(p, m), "stash").fwd_version)[:, -1].tolist()
                 for mode in ("stash", "nostash")}
    fwd_age = (np.arange(m)[None] - PD.version_plan(S.one_f_one_b(p, m), "stash").fwd_version)[:, -1]
    result = {"config": vars(args), "data_shards": shards, "jax": jax.__version__,
              "platform": jax.devices()[0].platform, "methods": rows,
              "forward_weight_age_per_stage": fwd_age.tolist(),
              "backward_minus_forward_version_per_stage": staleness,
              "note": "one stream of microbatches; each method sees the same microbatches"}
    (out / "pipedream_staleness.json").write_text(json.dumps(result, indent=1))
    plot(rows, fwd_age, staleness, args, out / "pipedream_staleness.png")
    print(f"wrote {out / 'pipedream_staleness.json'} and .png")


def plot(rows, fwd_age, staleness, args, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 1]})
    k = 16
    for name, r in rows.items():
        loss = np.asarray(r["loss"])
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(k - 1, len(loss)), smooth, label=f"{name} (val {r['val_loss']:.3f})")
    ax.set_xlabel("microbatches processed")
    ax.set_ylabel(f"train loss (nats/byte, mean of {k})")
    ax.set_title(f"p={args.stages} stages, Adam lr {args.lr}, per-stage updates")
    ax.legend(fontsize=8)
    s = np.arange(len(fwd_age))
    ax2.bar(s - 0.2, fwd_age, 0.4, label="forward weights: updates behind")
    ax2.bar(s + 0.2, staleness["nostash"], 0.4, label="no stashing: B newer than F by")
    ax2.set_xlabel("stage")
    ax2.set_ylabel("versions")
    ax2.set_title("staleness per stage (1F1B)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
