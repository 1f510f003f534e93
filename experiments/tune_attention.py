"""Sweep FlashAttention tile sizes / Triton launch parameters on the GPU.

    PYTHONPATH=. python3 experiments/tune_attention.py [--seq 4096] [--head-dims 128]

Times the forward alone over forward configs, then forward+backward over backward configs
(with the best forward), bf16, batch*seq = 16384 tokens, 16 heads, causal and not.
The winners become `BlockSizes.for_shape` defaults in pallas_kernels/flash_attention.py.
Writes tune_attention.json to $OUT (or /tmp).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from gendist.timing import median_seconds
from pallas_kernels.flash_attention import BlockSizes, flash_attention

# (block_q, block_k, num_warps, num_stages)
FWD = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
       (64, 128, 4, 2)]
# (block_q_dkv, block_k_dkv, block_q_dq, block_k_dq, num_warps, num_stages)
BWD = [(64, 128, 128, 64, 8, 2), (64, 128, 128, 64, 4, 2), (32, 128, 128, 32, 4, 3),
       (64, 64, 64, 64, 4, 2), (64, 128, 128, 64, 8, 3), (32, 128, 128, 32, 8, 2)]


def bench(f, *args, n=10, warm=2):
    return median_seconds(f, *args, n=n, warm=warm)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seq")
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args()
    s, heads = args.seq, args.heads
    b = max(1, args.tokens // s)
    rows = []
    for d in args.head_dims:
        base = BlockSizes.for_shape(d, jnp.bfloat16, on_gpu=True)
        ks = jax.random.split(jax.random.key(d), 4)
        q, k, v, do = (jax.random.normal(kk, (b, s, heads, d), jnp.bfloat16) for kk in ks)
        for causal in (False, True):
            flops = 4 * b * s * s * heads * d * (0.5 if causal else 1.0)
            best_fwd, best_t = base, float("inf")
            for bq, bk, w, st in FWD:
                blocks = dataclasses.replace(base, block_q=bq, block_k=bk, num_warps_fwd=w,
                                             num_stages_fwd=st)
                row = dict(kind="fwd", d=d, causal=causal, cfg=(bq, bk, w, st))
                try:
                    f = jax.jit(lambda q, k, v, bl=blocks, c=causal: flash_attention(
                        q, k, v, causal=c, block_sizes=bl))
                    t = bench(f, q, k, v)
                    row["tflops"] = flops / t / 1e12
                    if t < best_t:
                        best_fwd, best_t = blocks, t
                except Exception as e:  # e.g. out of shared memory for this tile
                    row["error"] = repr(e)[:200]
                rows.append(row)
                print(row, flush=True)
            for bqk, bkk, bqq, bkq, w, st in BWD:
                blocks = dataclasses.replace(best_fwd, block_q_dkv=bqk, block_k_dkv=bkk,
                                             block_q_dq=bqq, block_k_dq=bkq, num_warps_bwd=w,
                                             num_stages_bwd=st)
                row = dict(kind="fwdbwd", d=d, causal=causal, cfg=(bqk, bkk, bqq, bkq, w, st))
                try:
                    def loss(q, k, v, do, bl=blocks, c=causal):
                        o = flash_attention(q, k, v, causal=c, block_sizes=bl)
                        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
                    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
                    t = bench(g, q, k, v, do)
                    row["tflops"] = 3.5 * flops / t / 1e12
                except Exception as e:
                    row["error"] = repr(e)[:200]
                rows.append(row)
                print(row, flush=True)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "tune_attention.json"), "w") as fh:
        json.dump(dict(jax=jax.__version__, seq=s, rows=rows), fh, indent=1)
    for kind in ("fwd", "fwdbwd"):
        for d in args.head_dims:
            for causal in (False, True):
                ok = [r for r in rows if r["kind"] == kind and r["d"] == d
                      and r["causal"] == causal and "tflops" in r]
                if ok:
                    top = max(ok, key=lambda r: r["tflops"])
                    print(f"best {kind:6s} d={d} causal={causal}: {top['cfg']} "
                          f"{top['tflops']:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
