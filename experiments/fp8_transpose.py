"""How fast does the float8 transpose kernel move a matrix, against XLA's transpose and the
bandwidth floor?

FP8 GEMMs on Hopper take both operands with the contracted axis minor, so an FP8 product
transposes three float8 tensors a step (`gendist.models.fp8`). For the shapes of the FP8
benchmark's products (tokens 8 x 2048 against widths 2048-14336, and a 4096 x 4096 weight)
this times `pallas_kernels.transpose` over its tile sizes and warps, and `x.T` compiled by
XLA alone, against the floor of reading and writing the matrix once at 4.23 TB/s (the best
read-only bandwidth measured on this H200, `benchmarks/decode.md`).

    python experiments/fp8_transpose.py --out benchmarks        # GPU
    python experiments/fp8_transpose.py --tiny --out /tmp/t     # CPU: interpret mode, tiny

Writes fp8_transpose_<device>.json to --out.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os

import jax
import jax.numpy as jnp

from gendist.timing import pipelined_seconds, result_path
from pallas_kernels import transpose as tk

BANDWIDTH = 4.23e12  # bytes/s
SHAPES = [(16384, 4096), (16384, 14336), (4096, 4096), (16384, 2048)]
TILES = [(bm, bn, w) for bm, bn, w in itertools.product([32, 64, 128], [32, 64, 128], [4, 8])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="one small shape, two tiles (CPU)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    args = ap.parse_args()
    shapes, tiles = ([(256, 128)], [(32, 128, 8), (64, 64, 4)]) if args.tiny else (SHAPES, TILES)
    dev = jax.devices()[0]
    rows = []
    for shape in shapes:
        x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16).astype(jnp.float8_e4m3fn)
        row = {"shape": shape, "floor_us": 2 * x.size / BANDWIDTH * 1e6,
               "xla_us": pipelined_seconds(jax.jit(lambda a: a.T), x, n=args.iters)[0] * 1e6,
               "kernel_us": {}}
        for bm, bn, w in tiles:
            f = jax.jit(functools.partial(tk.transpose, block=(bm, bn), num_warps=w))
            row["kernel_us"][f"{bm}x{bn}/w{w}"] = pipelined_seconds(f, x, n=args.iters)[0] * 1e6
        default = row["kernel_us"].get(f"{tk.BLOCK[0]}x{tk.BLOCK[1]}/w{tk.NUM_WARPS}")
        best = min(row["kernel_us"], key=row["kernel_us"].get)
        print(f"{shape}: floor {row['floor_us']:.0f} us, XLA {row['xla_us']:.0f}, kernel "
              f"(default tile) {default or float('nan'):.0f}, best {best} "
              f"{row['kernel_us'][best]:.0f}", flush=True)
        rows.append(row)
    total = {t: sum(r["kernel_us"][t] for r in rows) for t in rows[0]["kernel_us"]}
    res = {"device": dev.device_kind, "jax": jax.__version__, "bandwidth": BANDWIDTH,
           "default_tile": f"{tk.BLOCK[0]}x{tk.BLOCK[1]}/w{tk.NUM_WARPS}", "shapes": rows,
           "kernel_total_us": total, "xla_total_us": sum(r["xla_us"] for r in rows),
           "floor_total_us": sum(r["floor_us"] for r in rows)}
    print("sum over the shapes (us): floor {:.0f}, XLA {:.0f}, kernel tiles best first: {}".format(
        res["floor_total_us"], res["xla_total_us"],
        ", ".join(f"{t} {v:.0f}" for t, v in sorted(total.items(), key=lambda kv: kv[1])[:4])))
    result_path(args.out, "fp8_transpose").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
