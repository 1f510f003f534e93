"""How close to the bandwidth floor does the output-layer kernel read the token table, against
XLA's output layer?

A batch-1 decode step ends with the final RMSNorm and the logits of one row against the
whole table: for Llama-3.2-1B's tied 128,256 x 2,048 table 525 MB, a fifth of the step's
bytes. This times `pallas_kernels.head.head_logits` over its tiles, warps and pipeline stages
against XLA's `decode_block.head_logits` (the norm, then the product), for the tables of
Llama-3.2-1B, Llama-3-8B (128,256 x 4,096) and a 32,000-token vocabulary, one row and five
(a speculative verification of four drafted tokens), each against the floor of reading the
table once at the read-only bandwidth measured in the same process.

    python experiments/head_kernel.py --out $OUT            # GPU
    python experiments/head_kernel.py --tiny --out /tmp/h   # CPU: interpret mode, tiny

Writes head_kernel_<device>.json to --out.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os

import jax
import jax.numpy as jnp

from gendist.config import ModelConfig
from gendist.inference import decode_block
from gendist.timing import pipelined_seconds, read_only_tbps, result_path, warm_gpu
from pallas_kernels import head as hk

TABLES = [("llama3.2-1b", 128256, 2048), ("llama3-8b", 128256, 4096), ("vocab-32k", 32000, 2048)]
TILES = [(bv, bd, w, 3) for bv, bd, w in itertools.product([32, 64, 128], [128, 256], [4, 8])]
TILES += [(hk.BLOCK_V, hk.BLOCK_D, 4, st) for st in (2, 4)]  # the default's pipeline depth


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="one small table, two tiles (CPU)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    args = ap.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    tables, tiles = ([("tiny", 512, 256)], [(64, 256, 4, 3), (32, 128, 4, 2)]) if args.tiny \
        else (TABLES, TILES)
    if on_gpu:
        warm_gpu()
    tbps = read_only_tbps(2.0 if on_gpu else 0.25)["pipelined"]
    rows_out = []
    for (name, V, D), R in itertools.product(tables, args.rows):
        cfg = ModelConfig(d_model=D, vocab_size=V, num_layers=1, num_heads=D // 128,
                          num_kv_heads=D // 128, head_dim=128, d_ff=D, dtype="bfloat16")
        ks = jax.random.split(jax.random.key(0), 3)
        params = {"embed": (0.02 * jax.random.normal(ks[0], (V, D))).astype(jnp.bfloat16),
                  "final_norm": jnp.ones((D,), jnp.float32)}
        x = jax.random.normal(ks[1], (1, R, D), jnp.float32).astype(jnp.bfloat16)
        floor_us = V * D * 2 / (tbps * 1e12) * 1e6
        xla = jax.jit(functools.partial(decode_block.head_logits, cfg=cfg))
        row = {"table": name, "vocab": V, "width": D, "rows": R, "floor_us": floor_us,
               "xla_us": pipelined_seconds(xla, params, x, n=args.iters)[0] * 1e6, "kernel_us": {}}
        for bv, bd, w, st in tiles:
            f = jax.jit(functools.partial(hk.head_logits, eps=1e-5, block_v=bv, block_d=bd,
                                          num_warps=w, num_stages=st))
            key = f"{bv}x{bd}/w{w}/s{st}"
            try:
                row["kernel_us"][key] = pipelined_seconds(
                    f, x[0], params["final_norm"], params["embed"], n=args.iters)[0] * 1e6
            except Exception as e:  # noqa: BLE001 - a tile that does not fit: say so, go on
                row["kernel_us"][key] = f"{type(e).__name__}: {str(e)[:200]}"
        timed = {k: v for k, v in row["kernel_us"].items() if isinstance(v, float)}
        best = min(timed, key=timed.get)
        default = f"{hk.BLOCK_V}x{hk.BLOCK_D}/w4/s3"
        row.update(best=best, best_us=timed[best], default_us=timed.get(default))
        print(f"{name} rows {R}: floor {floor_us:.1f} us; XLA {row['xla_us']:.1f} "
              f"({floor_us / row['xla_us']:.0%} of the floor's speed); kernel default "
              f"{timed.get(default, float('nan')):.1f}, best {best} {timed[best]:.1f} "
              f"({floor_us / timed[best]:.0%})", flush=True)
        rows_out.append(row)
    dev = jax.devices()[0]
    res = {"device": dev.device_kind, "jax": jax.__version__, "read_only_TBps": tbps,
           "cases": rows_out}
    result_path(args.out, "head_kernel").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
