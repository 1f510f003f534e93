"""Speculative decoding speedup: train a target and a ~10x smaller draft on the corpus, then
measure acceptance α, cost ratio c and wall-clock speedup over plain jitted decoding, next to
Leviathan et al.'s prediction (1 − α^(γ+1)) / ((1 − α)(γc + 1)).

    python experiments/speculative_speedup.py --target small --steps 300 --out benchmarks

On the H200 (batch 1 alone, about 6 minutes with training): a deep target and a shallow
draft, since at batch 1 a decode step costs about one kernel chain per layer:
    python experiments/speculative_speedup.py --target 350m --draft-width 1024 \
        --draft-layers 2 --steps 500 --draft-steps 1500 --seq-len 512 --batch-size 32 \
        --target-unroll 24 --batches 1 --out $OUT

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

from gendist import loop
from gendist.config import preset, replace
from gendist.data import TextData
from gendist.inference.generate import generate_tokens
from gendist.inference.lm import draft_config, transformer_lm
from gendist.inference.sampling import SamplingParams
from gendist.inference.speculative import SpecConfig, expected_tokens_per_cost, speculative_generate
from gendist.timing import call_times


def train_model(cfg, steps, out_dir, seq_len, batch_size):
    cfg = replace(
        cfg,
        **{
            "train.seq_len": seq_len,
            "train.batch_size": batch_size,
            "train.steps": steps,
            "train.out_dir": tempfile.mkdtemp(prefix=out_dir),
            "train.resume": False,
            "train.eval_every": steps,
            "train.checkpoint_every": 0,
            "train.tensorboard": False,
            "train.warmup_steps": min(50, steps // 5),
        },
    )
    r = loop.run(cfg, log=lambda *a: None)
    return cfg.model, jax.device_get(r.state["params"]), r.val_loss


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
                         "preset's); plain and speculative decoding use the same setting")
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    args = ap.parse_args()

    tcfg = preset(args.target)
    tm = tcfg.model
    dm = draft_config(tm, args.draft_width, args.draft_layers)
    dcfg = replace(tcfg, model=dm)
    t0 = time.perf_counter()
    tm, tp, tval = train_model(tcfg, args.steps, "spec_target_", args.seq_len, args.batch_size)
    dm, dp, dval = train_model(
        dcfg, args.draft_steps or args.steps, "spec_draft_", args.seq_len, args.batch_size
    )
    # Keep the weights on the device: host arrays would be copied in on every timed call
    # (1.2 GB for the 350m target, ~60 ms), a fixed cost that hides the decoding speed.
    tp, dp = jax.device_put((tp, dp))
    if args.target_unroll:  # a decoding choice: training above used the preset's loop
        tm = dataclasses.replace(tm, scan_unroll=args.target_unroll)
    res = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "target_scan_unroll": tm.scan_unroll,
        "draft": {
            "d_model": dm.d_model,
            "num_layers": dm.num_layers,
            "steps": args.draft_steps or args.steps,
        },
        "target_steps": args.steps,
        "new_tokens": args.new_tokens,
        "target": args.target,
        "target_params_M": tm.num_params / 1e6,
        "draft_params_M": dm.num_params / 1e6,
        "target_val_loss": tval,
        "draft_val_loss": dval,
        "train_s": time.perf_counter() - t0,
        "runs": [],
    }
    print({k: v for k, v in res.items() if k != "runs"}, flush=True)
    target, draft = transformer_lm(tm, "target"), transformer_lm(dm, "draft")
    data = TextData.from_config(tcfg.data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = res["device"].replace(" ", "_").lower() + args.tag
    for B in args.batches:
        # Batch 1 is measured over several prompts (times and counts summed): one prompt's
        # acceptance rate varies a lot with its text.
        n_sets = args.prompts_b1 if B == 1 else 1
        rng = np.random.default_rng(B)
        sets = []
        for _ in range(n_sets):
            starts = rng.integers(0, len(data.val) - 64, B)
            prompts = np.stack([data.val[s : s + 32] for s in starts]).astype(np.int32)
            sets.append((jnp.asarray(prompts), jnp.full((B,), 32, jnp.int32)))
        for temp in args.temperatures:
            sp = SamplingParams(temperature=temp)
            key = jax.random.key(0)
            common = dict(max_new_tokens=args.new_tokens, sp=sp)
            t_plain = sum(
                timed(functools.partial(generate_tokens, tm, tp, pb, lb, key, **common))[0]
                for pb, lb in sets
            )
            t_small = sum(
                timed(functools.partial(generate_tokens, dm, dp, pb, lb, key, **common))[0]
                for pb, lb in sets
            )
            c = t_small / t_plain
            for g in args.gammas:
                t_spec, st = 0.0, collections.Counter()
                for pb, lb in sets:
                    fn = functools.partial(
                        speculative_generate,
                        target,
                        tp,
                        draft,
                        dp,
                        pb,
                        lb,
                        key,
                        spec=SpecConfig(gamma=g),
                        **common,
                    )
                    seconds, (_, _, stats) = timed(fn)  # same key every call: same stats
                    t_spec += seconds
                    st.update(
                        {k: int(stats[k]) for k in ("accepted", "trials", "proposed", "steps")}
                    )
                alpha = st["accepted"] / max(st["trials"], 1)
                pred = float(expected_tokens_per_cost(jnp.float32(alpha), g, c))
                row = dict(
                    batch=B,
                    prompts=n_sets * B,
                    temperature=temp,
                    gamma=g,
                    alpha=alpha,
                    c=c,
                    kept_fraction=st["accepted"] / max(st["proposed"], 1),
                    plain_s=t_plain,
                    spec_s=t_spec,
                    speedup=t_plain / t_spec,
                    predicted=pred,
                    target_calls=st["steps"],
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
    settings = sorted({(r["batch"], r["temperature"]) for r in res["runs"]})
    for i, (B, temp) in enumerate(settings):
        rows = sorted((r for r in res["runs"] if (r["batch"], r["temperature"]) == (B, temp)),
                      key=lambda r: r["gamma"])
        g = [r["gamma"] for r in rows]
        ax.plot(g, [r["speedup"] for r in rows], "o-", color=f"C{i}",
                label=f"measured B={B} T={temp:g}")
        ax.plot(g, [r["predicted"] for r in rows], "x--", color=f"C{i}", alpha=0.6,
                label=f"predicted B={B} T={temp:g}")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set_xlabel("γ (draft tokens per step)")
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
