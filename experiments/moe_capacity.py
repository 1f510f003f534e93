"""MoE capacity trade-off: dropped tokens and step time against capacity factor.

Switch Transformer (Fedus et al. 2021, Sec. 2.2 and Table 1) trades capacity for
drops: a larger capacity factor drops fewer token-choices but pads every expert buffer to
more slots, which costs compute, memory and all-to-all bytes. This script measures both
sides on the layer itself (`gendist.models.moe.moe_ffn`, one routing group, jitted
forward + backward) for capacity factors 0.5 .. 4 and 4, 8, 16 experts.

Run (CPU, about a minute):
    python experiments/moe_capacity.py --out benchmarks/
GPU-sized (compute-bound; the CPU defaults only measure launch overhead on an H200):
    python experiments/moe_capacity.py --name moe_capacity_h200 --batch 32 --seq 512 \
        --d-model 1024 --d-ff 4096

Expected (measured, top-1, random router; benchmarks/moe_capacity{,_h200}.json): the drop
rate falls with the capacity factor, 50% at 0.5 (only half the even share fits), then at
1.0 about 4/7/12% for E=4/8/16 with 1024 tokens per group (1.0/1.5/2.4% with 16384 tokens:
larger groups are relatively more even), under 3.5% at 1.25 and 0 at 2 and 4. At a fixed
factor more experts drop more, since each buffer is smaller. Step time grows linearly
with the factor because the expert matmuls run on E * C = factor * tokens * k padded slots:
on an H200 at D=1024, F=4096 it goes 2.9 -> 5.2 -> 6.3 -> 9.5 -> 18.2 ms (about 270 TFLOP/s
of expert matmuls at factor 4), the same for 4, 8 and 16 experts. On the shared CPU host
the times are noisy, so the plot shows the best of `--reps` steps. The router here is
random (untrained), so drops come from statistical imbalance only; a trained router that
collapses onto few experts drops more.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm import tqdm

from gendist.config import ModelConfig
from gendist.models.moe import init_moe_params, moe_ffn

CAPACITY_FACTORS = (0.5, 1.0, 1.25, 2.0, 4.0)
EXPERT_COUNTS = (4, 8, 16)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/", help="folder for the JSON and PNG")
    ap.add_argument("--name", default="moe_capacity", help="file stem: NAME.json, NAME.png")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (one group)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--d-ff", type=int, default=128, help="hidden width of each expert")
    ap.add_argument("--top-k", type=int, default=1, help="1 = Switch, 2 = GShard")
    ap.add_argument("--seeds", type=int, default=4, help="random batches averaged for drops")
    ap.add_argument("--reps", type=int, default=30, help="timed steps (min and median kept)")
    return ap.parse_args(argv)


def measure(cfg: ModelConfig, args) -> dict:
    """Drop rate over several random batches and the median fwd+bwd step time."""
    shape = (args.batch, args.seq, args.d_model)

    def loss(p, x):
        y, aux = moe_ffn(p, x, cfg)
        return jnp.mean(jnp.square(y)) + aux.weighted_loss(cfg), aux

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    drops, loads = [], []
    for seed in range(args.seeds):
        kp, kx = jax.random.split(jax.random.key(seed))
        params = init_moe_params(kp, cfg)
        x = jax.random.normal(kx, shape)
        (_, aux), grads = step(params, x)
        jax.block_until_ready(grads)
        drops.append(float(aux.drop_fraction))
        load = aux.expert_load_E
        loads.append(float(jnp.max(load) / jnp.mean(load)))
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, x))
        times.append(time.perf_counter() - t0)
    tokens = args.batch * args.seq
    slots = cfg.moe_experts * cfg.moe_capacity(tokens)
    matmuls = 3 if cfg.mlp == "swiglu" else 2
    # Expert matmul FLOPs on the padded buffers: 2 per MAC, x3 for forward + backward.
    expert_flops = 6 * matmuls * slots * args.d_model * args.d_ff
    return {
        "num_experts": cfg.moe_experts,
        "capacity_factor": cfg.moe_capacity_factor,
        "capacity": cfg.moe_capacity(tokens),
        "padded_slots_per_choice": slots / (tokens * cfg.moe_top_k),
        "drop_fraction": statistics.mean(drops),
        "drop_fraction_per_seed": drops,
        "max_over_mean_load": statistics.mean(loads),
        "step_ms_median": 1e3 * statistics.median(times),
        "step_ms_min": 1e3 * min(times),
        "expert_tflops_at_min": expert_flops / min(times) / 1e12,
    }


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_d, ax_t) = plt.subplots(1, 2, figsize=(10, 4))
    for E in sorted({r["num_experts"] for r in rows}):
        rs = [r for r in rows if r["num_experts"] == E]
        cf = [r["capacity_factor"] for r in rs]
        ax_d.plot(cf, [100 * r["drop_fraction"] for r in rs], "o-", label=f"E={E}")
        ax_t.plot(cf, [r["step_ms_min"] for r in rs], "o-", label=f"E={E}")
    ax_d.set(xscale="log", xlabel="capacity factor", ylabel="token-choices dropped (%)",
             title="drops")
    ax_t.set(xscale="log", xlabel="capacity factor", ylabel="fwd+bwd step (ms, best of reps)",
             title="step time")
    for ax in (ax_d, ax_t):
        ax.set_xticks(CAPACITY_FACTORS, [str(c) for c in CAPACITY_FACTORS])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grid = [(E, cf) for E in EXPERT_COUNTS for cf in CAPACITY_FACTORS]
    rows = []
    for E, cf in tqdm(grid, desc="moe capacity"):
        cfg = ModelConfig(d_model=args.d_model, num_layers=2, num_heads=2, num_kv_heads=2, moe_experts=E,
                          moe_top_k=args.top_k, moe_capacity_factor=cf, moe_d_ff=args.d_ff)
        rows.append(measure(cfg, args))
    result = {
        "experiment": "moe_capacity",
        "setup": {k: v for k, v in vars(args).items() if k not in ("out", "name")},
        "tokens_per_group": args.batch * args.seq,
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "host": platform.machine(),
        "rows": rows,
    }
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    title = (f"MoE top-{args.top_k}, {args.batch * args.seq} tokens/group, D={args.d_model}, "
             f"F={args.d_ff}, {result['backend']}")
    plot(rows, out / f"{args.name}.png", title)
    for r in rows:
        print(f"E={r['num_experts']:>2} cf={r['capacity_factor']:<4} C={r['capacity']:>4} "
              f"drop={100 * r['drop_fraction']:5.1f}%  step min/median="
              f"{r['step_ms_min']:7.2f}/{r['step_ms_median']:7.2f} ms")
    return result


if __name__ == "__main__":
    main()
