"""Decoding against its memory floor: ms per step of greedy decoding (`generate` of a decode
plan, `gendist.inference.decoder`) beside the time to
read the weights and the valid KV cache once at the read-only bandwidth XLA reaches in the
same process.

A decode step reads every weight matrix once, plus the keys and values of the tokens each
sequence attends to. Floor per step = (weight bytes + mean valid KV bytes) / B_ro, where
B_ro is a read-only XLA sum over a 2 GiB array (the anchors' measure), timed before and
after the cases (the faster counts). Random weights, `--prompt` random tokens, greedy,
`--new-tokens` new tokens; ms/step = wall time of the whole call / new tokens (the prefill
and the first token included, so the figure is conservative by about one step in 256).

    python experiments/decode_floor.py --presets 350m 1b --batches 1 8 64 --out $OUT

Variants: `fast` (the GPU default: decode weight layout, per-layer cache, attention reading
only valid tokens; one-token steps through the fused decode kernels), `fast_unfused` (the
same without the fused kernels: XLA's RMSNorm and RoPE, the paged kernel), `fast@<tiling>`
(fast with the fused attention kernel tiled as `LayerKVCache.tiling` says), `fast_xla` (the same with jnp attention over all
max_len slots), `reference` (stacked weights, one stacked cache, the layer scan unrolled:
the baseline the fast path is measured against), `chain` (batch 1: each step one persistent kernel over
every layer, the "megakernel" path; sm90 only; `chain@OPTS`: OPTS comma-separated, a number
for its ring slots, `spare=0|1` to split o over every block or over those that do not attend,
`group=N` for N query heads an attention block (grouped-query attention), `prefetch=N` for
each block's weight tiles asked of L2 N ahead of its ring, `tiles=N` for the tile pieces a
block makes at a time (one accumulator each, one drain and one LL store for them), `inflight=N`
for the tensor-core products a block leaves running before it frees a ring slot, `loads=N`
for the weight tiles a block keeps in flight at most (0: the ring's free slots; the default is
`plan.default_loads`), `att_loads=N` for that cap on the attention blocks, `att_splits=N` for
N attention blocks a query group, each over a split of the positions, `blocks=N`
for a grid of N blocks (one an SM; the GPU's SM count by default), `sums=0`
for RMSNorm readers that poll the whole vector, not its square sums (`norm_sums`; on by
default), `packed=0` for pieces one value a word, not two (`packed`; on by default),
`NAME=SKxST` to split product NAME (qkv, o, gu, down) as given: with spare or a split, the products
not named split as the cost model does (`chain@16,spare=0,down=22x6`, a candidate of the
sweep of splits in whole steps); with neither, the kernel's measured choice for the shape,
`plan.tuned`); a suffix picks the final norm and the output layer (`decoder.plan`'s head;
none: its default): `+xla` XLA's, `+head` (`chain+head`, `fast+head`) one kernel
(`pallas_kernels.head`), `+fused` (`chain+fused`) inside the megakernel; `+state` (chain
only, with or after the head's: `chain+fused+state`) keeps the kernel's state between steps
(`decoder.plan(kernel_state=True)`), `+fresh` does not (False; neither: the plan's default,
`megakernel.KEEP_STATE`); `+stepsN` (`chain+fused+state+steps8`) runs N greedy steps a
kernel call, the tokens chosen inside it (`decoder.plan(greedy_steps=N)`). Each row also carries the kernels one loop iteration
launches, by kind, read from the compiled HLO, and with `--profile` the device time per
kind of the first case of each preset. Writes `decode_floor_<device>.json` after every case.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from gendist import profiling
from gendist.inference import decoder
from gendist.inference.generate import generate
from gendist.inference.sampling import SamplingParams
from gendist.models import transformer
from gendist.presets import preset
from gendist.timing import call_times, read_only_tbps, result_path, warm_gpu
from pallas_kernels.chain import chain_mgpu

VARIANTS = ("fast", "fast_unfused", "fast_xla", "reference", "chain")
HEADS = {"head": "kernel", "xla": "xla", "fused": "fused"}  # a variant's +suffix: decoder.plan's head


def step_bytes(cfg, dparams, batch: int, prompt: int, new: int) -> tuple[int, int]:
    """(weight bytes read per step, mean valid KV bytes read per step).

    Weights: every matrix and norm vector of the decode layout, and the token table when it
    is also the output layer (tied); an untied table is read only at B rows (counted as
    such). KV: the step producing token i attends to prompt + i positions (i = 1 .. new;
    the first token comes from the prefill, counted like a step).
    """
    leaves = {k: v for k, v in dparams.items() if k != "embed"}
    weights = sum(x.nbytes for x in jax.tree.leaves(leaves))
    emb = dparams["embed"]
    # Tied: the table is the output layer, read whole; untied: only the looked-up rows.
    tied_read = cfg.tie_embeddings and "head_VD" not in dparams
    weights += emb.nbytes if tied_read else batch * emb.shape[1] * emb.dtype.itemsize
    mean_len = prompt + (new + 1) / 2
    itemsize = jnp.dtype(transformer.DTYPES[cfg.dtype]).itemsize
    kv = cfg.num_layers * batch * 2 * mean_len * cfg.num_kv_heads * cfg.head_dim * itemsize
    return int(weights), int(kv)


def _floor(row: dict, tbps: float) -> None:
    if "ms_per_step" in row:
        row["floor_ms"] = (row["weight_bytes"] + row["kv_bytes_mean"]) / (tbps * 1e12) * 1e3
        row["share_of_floor"] = row["floor_ms"] / row["ms_per_step"]


def _match(row: dict, done: list) -> None:
    """Greedy tokens equal to the fast path's of the same preset and batch (same weights,
    prompt and key): row["tokens_equal_fast"] = positions equal (of new tokens x batch) and
    the first position that differs (-1: none), on the row that is not the fast path's."""
    if "tokens" not in row:
        return
    for other in done:
        if (other.get("preset"), other.get("batch")) != (row["preset"], row["batch"]) or "tokens" not in other:
            continue
        pair = (row, other) if other["variant"] == "fast" else (other, row) if row["variant"] == "fast" else None
        if pair is None or pair[0] is pair[1]:
            continue
        a, b = np.asarray(pair[0]["tokens"]), np.asarray(pair[1]["tokens"])
        differ = np.flatnonzero((a != b).any(axis=0))
        pair[0]["tokens_equal_fast"] = dict(equal=int((a == b).sum()), of=int(a.size),
                                           first_difference=int(differ[0]) if differ.size else -1)


