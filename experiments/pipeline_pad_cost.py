"""What an uneven split's padding costs a stage: forward+backward of one stage's layers run
by the pipeline executor's `layer_runner` (layers padded to the longest stage, the padding
skipped by `lax.cond`) against a plain scan over the same real layers.

    python experiments/pipeline_pad_cost.py --d-model 1024 --seq 512
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gendist.timing import median_seconds

_spec = importlib.util.spec_from_file_location(
    "partition_uneven", Path(__file__).with_name("partition_uneven.py"))
pu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pu)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--mb-size", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--remat", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    params, fns = pu.uneven_model(jax.random.key(0), d=args.d_model, remat=args.remat)
    layer_fn = fns["layer_fn"]
    x = jax.random.normal(jax.random.key(1), (args.mb_size, args.seq, args.d_model))
    take = lambda idx: jax.tree.map(lambda a: a[np.asarray(idx)], params["layers"])  # noqa: E731

    def fwd_bwd(run):
        def f(lp, x):
            y, vjp = jax.vjp(run, lp, x)
            return vjp(jnp.ones_like(y))
        return jax.jit(f)

    def plain(lp, x):
        return jax.lax.scan(lambda h, l: (layer_fn(l, h), None), x, lp)[0]

    def masked(counts, stage):
        """A stage's slice padded to the longest stage, padded layers skipped with
        lax.cond (how an uneven split runs on the pipeline executor)."""
        even = len(set(counts)) == 1
        on = jnp.arange(max(counts)) < counts[stage]

        def run(lp, x):
            def one(h, l_on):
                l, o = l_on
                h = layer_fn(l, h) if even else jax.lax.cond(o, layer_fn, lambda _, y: y, l, h)
                return h, None
            return jax.lax.scan(one, x, (lp, on))[0]
        return run

    cases = {
        "stage1 of (5,3): 3 real + 2 padded": (masked((5, 3), 1),
                                               [5, 6, 7, 0, 0]),
        "plain scan over the same 3 layers": (plain, [5, 6, 7]),
        "stage0 of (5,3): 5 real, cond-wrapped": (masked((5, 3), 0),
                                                  [0, 1, 2, 3, 4]),
        "plain scan over the same 5 layers": (plain, [0, 1, 2, 3, 4]),
        "stage1 of (4,4): 4 real, no cond": (masked((4, 4), 1),
                                             [4, 5, 6, 7]),
    }
    res = {}
    for name, (run, idx) in cases.items():
        lp = take(idx)
        res[name] = {"fwd_s": median_seconds(jax.jit(run), lp, x, n=5, warm=1),
                     "fwd_bwd_s": median_seconds(fwd_bwd(run), lp, x, n=5, warm=1)}
        print(f"{name:40s} fwd {res[name]['fwd_s'] * 1e3:8.2f} ms  fwd+bwd "
              f"{res[name]['fwd_bwd_s'] * 1e3:8.2f} ms", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"pipeline_pad_cost{'_remat' if args.remat else ''}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
