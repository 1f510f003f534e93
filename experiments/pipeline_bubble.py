"""Pipeline bubble and activation memory of GPipe vs 1F1B against the number of microbatches.

Both schedules idle (p-1)/(m+p-1) of the time with unit-cost forwards and backwards
(GPipe, Huang et al. 2019; 1F1B of PipeDream-Flush, Narayanan et al. 2019 and Megatron-LM,
Narayanan et al. 2021), but GPipe keeps all m microbatch inputs per stage while 1F1B keeps
at most p. This script runs `gendist.parallel.pipeline` (one shard_map over `pipeline`, a
static table, ppermute between stages) on a small residual-MLP model and reports, for
m in `--microbatches`:
  * the bubble counted from the table and the analytic (p-1)/(m+p-1);
  * a bubble estimated from measured step times: fit t(m) = a*m + b and report
    1 - a*m / t(m) (the fraction of the step not explained by per-microbatch work);
  * temp memory of the compiled step (`memory_analysis().temp_size_in_bytes`) at a fixed
    microbatch size, next to the predicted input+cotangent buffers 2*(slots+1)*bytes(x);
  * a time x stage picture of each schedule.

Run (CPU, 8 simulated devices, a few minutes):
    python experiments/pipeline_bubble.py --out benchmarks/

Expected: table bubble equals the analytic curve exactly for both schedules; GPipe's temp
memory grows linearly in m (by exactly the predicted buffers) while 1F1B's stays flat
beyond m = p. The measured bubble is only indicative on CPU: simulated devices share the
host's few cores, so an idle stage lends its cores to busy ones and the fit mostly sees
fixed per-step costs. On real devices note that all stages of one SPMD program step in
lockstep, so a step costs its slowest action (a backward with recomputation costs about
three forwards), which the unit-cost table ignores.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from gendist.parallel import pipeline as pl  # noqa: E402
from gendist.parallel.pipeline import plan as SP  # noqa: E402
from gendist.parallel.pipeline import schedules as S  # noqa: E402
from gendist.parallel.pipeline import stats as SS  # noqa: E402
from gendist.timing import call_times  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/", help="folder for pipeline_*.json/.png")
    ap.add_argument("--stages", type=int, default=4, help="pipeline mesh axis size")
    ap.add_argument("--microbatches", default="1,2,4,8,16,32", help="comma-separated m values")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--mb-size", type=int, default=2, help="sequences per microbatch per data shard")
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20, help="timed steps (the minimum is kept)")
    return ap.parse_args(argv)


def toy_model(key, args):
    """Embedding, residual tanh-MLP layers stacked on [L, ...], linear head + cross-entropy."""
    d, v, n = args.d_model, args.vocab, args.layers
    k = jax.random.split(key, 4)
    params = {"embed": {"tok": jax.random.normal(k[0], (v, d))},
              "layers": {"w1": jax.random.normal(k[1], (n, d, 2 * d)) / np.sqrt(d),
                         "w2": jax.random.normal(k[2], (n, 2 * d, d)) / np.sqrt(4 * d)},
              "head": {"w": jax.random.normal(k[3], (d, v)) / np.sqrt(d)}}

    def layer_fn(lp, x_BTD):
        return x_BTD + jnp.tanh(x_BTD @ lp["w1"]) @ lp["w2"]

    def head_loss_fn(hp, x_BTD, targets_BT):
        logp_BTV = jax.nn.log_softmax(x_BTD @ hp["w"])
        return -jnp.take_along_axis(logp_BTV, targets_BT[..., None], -1).sum(), targets_BT.size

    fns = dict(embed_fn=lambda e, t: e["tok"][t], layer_fn=layer_fn, head_loss_fn=head_loss_fn)
    return params, fns


def measure(params, fns, mesh, name, m, args, data):
    """Compiled temp bytes, compile seconds and the best of `reps` step times."""
    shape = (data * m * args.mb_size, args.seq)
    tokens = jax.random.randint(jax.random.key(m), shape, 0, args.vocab)
    step = jax.jit(functools.partial(pl.pipeline_loss_and_grads, mesh=mesh, schedule=name,
                                     num_microbatches=m, **fns))
    t0 = time.perf_counter()
    compiled = step.lower(params, tokens, tokens).compile()
    compile_s = time.perf_counter() - t0
    times, _ = call_times(compiled, params, tokens, tokens, n=args.reps, warm=1)
    sched = S.make(name, args.stages, m)
    x_bytes = args.mb_size * args.seq * args.d_model * 4
    return {
        "schedule": name, "microbatches": m, "steps": sched.num_steps,
        "bubble_table": SS.bubble_fraction(sched),
        "bubble_analytic": SS.analytic_bubble_fraction(args.stages, m),
        "max_in_flight": SS.max_in_flight(sched),
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "predicted_buffer_bytes": 2 * (SP.buffer_plan(sched).num_slots + 1) * x_bytes,
        "compile_s": compile_s, "step_s_min": min(times), "step_s_median": float(np.median(times)),
    }


def add_measured_bubble(rows):
    """Fit t(m) = a*m + b per schedule; bubble(m) = 1 - a*m / t(m)."""
    for name in {r["schedule"] for r in rows}:
        mine = [r for r in rows if r["schedule"] == name]
        ms = np.array([r["microbatches"] for r in mine], float)
        ts = np.array([r["step_s_min"] for r in mine])
        a, b = np.polyfit(ms, ts, 1)
        for r in mine:
            r["bubble_measured"] = float(1 - a * r["microbatches"] / r["step_s_min"])
            r["fit_s_per_microbatch"], r["fit_s_fixed"] = float(a), float(b)


def plot(rows, args, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"gpipe": "o-", "1f1b": "s--"}
    fig, (ax_b, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for name in ("gpipe", "1f1b"):
        mine = [r for r in rows if r["schedule"] == name]
        ms = [r["microbatches"] for r in mine]
        ax_b.plot(ms, [r["bubble_table"] for r in mine], styles[name], label=f"{name} table")
        ax_b.plot(ms, [r["bubble_measured"] for r in mine], styles[name], alpha=0.5,
                  label=f"{name} measured (CPU, indicative)")
        ax_m.plot(ms, [r["temp_bytes"] / 1024 for r in mine], styles[name], label=name)
    ms = sorted({r["microbatches"] for r in rows})
    p = args.stages
    ax_b.plot(ms, [(p - 1) / (m + p - 1) for m in ms], "k:", label="(p-1)/(m+p-1)")
    for ax in (ax_b, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("microbatches m")
        ax.legend(fontsize=8)
    ax_b.set_ylabel("bubble fraction")
    ax_b.set_title(f"bubble, p={p}")
    ax_m.set_ylabel("compiled temp memory per device (KiB)")
    ax_m.set_title(f"activation memory at fixed microbatch size, p={p}")
    fig.tight_layout()
    fig.savefig(out / "pipeline_bubble.png", dpi=120)
    fig, axes = plt.subplots(2, 1, figsize=(12, 5))
    for ax, name in zip(axes, ("gpipe", "1f1b"), strict=True):
        SS.plot(S.make(name, p, 2 * p), ax=ax)
    fig.tight_layout()
    fig.savefig(out / "pipeline_schedules.png", dpi=120)


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    p = args.stages
    devices = jax.devices()
    if len(devices) % p:
        raise ValueError(f"--stages={p} must divide the {len(devices)} devices")
    data = len(devices) // p
    mesh = Mesh(np.array(devices).reshape(data, p, 1, 1), ("data", "pipeline", "expert", "tensor"))
    params, fns = toy_model(jax.random.key(0), args)
    for name in ("gpipe", "1f1b"):
        print(SS.to_text(S.make(name, p, 2 * p)), "\n")
    rows = []
    for m in [int(x) for x in args.microbatches.split(",")]:
        for name in ("gpipe", "1f1b"):
            rows.append(measure(params, fns, mesh, name, m, args, data))
            r = rows[-1]
            print(f"{name:5s} m={m:3d} bubble table {r['bubble_table']:.3f} analytic "
                  f"{r['bubble_analytic']:.3f}  temp {r['temp_bytes'] / 1024:8.1f} KiB "
                  f"(buffers {r['predicted_buffer_bytes'] / 1024:6.1f})  step {r['step_s_min'] * 1e3:7.1f} ms",
                  flush=True)
    add_measured_bubble(rows)
    for r in rows:
        print(f"{r['schedule']:5s} m={r['microbatches']:3d} measured bubble {r['bubble_measured']:.3f} "
              f"(table {r['bubble_table']:.3f})")
    print(f"note: step times come from {devices[0].platform.upper()} "
          + ("simulated devices sharing the host's cores; the measured bubble is indicative only"
             if devices[0].platform == "cpu" else "devices"))
    result = {"config": vars(args), "data": data, "jax": jax.__version__,
              "platform": devices[0].platform, "device": devices[0].device_kind,
              "host": platform.node(), "rows": rows,
              "pictures": {n: SS.to_text(S.make(n, p, 2 * p)) for n in ("gpipe", "1f1b")},
              "note": "CPU timings on simulated devices are indicative; table bubble is exact"}
    (out / "pipeline_bubble.json").write_text(json.dumps(result, indent=1))
    plot(rows, args, out)
    print(f"wrote {out / 'pipeline_bubble.json'}, pipeline_bubble.png, pipeline_schedules.png")


if __name__ == "__main__":
    main()
