"""A decode step's MLPs on one H200: the persistent Mosaic GPU kernel (`pallas_kernels.mlp_mgpu`,
gate|up, SwiGLU and down in one launch) against XLA's three kernels (what the decode path runs:
`decode_layout.mlp`), chained over a preset's layers as a decode step runs them.

    export PYTHONPATH=.:$PYTHONPATH; python3 experiments/bench_mlp_mgpu.py --out $OUT
    python3 experiments/bench_mlp_mgpu.py --interpret    # CPU: the code path, tiny shapes

Per preset (350m: D 1024, F 2816, 24 layers; 1b: D 2048, F 5632, 22 layers), batch 1 and 8:
one jit runs the chain h_{l+1} = rms(mlp_l(h_l)) over the layers' distinct weights (68.7 MB a
1b layer, 1.5 GB in all: nothing stays in L2), each layer's MLP as XLA's kernels or as ours.
A round dispatches the jit `--iters` times back to back and synchronises once; µs per layer
= the best of `--rounds` rounds / (iters * layers). TB/s = a layer's weight bytes / that time;
the floor's bandwidth is a read-only XLA sum timed the same way in the same process
(`decode_floor.read_only_tbps`, pipelined). Tilings: `--variants`
(kc<kc>_st<stages>[_r<rows>][_s<splits>][_b<blocks>][_nopf]; _nopf: no down weights copied
before the phase barrier). `--profile` names the variants whose kernels are profiled at batch 1.
Correctness: one layer's output against XLA's (rel. L2; the chain's outputs are not
compared: 24 random layers amplify a 1e-3 change of one layer's output to an unrelated vector).

Writes mlp_mgpu.json to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from decode_floor import read_only_tbps  # noqa: E402

from gendist import profiling  # noqa: E402
from gendist.timing import pipelined_seconds, warm_gpu  # noqa: E402
from pallas_kernels.mlp_mgpu import mlp_mgpu, parse_sizes  # noqa: E402

PRESETS = {"350m": (1024, 2816, 24), "1b": (2048, 5632, 22), "tiny": (128, 256, 2)}


def layer_weights(D: int, F: int, L: int, seed: int = 0) -> list:
    """L layers' distinct (w_gate_up [2F, D], w_down [D, F]) in bf16, scaled as initialised."""
    keys = jax.random.split(jax.random.key(seed), 2 * L)
    return [((jax.random.normal(keys[2 * i], (2 * F, D), jnp.float32) / D**0.5).astype(jnp.bfloat16),
             (jax.random.normal(keys[2 * i + 1], (D, F), jnp.float32) / F**0.5).astype(jnp.bfloat16))
            for i in range(L)]


def write(result: dict, out: str, name: str):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as fh:
        json.dump(result, fh, indent=1)


def xla_mlp(h, w_gu, w_d):
    u = jnp.einsum("BD,GD->BG", h, w_gu)
    g, up = jnp.split(u, 2, axis=-1)
    return jnp.einsum("BF,DF->BD", jax.nn.silu(g) * up, w_d).astype(jnp.float32)


def chain(mlp):
    def run(h, weights):
        for w_gu, w_d in weights:
            y = mlp(h, w_gu, w_d)  # keep the scale of h: the next layer's input is normed
            h = (y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)).astype(h.dtype)
        return h
    return jax.jit(run)


def kernel_times(f, args, layers: int) -> dict:
    """µs per layer of each kernel name in one profiled call, and their sum (the GPU's busy
    time: a gap between kernels is in the wall time but not here)."""
    jax.block_until_ready(f(*args))
    with profiling.trace() as t:
        jax.block_until_ready(f(*args))
    per = {}
    for name, _, d in profiling.device_events(t.profile_data):
        per[name] = per.get(name, 0.0) + d * 1e6 / layers
    top = dict(sorted(per.items(), key=lambda kv: -kv[1])[:8])
    return {"busy_us_per_layer": sum(per.values()), "top_us_per_layer": top}


def read_only(h, w_gu, w_d):
    """Reads both weights once (XLA's column and row sums), nothing else: a layer's floor."""
    s = jnp.sum(w_gu, axis=0, dtype=jnp.float32) + jnp.sum(w_d, axis=1, dtype=jnp.float32)
    return h.astype(jnp.float32) + s


SWEEP = ((1024, 1024), (1024, 2816), (1024, 5632), (2048, 2816), (2048, 5632), (2048, 11264),
         (4096, 11264))


