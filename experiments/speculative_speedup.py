"""Speculative decoding speedup: train a target and a small draft on the corpus, then measure
acceptance α, cost ratio c and wall-clock speedup over plain jitted decoding (the fastest
decode path that runs, `gendist.inference.decoder`; the paths are recorded), next to
Leviathan et al.'s prediction
(1 − α^(γ+1)) / ((1 − α)(γc + 1)).

The target must be clearly better than its draft, as in real use: the draft is trained in
rounds of `--draft-round-steps` and the last round whose validation loss is still at least
`--min-gap` nats/byte above the target's is kept (`gap_met` says whether any was). Rows: γ
fixed (`--gammas`) and, with `--adaptive`, γ chosen each step from the running acceptance
rate (`SpecConfig.adaptive`, at most max(--gammas) + 2), for each batch and temperature.
`--budget-s` stops starting rows after that many seconds (training included); the JSON is
written after every row.

    python experiments/speculative_speedup.py --target small --steps 300 --out benchmarks

On the H200 (about 5 minutes with training):
    python experiments/speculative_speedup.py --target 350m --steps 1500 --seq-len 256 \
        --draft-width 1024 --draft-layers 2 --draft-round-steps 300 --draft-rounds 5 \
        --gammas 4 --adaptive --batches 1 8 --temperatures 0 1 --budget-s 300 --out $OUT

On a CPU use `--target tiny --draft-width 32 --steps 150 --new-tokens 32` (indicative only).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import os
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gendist.data.batches import TextData
from gendist.inference import decoder
from gendist.inference.generate import generate
from gendist.inference.lm import draft_config, transformer_lm
from gendist.inference.sampling import SamplingParams
from gendist.inference.speculative import SpecConfig, expected_tokens_per_cost, speculative_generate
from gendist.presets import preset, replace
from gendist.timing import call_times
from gendist.training import loop


def _train_cfg(cfg, steps, out_dir, seq_len, batch_size, resume=False, warmup=None):
    """`warmup` fixed across resumed rounds (a resume refuses a changed schedule)."""
    return replace(
        cfg,
        **{
            "train.seq_len": seq_len,
            "train.batch_size": batch_size,
            "train.steps": steps,
            "train.out_dir": out_dir,
            "train.resume": resume,
            "train.eval_every": steps,
            "train.checkpoint_every": 0,
            "train.tensorboard": False,
            "train.progress": False,
            "train.warmup_steps": min(50, steps // 5) if warmup is None else warmup,
        },
    )


def train_model(cfg, steps, out_dir, seq_len, batch_size):
    cfg = _train_cfg(cfg, steps, tempfile.mkdtemp(prefix=out_dir), seq_len, batch_size)
    r = loop.run(cfg, log=lambda *a: None)
    return cfg.model, jax.device_get(r.state["params"]), r.val_loss


def train_draft(cfg, round_steps, rounds, seq_len, batch_size, worst_allowed):
    """Train in rounds (resuming); keep the last round whose val loss is >= worst_allowed
    (the draft stays clearly worse than the target). Returns (model cfg, params, val loss,
    steps, every round's (steps, val loss), whether the kept draft meets the bound)."""
    out_dir = tempfile.mkdtemp(prefix="spec_draft_")
    kept, history = None, []
    for k in range(1, rounds + 1):
        tc = _train_cfg(cfg, k * round_steps, out_dir, seq_len, batch_size, resume=True,
                        warmup=min(50, round_steps // 5))
        r = loop.run(tc, log=lambda *a: None)
        history.append((k * round_steps, r.val_loss))
        print(f"draft round {k}: {k * round_steps} steps, val {r.val_loss:.4f}", flush=True)
        if r.val_loss < worst_allowed and kept is not None:
            break  # crossed the bound: keep the previous round
        kept = (tc.model, jax.device_get(r.state["params"]), r.val_loss, k * round_steps)
        if r.val_loss < worst_allowed:
            break  # even the first round is within the gap: keep it, flagged
    return (*kept, history, kept[2] >= worst_allowed)


def timed(fn, reps=3):
    """(median seconds of `reps` calls after a warm-up, the warm-up call's output)."""
    ts, out = call_times(fn, n=reps, warm=1)
    return float(np.median(ts)), out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="small")
    ap.add_argument("--draft-width", type=int, default=128)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--draft-steps", type=int, default=0, help="0: the same as --steps")
    ap.add_argument("--prompts-b1", type=int, default=4, help="prompts timed at batch 1")
    ap.add_argument("--seq-len", type=int, default=256, help="training sequence length")
    ap.add_argument("--batch-size", type=int, default=32, help="training batch size")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--target-unroll", type=int, default=0,
                    help="decode with the target's layer loop unrolled this much (0: the "
                         "preset's; the fast path runs its layers straight-line anyway)")
    ap.add_argument("--draft-round-steps", type=int, default=0,
                    help="train the draft in rounds of this many steps (0: --draft-steps once)")
    ap.add_argument("--draft-rounds", type=int, default=5)
    ap.add_argument("--min-gap", type=float, default=0.1,
                    help="the draft's val loss stays at least this far above the target's")
    ap.add_argument("--adaptive", action="store_true", help="also adaptive γ (max γ + 2)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no row after this")
    ap.add_argument("--kernel-state", action="store_true",
                    help="plans on the megakernel path keep the kernel's state between steps "
                         "(decoder.plan(kernel_state=True)): the plain target's and the draft's")
    ap.add_argument("--also-options", choices=("stacked", "defaults"), default=None,
                    help="also time each row's speculative program compiled with these XLA "
                         "options (decoder.STACKED_PROMPT_OPTIONS or XLA's defaults) beside the "
                         "ones it picks: speedup_<options>, tokens_differ_<options>")
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    args = ap.parse_args()

    tcfg = preset(args.target)
    tm = tcfg.model
    dm = draft_config(tm, args.draft_width, args.draft_layers)
    dcfg = replace(tcfg, model=dm)
    t0 = time.perf_counter()
    tm, tp, tval = train_model(tcfg, args.steps, "spec_target_", args.seq_len, args.batch_size)
    print(f"target: {args.steps} steps, val {tval:.4f}", flush=True)
    if args.draft_round_steps:
        dm, dp, dval, dsteps, dhist, gap_met = train_draft(
            dcfg, args.draft_round_steps, args.draft_rounds, args.seq_len, args.batch_size,
            tval + args.min_gap)
    else:
        dsteps = args.draft_steps or args.steps
        dm, dp, dval = train_model(dcfg, dsteps, "spec_draft_", args.seq_len, args.batch_size)
        dhist, gap_met = [(dsteps, dval)], dval >= tval + args.min_gap
    # Keep the weights on the device: host arrays would be copied in on every timed call
    # (1.2 GB for the 350m target, ~60 ms), a fixed cost that hides the decoding speed.
    tp, dp = jax.device_put((tp, dp))
    if args.target_unroll:  # a decoding choice: training above used the preset's loop
        tm = dataclasses.replace(tm, scan_unroll=args.target_unroll)
    res = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "target_scan_unroll": tm.scan_unroll,
        "paths": {},
        "draft": {
            "d_model": dm.d_model,
            "num_layers": dm.num_layers,
            "steps": dsteps,
            "rounds": dhist,
        },
        "target_steps": args.steps,
        "new_tokens": args.new_tokens,
        "target": args.target,
        "target_params_M": tm.num_params / 1e6,
        "draft_params_M": dm.num_params / 1e6,
        "target_val_loss": tval,
        "draft_val_loss": dval,
        "val_gap": dval - tval,
        "gap_met": bool(gap_met),
        "train_s": time.perf_counter() - t0,
        "runs": [],
    }
    print({k: v for k, v in res.items() if k != "runs"}, flush=True)
    data = TextData.from_config(tcfg.data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = res["device"].replace(" ", "_").lower() + args.tag
    specs = [(g, SpecConfig(gamma=g)) for g in args.gammas]
    c_greedy = {}
    sets_of, plans_of = {}, {}
    g_max = max(args.gammas) + (2 if args.adaptive else 0)
    for B in args.batches:
        # The decode plans of each batch, laid out once: plain target and draft, and the
        # target verifying up to g_max + 1 tokens a call (LMs for speculative decoding).
        n_max = 32 + args.new_tokens + g_max + 1
        def plan(cfg, params, **kw):
            p = decoder.plan(cfg, params, B, n_max, **kw)  # noqa: B023 (called at once)
            if args.kernel_state and p.path == "megakernel":
                p = decoder.plan(cfg, params, B, n_max, kernel_state=True, **kw)  # noqa: B023
            return p

        plans_of[B] = dict(target=plan(tm, tp), draft=plan(dm, dp),
                           verify=plan(tm, tp, step_tokens=g_max + 1))
        res["paths"][B] = {k: p.line for k, p in plans_of[B].items()}
        # Batch 1 is measured over several prompts (times and counts summed): one prompt's
        # acceptance rate varies a lot with its text.
        rng = np.random.default_rng(B)
        sets_of[B] = []
        for _ in range(args.prompts_b1 if B == 1 else 1):
            starts = rng.integers(0, len(data.val) - 64, B)
            prompts = np.stack([data.val[s : s + 32] for s in starts]).astype(np.int32)
            sets_of[B].append((jnp.asarray(prompts), jnp.full((B,), 32, jnp.int32)))
    # Temperature outermost: every batch's greedy rows come before any T > 0 row, so a run
    # cut by --budget-s keeps the greedy figures of every batch.
    for temp in args.temperatures:
        for B in args.batches:
            sets, n_sets = sets_of[B], len(sets_of[B])
            plans = plans_of[B]
            target = transformer_lm(plans["verify"], "target")
            draft = transformer_lm(plans["draft"], "draft")
            if time.perf_counter() - t0 > args.budget_s:
                res["runs"].append(dict(batch=B, temperature=temp, skipped="time budget"))
                continue
            sp = SamplingParams(temperature=temp)
            key = jax.random.key(0)
            common = dict(max_new_tokens=args.new_tokens, sp=sp)
            t_plain = sum(
                timed(functools.partial(generate, plans["target"], pb, lb, key, **common))[0]
                for pb, lb in sets
            )
            if B not in c_greedy:  # c is a ratio of step costs: measured once per batch
                t_small = sum(
                    timed(functools.partial(generate, plans["draft"], pb, lb, key,
                                            **common))[0]
                    for pb, lb in sets
                )
                c_greedy[B] = t_small / t_plain
            c = c_greedy[B]
            rows = list(specs)
            if args.adaptive:
                g = max(args.gammas) + 2
                rows.append((g, SpecConfig(gamma=g, adaptive=True, cost_ratio=c)))
            for g, spec in rows:
                if time.perf_counter() - t0 > args.budget_s:
                    res["runs"].append(dict(batch=B, temperature=temp, gamma=g,
                                            adaptive=spec.adaptive, skipped="time budget"))
                    continue
                t_spec, t_other, st = 0.0, 0.0, collections.Counter()
                gammas_used, alphas = [], []
                for pb, lb in sets:
                    fn = functools.partial(
                        speculative_generate,
                        target,
                        plans["verify"].params,
                        draft,
                        plans["draft"].params,
                        pb,
                        lb,
                        key,
                        spec=spec,
                        **common,
                    )
                    seconds, (out_spec, _, stats) = timed(fn)  # same key every call: same stats
                    t_spec += seconds
                    if args.also_options:
                        other = speculative_generate.for_paths(
                            *(("megakernel",) if args.also_options == "stacked" else ()))
                        seconds, (out_other, _, _) = timed(functools.partial(other, *fn.args, **fn.keywords))
                        t_other += seconds
                        st["tokens_differ"] += int(jnp.sum(out_spec != out_other))
                    st.update(
                        {k: int(stats[k]) for k in ("accepted", "trials", "proposed", "steps")}
                    )
                    gammas_used.append(int(stats["final_gamma"]))
                    # one greedy continuation is one sample: its α spreads by ~0.1 between prompts
                    alphas.append(round(int(stats["accepted"]) / max(int(stats["trials"]), 1), 3))
                alpha = st["accepted"] / max(st["trials"], 1)
                # Adaptive: the prediction at the γ it settled on (its last choice).
                g_pred = int(np.median(gammas_used)) if spec.adaptive else g
                pred = float(expected_tokens_per_cost(jnp.float32(alpha), g_pred, c))
                row = dict(
                    batch=B,
                    prompts=n_sets * B,
                    temperature=temp,
                    gamma=g,
                    adaptive=spec.adaptive,
                    final_gamma=gammas_used,
                    alpha=alpha,
                    alpha_per_prompt=alphas,
                    c=c,
                    kept_fraction=st["accepted"] / max(st["proposed"], 1),
                    plain_s=t_plain,
                    plain_ms_per_token=t_plain / (n_sets * args.new_tokens) * 1e3,
                    spec_s=t_spec,
                    speedup=t_plain / t_spec,
                    predicted=pred,
                    **({f"spec_s_{args.also_options}": t_other,
                        f"speedup_{args.also_options}": t_plain / t_other,
                        f"tokens_differ_{args.also_options}": st["tokens_differ"]}
                       if args.also_options else {}),
                    target_calls=st["steps"],
                    new_tokens_per_target_call=n_sets * args.new_tokens
                    / max(st["steps"], 1),
                )
                res["runs"].append(row)
                print(json.dumps(row), flush=True)
                # Written after every row: a run cut short still leaves its measurements.
                (out / f"speculative_{tag}.json").write_text(json.dumps(res, indent=1))
    (out / f"speculative_{tag}.json").write_text(json.dumps(res, indent=1))
    plot(res, out / f"speculative_{tag}.png")


def plot(res: dict, path) -> None:
    """Measured speedup against Leviathan's prediction over γ, one line per (batch, T)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # the JSON is the result; the plot is a convenience
        print("plot skipped:", e)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    runs = [r for r in res["runs"] if "speedup" in r]
    settings = sorted({(r["batch"], r["temperature"]) for r in runs})
    for i, (B, temp) in enumerate(settings):
        rows = sorted((r for r in runs if (r["batch"], r["temperature"]) == (B, temp)
                       and not r.get("adaptive")), key=lambda r: r["gamma"])
        g = [r["gamma"] for r in rows]
        ax.plot(g, [r["speedup"] for r in rows], "o-", color=f"C{i}",
                label=f"measured B={B} T={temp:g}")
        ax.plot(g, [r["predicted"] for r in rows], "x--", color=f"C{i}", alpha=0.6,
                label=f"predicted B={B} T={temp:g}")
        for r in runs:
            if r.get("adaptive") and (r["batch"], r["temperature"]) == (B, temp):
                ax.plot([np.median(r["final_gamma"])], [r["speedup"]], "*", ms=12,
                        color=f"C{i}", label=f"adaptive B={B} T={temp:g}")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set_xlabel("γ (draft tokens per step)")
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
