"""How fast are the Pallas matmul against XLA's dot, and the online (2-pass) softmax against the
safe (3-pass) one?

    PYTHONPATH=.:$PYTHONPATH python3 experiments/bench_matmul_softmax.py     # on the GPU
    python3 experiments/bench_matmul_softmax.py --smoke                      # CPU, interpret

Softmax bandwidth counts the useful bytes (read the row once, write it once), so a kernel
that reads the row three times shows lower GB/s; the online kernel should gain up to 4/3
(4 row transfers against 3) when the re-reads miss in L2. Writes kernels.json to $OUT.
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from gendist.timing import median_seconds
from pallas_kernels import matmul as mm
from pallas_kernels import softmax as sm


def bench(f, *args, n=10, warm=2):
    return median_seconds(f, *args, n=n, warm=warm)


def matmuls(sizes, interpret, configs):
    rows = []
    for n in sizes:
        ka, kb = jax.random.split(jax.random.key(n))
        a = jax.random.normal(ka, (n, n), jnp.bfloat16)
        b = jax.random.normal(kb, (n, n), jnp.bfloat16)
        flops = 2 * n**3
        xla = jax.jit(lambda a, b: a @ b)
        t_xla = bench(xla, a, b)
        ref = xla(a, b).astype(jnp.float32)
        for cfg in configs:
            row = dict(n=n, cfg=list(cfg), xla_tflops=flops / t_xla / 1e12)
            try:
                blocks = mm.BlockSizes(*cfg)
                f = jax.jit(lambda a, b, bl=blocks: mm.matmul(a, b, block_sizes=bl,
                                                              interpret=interpret))
                out = f(a, b).astype(jnp.float32)
                row["rel_err"] = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
                row["tflops"] = flops / bench(f, a, b) / 1e12
                row["ratio_to_xla"] = row["tflops"] / row["xla_tflops"]
            except Exception as e:  # noqa: BLE001 - e.g. a tile that does not fit
                row["error"] = repr(e)[:200]
            rows.append(row)
            print(row, flush=True)
    return rows


def softmaxes(shapes, interpret, configs):
    rows = []
    for r, c in shapes:
        x = jax.random.normal(jax.random.key(r + c), (r, c), jnp.bfloat16)
        useful = 2 * x.size * x.dtype.itemsize  # read once + write once
        xla = jax.jit(lambda x: jax.nn.softmax(x, axis=-1))
        ref = xla(x).astype(jnp.float32)
        base = dict(rows=r, cols=c, xla_GBps=useful / bench(xla, x) / 1e9)
        for cfg in configs:
            row = dict(base, cfg=list(cfg))
            blocks = sm.BlockSizes(*cfg)
            for kind, fn in (("safe", sm.safe_softmax), ("online", sm.online_softmax)):
                try:
                    f = jax.jit(lambda x, fn=fn, bl=blocks: fn(x, block_sizes=bl,
                                                                interpret=interpret))
                    err = float(jnp.abs(f(x).astype(jnp.float32) - ref).max())
                    row[f"{kind}_max_abs_err"] = err
                    row[f"{kind}_GBps"] = useful / bench(f, x) / 1e9
                except Exception as e:  # noqa: BLE001
                    row[f"{kind}_error"] = repr(e)[:200]
            if "safe_GBps" in row and "online_GBps" in row:
                row["online_speedup"] = row["online_GBps"] / row["safe_GBps"]
            rows.append(row)
            print(row, flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpret)")
    args = parser.parse_args()
    if args.smoke:
        mm_sizes, mm_cfgs = [64], [(32, 32, 16, 2, 4, 2)]
        sm_shapes, sm_cfgs = [(8, 256)], [(2, 64, 4, 2)]
    else:
        mm_sizes = [4096, 8192]
        # (block_m, block_n, block_k, group_m, num_warps, num_stages)
        mm_cfgs = [(128, 128, 64, 8, 4, 3), (128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4),
                   (256, 128, 64, 8, 8, 3)]
        sm_shapes = [(4096, 32768), (512, 262144)]
        # (block_rows, block_cols, num_warps, num_stages)
        sm_cfgs = [(1, 4096, 8, 3), (4, 1024, 4, 3), (2, 2048, 8, 2)]
    res = dict(jax=jax.__version__, devices=str(jax.devices()))
    res["matmul"] = matmuls(mm_sizes, args.smoke, mm_cfgs)
    res["softmax"] = softmaxes(sm_shapes, args.smoke, sm_cfgs)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "kernels.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print("\n==== matmul (bf16) ====")
    for r in res["matmul"]:
        if "tflops" in r:
            print(f"n={r['n']} cfg={r['cfg']}: ours {r['tflops']:.0f} TFLOP/s, XLA "
                  f"{r['xla_tflops']:.0f} (x{r['ratio_to_xla']:.2f})")
    print("==== softmax (bf16, useful bytes) ====")
    for r in res["softmax"]:
        if "online_speedup" in r:
            print(f"{r['rows']}x{r['cols']} cfg={r['cfg']}: safe {r['safe_GBps']:.0f} GB/s, "
                  f"online {r['online_GBps']:.0f} GB/s (x{r['online_speedup']:.2f}), "
                  f"XLA {r['xla_GBps']:.0f} GB/s")


if __name__ == "__main__":
    main()
