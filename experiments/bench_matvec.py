"""The matrix-vector kernels alone, per call, on a GPU, beside the XLA they replace.

`pallas_kernels.matvec` at one row (a batch-1 decode step): the plain product, the down
projection with SwiGLU fused in, and the output projection with the split merge fused in,
for the 350m and 1b presets' shapes, over a few tilings; beside each, XLA doing the same
(the product alone; SwiGLU then the product; `merge_splits` then the product: two kernels).
Each timed function chains `--chain` calls inside one jit (each call's input depends on the
previous output), so a call's time includes its launch and gap, as in a decode step.

    python experiments/bench_matvec.py --out $OUT

Writes `matvec_<device>.json`: µs per call, and the weight bytes ÷ time in TB/s.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import matvec
from pallas_kernels.paged_attention import merge_splits

# name: (D = outputs, F = MLP width, heads, head_dim, splits) of the 350m and 1b presets
SHAPES = {"350m": (1024, 2816, 16, 64, 5), "1b": (2048, 5632, 16, 128, 5)}
TILINGS = ["", "o4", "o4_i1024", "o8_i1024", "o4_i4096", "o8_i4096_w8", "o4_i1024_w8",
           "o2_i1024", "o4_i1024_st2", "o16_i1024_w8"]


def time_us(fn, args, chain: int, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) / chain * 1e6


def chained(step, chain):
    """A jit of `chain` calls of step(x, *rest) -> y [1, D], each x perturbed by the last y."""
    def fn(x, *rest):
        acc = jnp.zeros((), jnp.float32)
        for _ in range(chain):
            y = step(x, *rest)
            s = y[0, 0].astype(jnp.float32)
            acc = acc + s
            x = x + (s * 1e-6).astype(x.dtype)  # the next call depends on this one
        return acc
    return jax.jit(fn)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tilings", nargs="+", default=TILINGS)
    ap.add_argument("--chain", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--warm-s", type=float, default=2.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    ap.add_argument("--interpret", action="store_true", help="a CPU smoke test of this script")
    args = ap.parse_args()
    interp = args.interpret
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    warm = jnp.ones((4096, 4096), jnp.bfloat16)
    while time.perf_counter() - t_start < args.warm_s:
        jax.block_until_ready(warm @ warm)
    res = dict(device=dev.device_kind, jax=jax.__version__, chain=args.chain, rows={})
    path = Path(args.out) / f"matvec_{dev.device_kind.replace(' ', '_').lower()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    bf = jnp.bfloat16
    hi = dict(preferred_element_type=jnp.float32)
    for name in args.shapes:
        D, F, N, H, S = SHAPES[name]
        ks = jax.random.split(jax.random.key(0), 6)
        w_down = jax.random.normal(ks[0], (D, F), bf)
        w_o = jax.random.normal(ks[1], (D, N * H), bf)
        gu = jax.random.normal(ks[2], (1, 2 * F), bf)
        o = jax.random.normal(ks[3], (S, 1, N, 1, H), jnp.float32)
        m = jax.random.normal(ks[4], (S, 1, N, 1), jnp.float32)
        l = jax.random.uniform(ks[5], (S, 1, N, 1), jnp.float32) + 1.0
        xla = {
            "down": lambda gu, w: jnp.einsum("bf,df->bd", gu[:, :F], w, **hi).astype(bf),
            "swiglu_down": lambda gu, w: jnp.einsum(
                "bf,df->bd", jax.nn.silu(gu[:, :F]) * gu[:, F:], w, **hi).astype(bf),
            "merge_out": lambda o, m, l, w: jnp.einsum(
                "bi,di->bd", merge_splits(o, m, l).astype(bf).reshape(1, N * H), w,
                **hi).astype(bf),
        }
        kern = {
            "down": lambda gu, w, t: matvec.matvec(gu[:, :F], w, interpret=interp, **t),
            "swiglu_down": lambda gu, w, t: matvec.swiglu_matvec(gu, w, interpret=interp, **t),
            "merge_out": lambda o, m, l, w, t: matvec.merge_matvec(o, m, l, w, group=1,
                                                                    interpret=interp, **t),
        }
        inputs = {"down": (gu, w_down), "swiglu_down": (gu, w_down), "merge_out": (o, m, l, w_o)}
        wbytes = {"down": D * F * 2, "swiglu_down": D * F * 2, "merge_out": D * N * H * 2}
        for op in xla:
            row = {}
            us = time_us(chained(xla[op], args.chain), inputs[op], args.chain, args.reps)
            row["xla"] = us
            print(name, op, "xla", f"{us:.2f} us", f"{wbytes[op] / us / 1e6:.2f} TB/s", flush=True)
            for tag in args.tilings:
                if time.perf_counter() - t_start > args.budget_s:
                    break
                t = matvec.parse_tiling(tag)
                try:
                    fn = chained(functools.partial(kern[op], t=t), args.chain)
                    us = time_us(fn, inputs[op], args.chain, args.reps)
                    row[tag or "default"] = us
                    print(name, op, tag or "default", f"{us:.2f} us",
                          f"{wbytes[op] / us / 1e6:.2f} TB/s", flush=True)
                except Exception as e:  # noqa: BLE001 - a tiling that does not compile is data
                    row[tag or "default"] = repr(e)[:300]
                    print(name, op, tag, repr(e)[:200], flush=True)
            res["rows"][f"{name}/{op}"] = dict(us=row, weight_bytes=wbytes[op])
            path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