def chain_options(option: str):
    """(ring slots, the kernel with the options' splits, spare and group) of `chain@OPTS`."""
    stages, kw, splits = 16, {}, []
    for opt in filter(None, option.split(",")):
        name, eq, value = opt.partition("=")
        if not eq:
            stages = int(name)
        elif name == "spare":
            kw["spare"] = value not in ("0", "false", "False")
        elif name in ("group", "prefetch", "tiles", "inflight", "loads", "att_loads", "att_splits", "blocks"):
            kw[name] = int(value)
        elif name in ("sums", "packed"):
            kw["norm_sums" if name == "sums" else name] = value not in ("0", "false", "False")
        elif name in ("qkv", "o", "gu", "down"):
            sk, _, st = value.partition("x")
            splits.append((name, int(sk), int(st)))
        else:
            raise ValueError(f"chain@{option}: option {opt!r}; use a ring size (16), spare=0, group=N, "
                             "prefetch=N, tiles=N, inflight=N, loads=N, att_loads=N, att_splits=N, blocks=N, sums=0|1, packed=0|1 or NAME=SKxST "
                             "for NAME in qkv, o, gu, down.")
    if "spare" in kw or splits:  # a candidate: the cost model's splits where none is given
        kw["splits"] = tuple(splits)
    return stages, functools.partial(chain_mgpu, **kw)


