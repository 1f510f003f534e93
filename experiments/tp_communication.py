"""Communication of one train step vs tensor-parallel degree, read from the compiled HLO.

    python experiments/tp_communication.py        # CPU: 8 simulated devices, ~3 minutes

For tensor in {1, 2, 4, 8} (data = 1, the same global batch) and sequence parallelism off
and on, the step is compiled and every collective over `tensor` is summed from the HLO
(payload bytes per device and step; loop trip counts included). Beside it: the
prediction for this backend and Megatron's ideal (Shoeybi et al. 2019: 4 all-reduces of
[B, T, D] per layer per step; Korthikanti et al. 2022: with sequence parallelism the same
volume as reduce-scatters plus all-gathers). Payload per device does not shrink with the
degree; the bytes a ring puts on the wire grow as 2(t-1)/t of it, so tensor parallelism
belongs inside a node's fast links. Writes benchmarks/tp_communication.{json,png}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if "jax" not in sys.modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from gendist import accounting, collectives
from gendist.config import Config, MeshConfig, ModelConfig, TrainConfig  # noqa: E402
from gendist.sharding import make_mesh  # noqa: E402
from gendist.training import train  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "benchmarks"


def config(tensor: int, sp: bool) -> Config:
    model = ModelConfig(d_model=256, num_layers=4, num_heads=8, num_kv_heads=8, head_dim=32,
                        d_ff=768, max_seq_len=64)
    return Config(model=model, mesh=MeshConfig(data=1, tensor=tensor, sequence_parallel=sp),
                  train=TrainConfig(batch_size=8, seq_len=32, tensorboard=False,
                                    progress=False))


def tensor_bytes(comm: dict) -> dict[str, float]:
    return {kind: v for (kind, axes), v in comm.items() if axes == "tensor"}


def measure(tensor: int, sp: bool) -> dict:
    cfg = config(tensor, sp)
    setup = train.build(cfg, make_mesh(cfg.mesh, jax.devices()[:tensor]))
    comp = accounting.compiled_figures(setup)
    row = {"tensor": tensor, "sequence_parallel": sp,
           "compiled": tensor_bytes(comp["comm"]),
           "predicted": tensor_bytes(accounting.predict(setup)["comm"]),
           "ideal": tensor_bytes(accounting.predict(setup, "gpu")["comm"])}
    row["wire_compiled"] = sum(collectives.wire_bytes(c.kind, c.payload * c.count, tensor)
                               for c in comp["collectives"] if c.axes == "tensor")
    row["wire_ideal"] = sum(collectives.wire_bytes(k, v, tensor) for k, v in row["ideal"].items())
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for sp, marker in ((False, "o"), (True, "s")):
        rs = sorted((r for r in rows if r["sequence_parallel"] == sp and r["tensor"] > 1),
                    key=lambda r: r["tensor"])
        x = [r["tensor"] for r in rs]
        tag = "SP" if sp else "no SP"
        for key, style in (("compiled", "-"), ("predicted", ":"), ("ideal", "--")):
            axes[0].plot(x, [sum(r[key].values()) / 2**20 for r in rs], marker + style,
                         label=f"{tag} {key}")
        axes[1].plot(x, [r["wire_compiled"] / 2**20 for r in rs], marker + "-",
                     label=f"{tag} compiled (XLA:CPU)")
        axes[1].plot(x, [r["wire_ideal"] / 2**20 for r in rs], marker + "--",
                     label=f"{tag} Megatron ideal")
    for ax, title in zip(axes, ("payload over `tensor` per device per step",
                                "ring bytes sent per device per step"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tensor-parallel degree")
        ax.set_ylabel("MiB")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    rows = []
    for t in (1, 2, 4, 8):
        for sp in (False, True):
            if t > jax.device_count() or (sp and t == 1):
                continue
            rows.append(measure(t, sp))
            r = rows[-1]
            print(f"tensor {t} sp {sp}: compiled {sum(r['compiled'].values()) / 2**20:.3f} MiB "
                  f"(predicted {sum(r['predicted'].values()) / 2**20:.3f}, Megatron ideal "
                  f"{sum(r['ideal'].values()) / 2**20:.3f}) {r['compiled']}", flush=True)
    OUT.mkdir(exist_ok=True)
    meta = {"backend": jax.default_backend(), "jax": jax.__version__}
    (OUT / "tp_communication.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                          indent=1))
    plot(rows, OUT / "tp_communication.png")
    print(f"wrote {OUT / 'tp_communication.json'} and .png")


if __name__ == "__main__":
    main()