def sweep(args, result):
    """µs per layer against a layer's bytes over `SWEEP`'s (D, F) at batch 1, each chained over
    enough layers to hold `--sweep-mb` MB (far past the 50 MB L2); per implementation a
    least-squares line µs = fixed + bytes / bandwidth: the fixed cost a call pays whatever its size and the bandwidth it streams at."""
    impls = {"xla": xla_mlp, "read_only": read_only, "ours": mlp_mgpu,
             "kc64_st10_r64": lambda a, b, c: mlp_mgpu(a, b, c, block_sizes=parse_sizes("kc64_st10_r64"))}
    rows = []
    for D, F in SWEEP:
        layer_bytes = 3 * F * D * 2
        L = max(3, -(-args.sweep_mb * 10**6 // layer_bytes))
        weights = layer_weights(D, F, L, seed=D + F)
        h = jax.random.normal(jax.random.key(1), (1, D), jnp.float32).astype(jnp.bfloat16)
        fns = {name: chain(f) for name, f in impls.items()}
        best = {name: float("inf") for name in fns}
        for _ in range(args.rounds):
            for name, f in fns.items():
                best[name] = min(best[name], pipelined_seconds(f, h, weights, n=args.iters, warm=1)[0])
        for name in fns:
            row = {"D": D, "F": F, "layers": L, "impl": name, "mb_per_layer": layer_bytes / 1e6,
                   "us_per_layer": best[name] / L * 1e6}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del weights
    fits = {}
    for name in impls:
        mine = [r for r in rows if r["impl"] == name]
        slope, fixed = np.polyfit([r["mb_per_layer"] for r in mine], [r["us_per_layer"] for r in mine], 1)
        fits[name] = {"fixed_us": float(fixed), "tbps": float(1 / slope)}  # MB/us = TB/s
        print(name, fits[name], flush=True)
    result["sweep"], result["sweep_fit"] = rows, fits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["350m", "1b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--variants", nargs="*", default=["kc64_st10_r64", "kc128_st8_r32", "kc128_st14_r16",
                                                       "kc256_st16_r8", "kc128_st16_r8", "kc256_st9_r16"])
    ap.add_argument("--profile", nargs="*", default=["xla", "ours"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="only the size sweep (`sweep`)")
    ap.add_argument("--sweep-mb", type=int, default=600, help="weights a sweep chain holds")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.interpret:
        args.presets, args.batches, args.variants, args.iters, args.rounds = ["tiny"], [1], [], 1, 1
    gpu = jax.default_backend() == "gpu"
    if gpu:
        warm_gpu()
    result = {"device": str(jax.devices()[0]), "jax": jax.__version__, "cases": []}
    if gpu:
        result["read_only_tbps"] = read_only_tbps()
        print("read-only TB/s:", result["read_only_tbps"], flush=True)
    if args.sweep:
        sweep(args, result)
        write(result, args.out, "mlp_mgpu_sweep.json")
        return
    for preset in args.presets:
        D, F, L = PRESETS[preset]
        weights = layer_weights(D, F, L)
        layer_bytes = 3 * F * D * 2
        for B in args.batches:
            h = jax.random.normal(jax.random.key(1), (B, D), jnp.float32).astype(jnp.bfloat16)
            impls = {"xla": xla_mlp}
            impls["ours"] = lambda a, b, c: mlp_mgpu(a, b, c, interpret=args.interpret)
            for tag in args.variants:
                impls[tag] = (lambda s: lambda a, b, c: mlp_mgpu(a, b, c, block_sizes=s))(parse_sizes(tag))
            fns = {name: chain(f) for name, f in impls.items()}
            # one layer's output (the same jit traced for a chain of one)
            outs = {name: np.asarray(f(h, weights[:1]), np.float32) for name, f in fns.items()}
            best = {name: float("inf") for name in fns}
            for _ in range(args.rounds):  # the implementations take turns each round
                for name, f in fns.items():
                    t, _ = pipelined_seconds(f, h, weights, n=args.iters, warm=1)
                    best[name] = min(best[name], t)
            ref = outs["xla"]
            for name in fns:
                us = best[name] / L * 1e6
                err = float(np.linalg.norm(outs[name] - ref) / np.linalg.norm(ref))
                row = {"preset": preset, "batch": B, "impl": name, "us_per_layer": us,
                       "tbps": layer_bytes / (us * 1e-6) / 1e12, "rel_err_vs_xla": err}
                if gpu:
                    row["share_of_read_only"] = row["tbps"] / result["read_only_tbps"]["pipelined"]
                if gpu and B == 1 and name in args.profile:
                    row["profile"] = kernel_times(fns[name], (h, weights), L)
                result["cases"].append(row)
                print(json.dumps(row), flush=True)
            write(result, args.out, "mlp_mgpu.json")


if __name__ == "__main__":
    main()