def case_plan(cfg, params, batch: int, variant: str, max_len: int) -> decoder.DecodePlan:
    """The decode plan of a variant (`params` already laid out for its path)."""
    variant, *extras = variant.split("+")
    head = dict(head=HEADS[extras[0]]) if extras and extras[0] in HEADS else {}  # the head's suffix first
    kind, _, option = variant.partition("@")
    if kind == "reference":
        return decoder.plan(dataclasses.replace(cfg, scan_unroll=cfg.num_layers), params, batch,
                            max_len, "reference")
    if kind == "chain":  # one persistent kernel a step (chain@OPTS: the module docstring's)
        stages, kernel = chain_options(option)
        kw = dict(kernel.keywords)  # the splits are the plan's: its cache passes them to every call
        att_splits = kw.pop("att_splits", None)
        kernel = functools.partial(kernel.func, **kw)
        steps = [int(e[5:]) for e in extras if e.startswith("steps")]
        return decoder.plan(cfg, params, batch, max_len, "megakernel", kernel=kernel, stages=stages,
                            att_splits=att_splits,
                            kernel_state=True if "state" in extras else False if "fresh" in extras else None,
                            greedy_steps=steps[0] if steps else None, **head)
    return decoder.plan(cfg, params, batch, max_len, "fast",
                        backend="xla" if kind == "fast_xla" else None,
                        fused=kind != "fast_unfused", tiling=option, **head)


