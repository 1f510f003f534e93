"""The decode chain megakernel's product splits, swept on the GPU: for each preset,
the cost model's splits (`pallas_kernels.chain.plan.choose_split`) against hand-picked overrides of the
gate|up and down splits (`chain_mgpu(splits=...)`), each checked against XLA's chain and timed
as pipelined calls, with norms and attention at position --pos (a decode step's mean).

The trace (`trace_chain.py`) showed the readers' gathers, not the weight stream, set the
layer's time at 350m: a down reader with 6 chunks of gate|up pieces takes ~2.4 us from its
sources' last word to its input. Fewer chunks a reader (larger sk) mean fewer words to poll
but more pieces for the next product's readers; this measures the trade.

    python3 experiments/sweep_chain_splits.py --out $OUT       # one H200
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_chain_mgpu import PRESETS, attention_inputs, norm_gains, weights  # noqa: E402

from pallas_kernels.chain import call as cc  # noqa: E402
from pallas_kernels.chain import plan  # noqa: E402
from pallas_kernels.chain import xla as cx  # noqa: E402

VARIANTS = {
    "350m": [(), (("down", 16, 8),), (("down", 22, 6),), (("down", 11, 12),), (("gu", 8, 16),),
             (("gu", 8, 16), ("down", 22, 6)), (("gu", 2, 60),)],
    "1b": [(), (("down", 22, 6),), (("down", 11, 12),), (("gu", 4, 33),)],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="*", default=list(PRESETS))
    ap.add_argument("--pos", type=int, default=160)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", type=int, default=0, help="the first N of each preset's (0: all)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from gendist.timing import pipelined_seconds, warm_gpu  # noqa: PLC0415

    warm_gpu()
    rows = []
    for name in args.presets:
        D, N1, F, L = PRESETS[name]
        x0, *ws = weights(D, N1, F, L)
        gains = norm_gains(L, D)
        att, _ = attention_inputs(L, D, 320, args.pos)
        want = np.asarray(jax.jit(functools.partial(cx.reference, norms=gains, eps=1e-5))(x0, *ws, *att)[0],
                          np.float64)
        kws = list(ws)
        kws[0], kws[2] = cx.fold_norms(ws[0], ws[2], *gains)
        for splits in VARIANTS[name][:args.variants or None]:
            prods = plan.products(D, N1, F, 132, attention=True, splits=splits)
            label = " ".join(f"{p.name} {p.split.sk}x{p.split.st}" for p in prods)
            f = jax.jit(functools.partial(cc.chain_mgpu, norm_eps=1e-5, splits=splits))
            try:
                got = np.asarray(f(x0, *kws, *att)[0], np.float64)
            except Exception as e:  # noqa: BLE001 (a split the kernel cannot take: say so, go on)
                print(f"{name} [{label}]: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            us = min(pipelined_seconds(f, x0, *kws, *att, n=args.iters, warm=1)[0] for _ in range(2)) * 1e6
            rows.append(dict(preset=name, splits=[list(s) for s in splits], label=label, us=us,
                             us_per_layer=us / L, rel_err=err))
            print(f"{name} [{label}]{' (cost model)' if not splits else ''}: {us / L:6.2f} us a layer,"
                  f" rel err {err:.1e}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep_chain_splits.json"), "w") as fh:
        json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "pos": args.pos, "rows": rows}, fh,
                  indent=1)


if __name__ == "__main__":
    main()
