"""Does our attention need more energy per call than cuDNN's at the 1b step's shape?

The 1b training step runs at the H200's 700 W limit (benchmarks/training.md: 689-692 W, SM clock
~1,515 MHz against 1,980 alone), where a kernel's speed follows the energy it needs rather
than its speed at full clock. Alone, our forward+backward at this shape is ~1.1x cuDNN's, yet
the step with ours is level with cuDNN's. This measures what each form draws: every
implementation runs forward+backward calls back to back for a few seconds, in turn, with
nvidia-smi sampling board power and SM clock every 50 ms; energy per call = mean power over
the window (its first half second left out) x seconds per call.

    python3 experiments/attention_energy.py --out $OUT      # one H200; --smoke on a CPU
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from gendist.timing import warm_gpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attention_in_step  # noqa: E402  (the attention forms, shared)


def fwd_bwd(impl: str):
    return jax.jit(attention_in_step.fwd_bwd(impl))


def sampler():
    """nvidia-smi sampling (local time, W, MHz) every 50 ms, or None without one."""
    try:
        return subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,power.draw,clocks.sm", "--format=csv,noheader,nounits",
             "-lms", "50"], stdout=subprocess.PIPE, text=True)
    except FileNotFoundError:
        return None


def samples(proc) -> list[tuple[float, float, float]]:
    proc.terminate()
    out = proc.communicate()[0]
    rows = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((t, float(parts[1]), float(parts[2])))
        except (ValueError, IndexError):
            continue
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", nargs="*", default=["ours", "cudnn", "ours_fused", "ours_steps_delta_off"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=3.0, help="each turn's window")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, XLA attention")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.smoke:
        B, S, N, D, impls = 2, 128, 2, 64, ["xla"]
    else:  # the 1b step's attention
        B, S, N, D, impls = 24, 2048, 16, 128, args.impls
        warm_gpu(3.0)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (B, S, N, D), jnp.bfloat16) for kk in keys)
    flops = 4 * B * S * S * N * D / 2 * 3.5
    fns = {i: fwd_bwd(i) for i in impls}
    for f in fns.values():
        jax.block_until_ready(f(q, k, v, do))
    proc = None if args.smoke else sampler()
    windows = []
    for rnd in range(args.rounds):
        for impl in impls:
            f, calls = fns[impl], 0
            t0 = time.time()
            out = None
            while time.time() - t0 < args.seconds:
                for _ in range(5):
                    out = f(q, k, v, do)
                calls += 5
                jax.block_until_ready(out)
            t1 = time.time()
            windows.append(dict(impl=impl, round=rnd, t0=t0, t1=t1, calls=calls,
                                ms_per_call=(t1 - t0) / calls * 1e3))
    smi = [] if proc is None else samples(proc)
    rows = []
    for w in windows:
        sel = [(p, c) for t, p, c in smi if w["t0"] + 0.5 <= t <= w["t1"]]
        if sel:
            w["watts"] = float(np.mean([p for p, _ in sel]))
            w["sm_mhz"] = float(np.mean([c for _, c in sel]))
            w["joules_per_call"] = w["watts"] * w["ms_per_call"] * 1e-3
            w["tflops_per_kj"] = flops / w["joules_per_call"] * 1e-12 * 1e3
        w["tflops"] = flops / (w["ms_per_call"] * 1e-3) * 1e-12
        rows.append(w)
        print({k_: (round(v_, 3) if isinstance(v_, float) else v_) for k_, v_ in w.items()
               if k_ not in ("t0", "t1")}, flush=True)
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "shape": dict(B=B, S=S, N=N, D=D, causal=True), "fwdbwd_flops": flops,
           "samples": len(smi), "windows": rows}
    with open(os.path.join(args.out, "attention_energy.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
