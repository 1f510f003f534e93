"""Why does our attention run slower inside the 1b training step than alone?

Profiled inside the 1b step (batch 24) our dK/dV kernel took 1.81-1.85 ms a layer against
1.50 ms alone at the same shape: our three kernels 4.20 ms a layer in the step, 3.48
alone (+21%); cuDNN's 3.87 against 3.57 (+8%). This times the attention's kernels (device
time from a profile) at the training shape, ours and cuDNN in one process, in three settings:

- alone: forward+backward calls back to back;
- after_matmul: each call preceded, in the same jitted program, by bf16 matmuls of about
  what a 1b layer's matmuls take in the step (500 ms / 22 layers ~ 20 ms);
- after_copy: preceded by a memory-bound pass of about the same time (little tensor-core
  power).

If ours slows after matmuls and not after copies, the step's loss is power (our two-kernel
backward does 7 tile matmuls per tile pair, cuDNN's 5), not the step's data or layout.
`ours_fused` is the 5-matmul fused backward at the same shape.

    python3 experiments/attention_in_step.py --out $OUT    # one H200; --smoke on a CPU
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import time

import jax
import jax.numpy as jnp

from gendist import profiling
from gendist.timing import pipelined_seconds, warm_gpu
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.flash_attention_mgpu import MosaicBlockSizes

# the forms of ours (MosaicBlockSizes fields): the defaults, the fused 5-matmul backward, and
# the two-kernel backward without each consumer's own causal steps and with delta computed
# by XLA (both now on by default); the backward through dS in global memory
FORMS = {"ours": None, "ours_fused": dict(fused_bwd=True),
         "ours_steps_delta_off": dict(own_causal_steps=False, delta_in_dq=False),
         "ours_ds": dict(ds_in_hbm=True)}  # dS^T stored by the dK/dV kernel, then dQ = dS K


def attention_fn(impl: str):
    """Causal attention (q, k, v) -> o by `impl`: cudnn, xla (CPU smoke) or a form of ours."""
    if impl == "cudnn":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                            implementation="cudnn")
    if impl == "xla":  # --smoke on a CPU
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    sizes = None if FORMS[impl] is None else MosaicBlockSizes(**FORMS[impl])
    return lambda q, k, v: flash_attention(q, k, v, causal=True, block_sizes=sizes)


def fwd_bwd(impl: str):
    attn = attention_fn(impl)

    def f(q, k, v, do):
        o, vjp = jax.vjp(attn, q, k, v)
        return (o, *vjp(do))
    return f


def heater(kind: str, reps: int):
    """x -> x after `reps` matmuls [n, n] @ [n, n] or `reps` elementwise passes, each its own
    kernel (optimization barriers keep XLA from fusing the passes)."""
    def mm(x):
        for _ in range(reps):
            x = jax.lax.optimization_barrier(x @ x.T * (1.0 / x.shape[0]))
        return x

    def copy(x):
        for _ in range(reps):
            x = jax.lax.optimization_barrier(x * 0.999 + 1e-3)
        return x
    return {"matmul": mm, "copy": copy}[kind]


def program(impl: str, setting: str, mm_reps: int, copy_reps: int):
    """(q, k, v, do, x) -> (x, o, dq, dk, dv): the heater (if any), then the attention, which
    waits for it (an optimization barrier over both)."""
    f = fwd_bwd(impl)
    if setting == "alone":
        return jax.jit(lambda q, k, v, do, x: (x, *f(q, k, v, do)))
    heat = heater(setting.removeprefix("after_"),
                  mm_reps if setting == "after_matmul" else copy_reps)

    def prog(q, k, v, do, x):
        x = heat(x)
        x, q = jax.lax.optimization_barrier((x, q))
        return (x, *f(q, k, v, do))
    return jax.jit(prog)


def kernel_times(fn, args, calls: int) -> dict[str, float]:
    """{kernel name: device seconds per call} over `calls` back-to-back calls, profiled."""
    jax.block_until_ready(fn(*args))
    with profiling.trace() as prof:
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
    per = collections.Counter()
    for name, _hlo, dur in profiling.device_events(prof.profile_data):
        per[name] += dur / calls
    return dict(per)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", nargs="*", default=["ours", "cudnn", "ours_fused"])
    ap.add_argument("--settings", nargs="*", default=["alone", "after_matmul", "after_copy"])
    ap.add_argument("--rounds", type=int, default=2, help="each (impl, setting) this many turns")
    ap.add_argument("--calls", type=int, default=8, help="profiled calls per turn")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, XLA attention")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.smoke:
        B, S, N, D, n, mm_reps, copy_reps = 2, 128, 2, 64, 256, 2, 2
        impls = ["xla"]
    else:  # the 1b step's attention; heaters of ~20 ms (a 1b layer's matmuls in the step)
        B, S, N, D, n, mm_reps, copy_reps = 24, 2048, 16, 128, 8192, 12, 24
        impls = args.impls
        warm_gpu(3.0)
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v, do = (jax.random.normal(kk, (B, S, N, D), jnp.bfloat16) for kk in keys[:4])
    x_mm = jax.random.normal(keys[4], (n, n), jnp.bfloat16)
    x_copy = jnp.ones((n * 8, n * 8), jnp.bfloat16)  # 1 GiB at n = 8192
    flops = 4 * B * S * S * N * D / 2 * 3.5
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "shape": dict(B=B, S=S, N=N, D=D, causal=True), "fwdbwd_flops": flops, "rows": []}
    heater_names = {}
    for setting in args.settings:  # the heaters' own kernels, to tell them from attention's
        if setting == "alone":
            continue
        kind = setting.removeprefix("after_")
        x = x_mm if kind == "matmul" else x_copy
        h = jax.jit(heater(kind, mm_reps if kind == "matmul" else copy_reps))
        heater_names[setting] = kernel_times(h, (x,), 2)
        res[f"heater_{setting}_ms"] = pipelined_seconds(h, x, n=5)[0] * 1e3
        print(setting, "heater", f"{res[f'heater_{setting}_ms']:.2f} ms", flush=True)
    fns = {(i, s): program(i, s, mm_reps, copy_reps) for i in impls for s in args.settings}
    alone_names: dict[str, set] = {}  # each impl's attention kernels, named as when alone
    for rnd in range(args.rounds):
        for setting in args.settings:
            x = x_copy if setting == "after_copy" else x_mm
            for impl in impls:
                t0 = time.time()
                per = kernel_times(fns[impl, setting], (q, k, v, do, x), args.calls)
                skip = heater_names.get(setting, {})
                if setting == "alone":
                    alone_names.setdefault(impl, set()).update(per)
                known = alone_names.get(impl)
                attn = {kn: s for kn, s in per.items()
                        if kn not in skip and (known is None or kn in known)}
                other = {kn: round(s * 1e6, 1) for kn, s in per.items()
                         if kn not in skip and kn not in attn}  # neither: should stay empty
                total = sum(attn.values())
                row = {"impl": impl, "setting": setting, "round": rnd, "unix_time": t0,
                       "attention_ms": total * 1e3, "tflops": flops / total / 1e12,
                       "kernels_us": {kn: round(s * 1e6, 1) for kn, s in
                                      sorted(attn.items(), key=lambda kv: -kv[1])[:8]},
                       "unclassified_us": other}
                res["rows"].append(row)
                print(f"{impl:11} {setting:13} r{rnd} attention {total * 1e3:7.3f} ms "
                      f"({row['tflops']:.0f} TFLOP/s)  {list(row['kernels_us'].values())[:4]}",
                      flush=True)
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, "attention_in_step.json"), "w") as fh:
                    json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
