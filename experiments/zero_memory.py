"""Per-device memory of one train step vs ZeRO stage and data-axis size, predicted and compiled.

    python experiments/zero_memory.py            # CPU: 8 simulated devices, ~5 minutes
    python experiments/zero_memory.py --quick    # data sizes 1 and 8 only

For each ZeRO stage (0-3) and |data| in {1, 2, 4, 8} (tensor = 1), the step of a bf16
model with fp32 master weights is compiled and read back: the persistent state (fp32
params + Adam m, v) from the compiled step's output shardings, XLA's temp buffer from
`memory_analysis()`, and `gendist.accounting.predict`'s figures beside them. Expected
(Rajbhandari et al. 2020, with 4+8 bytes of fp32 master + moments per parameter):
state = 12 psi at stage 0 and 12 psi / |data| from stage 1; gradients (4 psi) split from
stage 2; the bf16 compute copy (2 psi) is whole in stages 1-2 and one layer in stage 3.
Writes benchmarks/zero_memory.json and benchmarks/zero_memory.png.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if "jax" not in sys.modules:  # simulate 8 CPU devices unless the caller set up devices
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from gendist import accounting
from gendist.config import Config, MeshConfig, ModelConfig, TrainConfig  # noqa: E402
from gendist.sharding import make_mesh  # noqa: E402
from gendist.training import train  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "benchmarks"


def config(stage: int, data: int) -> Config:
    model = ModelConfig(d_model=256, num_layers=4, num_heads=8, num_kv_heads=8, head_dim=32,
                        d_ff=768, max_seq_len=64, dtype="bfloat16")
    return Config(model=model, mesh=MeshConfig(data=data),
                  train=TrainConfig(batch_size=8, seq_len=32, zero_stage=stage,
                                    tensorboard=False, progress=False))


def measure(stage: int, data: int) -> dict:
    cfg = config(stage, data)
    setup = train.build(cfg, make_mesh(cfg.mesh, jax.devices()[:data]))
    pred, comp = accounting.predict(setup), accounting.compiled_figures(setup)
    mib = lambda d: {k: v / 2**20 for k, v in d.items()}
    return {"stage": stage, "data": data, "params_M": cfg.model.num_params / 1e6,
            "predicted_MiB": mib(pred["memory"]), "compiled_MiB": mib(comp["memory"])}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for stage in sorted({r["stage"] for r in rows}):
        rs = sorted((r for r in rows if r["stage"] == stage), key=lambda r: r["data"])
        x = [r["data"] for r in rs]
        state = [r["compiled_MiB"]["params"] + r["compiled_MiB"]["optimizer state"] for r in rs]
        pred = [r["predicted_MiB"]["params"] + r["predicted_MiB"]["optimizer state"] for r in rs]
        line, = axes[0].plot(x, state, "o-", label=f"ZeRO-{stage} compiled")
        axes[0].plot(x, pred, "x--", color=line.get_color(), label=f"ZeRO-{stage} predicted")
        temp = [r["compiled_MiB"]["temp (XLA)"] for r in rs]
        est = [r["predicted_MiB"]["gradients"] + r["predicted_MiB"]["compute copy"] +
               r["predicted_MiB"]["activations (estimate)"] for r in rs]
        axes[1].plot(x, temp, "o-", color=line.get_color(), label=f"ZeRO-{stage} XLA temp")
        axes[1].plot(x, est, "x--", color=line.get_color(), label=f"ZeRO-{stage} estimate")
    for ax, title in zip(axes, ("persistent state: fp32 params + Adam m, v",
                                "step temporaries: grads + compute copy + activations"),
                         strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("|data| (devices)")
        ax.set_ylabel("MiB per device")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"per-device memory vs ZeRO stage ({rows[0]['params_M']:.2f}M params, bf16 "
                 "compute, fp32 master)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> None:
    sizes = [1, 8] if "--quick" in argv else [1, 2, 4, 8]
    sizes = [d for d in sizes if d <= jax.device_count()]
    rows = []
    for stage in (0, 1, 2, 3):
        for d in sizes:
            rows.append(measure(stage, d))
            r = rows[-1]
            print(f"stage {stage} data {d}: state {r['compiled_MiB']['params'] + r['compiled_MiB']['optimizer state']:.3f} MiB "
                  f"(predicted {r['predicted_MiB']['params'] + r['predicted_MiB']['optimizer state']:.3f}), "
                  f"temp {r['compiled_MiB']['temp (XLA)']:.3f} MiB", flush=True)
    OUT.mkdir(exist_ok=True)
    meta = {"backend": jax.default_backend(), "jax": jax.__version__,
            "device_kind": jax.devices()[0].device_kind}
    (OUT / "zero_memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, OUT / "zero_memory.png")
    print(f"wrote {OUT / 'zero_memory.json'} and .png")


if __name__ == "__main__":
    main(sys.argv[1:])
