"""Where a decoding loop's time goes: plain jitted decoding against speculative decoding.

At batch 1 a decode step is launch-bound, so the number of kernels per loop iteration
matters as much as their time. This traces both loops (random weights: the cost of an
iteration does not depend on what is accepted, only the number of iterations does) and
prints kernel time and launches per iteration, by kind of op.

    python experiments/profile_decode.py --target 350m --draft-width 1024 --draft-layers 2 \
        --gamma 6 --out $OUT

Writes `profile_decode_<device>.json`. On a CPU the trace misses ops inside nested loops, so
the launch counts there are indicative only; the tool is meant for the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from gendist import profiling
from gendist.inference import decoder
from gendist.inference.generate import generate
from gendist.inference.lm import draft_config, transformer_lm
from gendist.inference.sampling import SamplingParams
from gendist.inference.speculative import SpecConfig, program_paths, speculative_generate
from gendist.models import transformer
from gendist.presets import preset
from gendist.timing import call_times


def profile(fn, args, iterations_of, hlo_path: Path | None = None, paths: tuple = ()):
    """Median wall time, per-kind kernel time and launches per loop iteration of `fn(*args)`
    (array arguments only), compiled once: the program classified is the program run, with
    the XLA options of the decode `paths` it runs (`decoder.compiler_options`, as `generate`
    takes them). `hlo_path`: also write its compiled HLO there (gzip), to read what a top op is."""
    compiled = jax.jit(fn, compiler_options=decoder.compiler_options(*paths)).lower(*args).compile()
    if hlo_path is not None:
        hlo_path.parent.mkdir(parents=True, exist_ok=True)
        hlo_path.write_bytes(gzip.compress(compiled.as_text().encode()))
    kinds = profiling.classify_hlo(compiled.as_text())
    times, out = call_times(compiled, *args, n=3, warm=1)
    with profiling.trace() as prof:
        jax.block_until_ready(compiled(*args))
    split = profiling.time_by_kind(prof.profile_data, kinds)
    n = max(iterations_of(out), 1)
    return {"wall_s": sorted(times)[1], "iterations": n,
            "kernel_s_per_iteration": split["total_s"] / n,
            "seconds_per_iteration": {k: v / n for k, v in split["seconds"].items()},
            "launches_per_iteration": {k: v / n for k, v in split["launches"].items()},
            "top_ops": split["top_ops"][:25]}


def call_ms(lm, params, batch: int, tokens: int, calls: int = 64) -> float:
    """Device ms of one `lm.apply` on `tokens` new tokens per sequence (a decode step at 1, a
    speculative verification at γ + 1), from a jitted loop of `calls` calls that advances
    the cache: no host work between calls, as inside the decoding loops."""
    max_len = 32 + calls * tokens + 8

    def loop(params):
        params = lm.prepare(params)
        cache = lm.make_cache(batch, max_len)
        tok = jnp.zeros((batch, tokens), jnp.int32)

        def body(i, carry):
            cache, acc = carry
            pos = 32 + i * tokens + jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32),
                                                      (batch, tokens))
            logits, cache = lm.apply(params, tok, pos, cache)
            return cache, acc + logits[0, 0, 0]

        return jax.lax.fori_loop(0, calls, body, (cache, jnp.float32(0)))[1]

    compiled = jax.jit(loop).lower(params).compile()
    times, _ = call_times(compiled, params, n=5, warm=1)
    return sorted(times)[2] / calls * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="350m")
    ap.add_argument("--draft-width", type=int, default=1024)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--target-unroll", type=int, default=0,
                    help="layers per iteration of the target's layer scan (0: the preset's)")
    ap.add_argument("--calls-only", action="store_true",
                    help="only time single calls by tokens per call (no loop profiles)")
    ap.add_argument("--tag", default="", help="suffix of the output file's name")
    ap.add_argument("--hlo", action="store_true",
                    help="write the speculative loop's compiled HLO (gzip) beside the JSON")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    args = ap.parse_args()

    tm = preset(args.target).model
    if args.target_unroll:
        tm = dataclasses.replace(tm, scan_unroll=args.target_unroll)
    dm = draft_config(tm, args.draft_width, args.draft_layers)
    tp, dp = transformer.init_params(tm, 0), transformer.init_params(dm, 1)
    B, P = args.batch, 32
    prompt = jax.random.randint(jax.random.key(0), (B, P), 0, tm.vocab_size)
    lens = jnp.full((B,), P, jnp.int32)
    key = jax.random.key(1)
    sp = SamplingParams(temperature=0.0)
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "target": args.target, "draft": dataclasses.asdict(dm), "batch": B,
           "gamma": args.gamma, "new_tokens": args.new_tokens,
           "target_scan_unroll": tm.scan_unroll, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    common = dict(max_new_tokens=args.new_tokens, sp=sp)
    plain_steps = lambda out: args.new_tokens - 1  # noqa: E731 - the first token is prefill's
    max_len = P + args.new_tokens + args.gamma + 1
    plain_t, plain_d = (decoder.plan(m, p, B, max_len) for m, p in ((tm, tp), (dm, dp)))
    verify_t = decoder.plan(tm, tp, B, max_len, step_tokens=args.gamma + 1)
    target, draft = transformer_lm(verify_t, "target"), transformer_lm(plain_d, "draft")
    tp, dp = verify_t.params, plain_d.params  # laid out once, outside the timed calls
    res["paths"] = {"plain": plain_t.line, "draft": plain_d.line, "target": verify_t.line}
    spec = SpecConfig(gamma=args.gamma)
    tag = res["device"].replace(" ", "_").lower()
    suffix = f"_unroll{tm.scan_unroll}" if args.target_unroll else ""
    suffix += f"_b{B}_g{args.gamma}" + (f"_{args.tag}" if args.tag else "")
    out = Path(args.out)
    hlo = out / f"profile_decode_{tag}{suffix}_speculative.hlo.txt.gz" if args.hlo else None
    if not args.calls_only:
        res["plain"] = profile(functools.partial(generate, **common),
                               (plain_t, prompt, lens, key), plain_steps, paths=(plain_t.path,))
        res["draft_plain"] = profile(functools.partial(generate, **common),
                                     (plain_d, prompt, lens, key), plain_steps, paths=(plain_d.path,))
        res["speculative"] = profile(
            lambda tp, dp, *a: speculative_generate(target, tp, draft, dp, *a, spec=spec,
                                                    **common),
            (tp, dp, prompt, lens, key), lambda out: int(out[2]["steps"]), hlo,
            paths=program_paths(target, draft))
    # One call's time by tokens per call: what a verification costs against a decode step
    # (Leviathan et al.'s speedup formula assumes the same), and the draft's c.
    res["call_ms"] = {f"{who}_T{t}": call_ms(lm, params, B, t)
                      for who, lm, params in (("target", target, tp), ("draft", draft, dp))
                      for t in (1, 2, args.gamma + 1)}
    print("ms per call:", {k: round(v, 4) for k, v in res["call_ms"].items()})
    for name in ("plain", "draft_plain", "speculative"):
        if name not in res:
            continue
        r = res[name]
        launches = sum(r["launches_per_iteration"].values())
        print(f"{name:12} {r['iterations']:4d} iterations, {r['wall_s'] * 1e3:7.1f} ms wall, "
              f"{r['kernel_s_per_iteration'] * 1e3:6.3f} ms kernels and {launches:6.0f} launches "
              "per iteration")
        for k, v in r["seconds_per_iteration"].items():
            if v:
                print(f"    {k:14} {v * 1e3:7.3f} ms  {r['launches_per_iteration'][k]:6.0f} launches")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_decode_{tag}{suffix}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