def run_case(cfg, params, batch, variant, args, profile: bool):
    P, N = args.prompt, args.new_tokens
    prompt = jax.random.randint(jax.random.key(batch), (batch, P), 0, cfg.vocab_size)
    lens = jnp.full((batch,), P, jnp.int32)
    key = jax.random.key(1)
    sp = SamplingParams(temperature=0.0)
    plan = case_plan(cfg, params, batch, variant, P + N)
    t0 = time.perf_counter()
    compiled = generate.lower(plan, prompt, lens, key, max_new_tokens=N, sp=sp).compile()
    compile_s = time.perf_counter() - t0
    ts, (out, count) = call_times(compiled, plan, prompt, lens, key, n=args.reps, warm=1)
    wall = float(np.median(ts))
    row = dict(variant=variant, batch=batch, path=plan.line, compile_s=compile_s, wall_s=wall,
               ms_per_step=wall / N * 1e3, tokens_per_s=batch * N / wall,
               tokens_out=int(np.asarray(count).sum()),
               kernels_per_step=profiling.loop_body_kinds(compiled.as_text()),
               attention={"fast": plan.backend, "megakernel": "chain"}.get(plan.path, "xla"),
               tokens=np.asarray(out).tolist())
    if profile:
        trace_dir = tempfile.mkdtemp(prefix="decode_floor_")
        with jax.profiler.trace(trace_dir) as session:
            jax.block_until_ready(compiled(plan, prompt, lens, key))
        split = profiling.time_by_kind(profiling.load_profile(session, trace_dir),
                                       profiling.classify_hlo(compiled.as_text()))
        row["profile_ms_per_step"] = {k: v / N * 1e3 for k, v in split["seconds"].items()}
        row["profile_launches_per_step"] = {k: v / N for k, v in split["launches"].items()}
        row["profile_top_ops"] = split["top_ops"][:15]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["350m", "1b"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--variants", nargs="+", default=["fast"],
                    help=f"{', '.join(VARIANTS)}, or fast@<tiling> (the fused attention "
                         "kernel's tiling, e.g. fast@bk128_sp1_w4_st3)")
    ap.add_argument("--extra", nargs="*", default=[],
                    help="more cases as preset:batch:variant (e.g. 1b:64:fast_xla)")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="profile the first case per preset")
    ap.add_argument("--profile-all", action="store_true", help="profile every case")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip cases after this long")
    ap.add_argument("--warm-s", type=float, default=2.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    args = ap.parse_args()

    t_start = time.perf_counter()
    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    if on_gpu:
        warm_gpu(args.warm_s)
    res = {"device": dev.device_kind, "jax": jax.__version__, "prompt": args.prompt,
           "new_tokens": args.new_tokens, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "read_only_TBps_measured": [read_only_tbps(2.0 if on_gpu else 0.25)], "cases": []}
    res["read_only_TBps_before"] = max(res["read_only_TBps_measured"][0].values())
    print({k: v for k, v in res.items() if k != "cases"}, flush=True)
    path = result_path(args.out, "decode_floor")
    cases = [(p, b, v) for p in args.presets for b in args.batches for v in args.variants]
    for spec in args.extra:
        p, b, v = spec.split(":")
        cases.append((p, int(b), v))
    for _, _, v in cases:
        base, *extras = v.split("+")
        if (base not in VARIANTS and not base.startswith(("fast@", "chain@"))) or (
                {e for e in extras if not re.fullmatch(r"steps\d+", e)} - set(HEADS) - {"state", "fresh"}
                or set(extras[1:]) & set(HEADS)) or (
                {"fused", "state", "fresh"} & set(extras) and not base.startswith("chain")):
            raise SystemExit(f"variant {v!r}: choose one of {VARIANTS}, fast@<tiling> or "
                             "chain@<stages>, optionally with +head or +xla (+fused, +state, +fresh, "
                             "+stepsN: chain only)")
    current, params = None, {}
    for name, batch, variant in cases:
        if time.perf_counter() - t_start > args.budget_s:
            res["cases"].append(dict(preset=name, batch=batch, variant=variant,
                                     skipped="time budget"))
            continue
        try:
            if name != current:  # one preset's weights at a time
                params.clear()
                current = name
                cfg = preset(name).model
                raw = transformer.init_params(cfg, 0)
                params["fast"] = decoder.layout(cfg, raw, "fast")
                params["reference"] = decoder.layout(cfg, raw, "reference")
                del raw
                first = True
            cfg = preset(name).model
            if variant.startswith("chain") and "chain" not in params:
                params["chain"] = decoder.layout(cfg, params["fast"], "megakernel")
            base = variant.split("+")[0].split("@")[0]
            p = params[base if base in ("reference", "chain") else "fast"]
            row = run_case(cfg, p, batch, variant, args, profile=args.profile_all or (args.profile and first))
            first = False
            w, kv = step_bytes(cfg, params["fast"], batch, args.prompt, args.new_tokens)
            row.update(preset=name, weight_bytes=w, kv_bytes_mean=kv)
            _match(row, res["cases"])
            _floor(row, res["read_only_TBps_before"])  # final figures use the best of two
        except Exception as e:  # one failing case must not lose the others
            row = dict(preset=name, batch=batch, variant=variant, error=repr(e)[:2000])
        res["cases"].append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("profile_top") and k != "tokens"}),
              flush=True)
        path.write_text(json.dumps(res, indent=1))
    params.clear()
    res["read_only_TBps_measured"].append(read_only_tbps(2.0 if on_gpu else 0.25))
    res["read_only_TBps_after"] = max(res["read_only_TBps_measured"][1].values())
    bw = max(res["read_only_TBps_before"], res["read_only_TBps_after"])
    res["read_only_TBps"] = bw
    for row in res["cases"]:
        _floor(row, bw)
    path.write_text(json.dumps(res, indent=1))
    print(f"read-only bandwidth {bw:.2f} TB/s")
    print("| preset | batch | variant | ms / step | floor ms | share of floor | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for r in res["cases"]:
        if "share_of_floor" in r:
            print(f"| {r['preset']} | {r['batch']} | {r['variant']} | {r['ms_per_step']:.3f} | "
                  f"{r['floor_ms']:.3f} | {r['share_of_floor']:.0%} | {r['tokens_per_s']:,.0f} |")
        else:
            print(f"| {r['preset']} | {r['batch']} | {r['variant']} | "
                  f"{r.get('error', r.get('skipped'))} |")


if __name__ == "__main__":
    main()
