"""Which product splits make a whole megakernel decode step fastest for a model's shape?

The cost model (`pallas_kernels/chain/plan.py: choose_split`) prices each product alone, and
splits interact: at `1b` q|k|v 16x8 is 9% faster with o kept off the attention blocks and no
faster without (`benchmarks/decode.md`). This searches in whole steps instead: starting from
the cost model's splits, coordinate descent: o's blocks (`spare`) alone, then product by
product the cost model's next-best splits (a distinct chunk-group count each), each under both
o placements, keeping a change only when the step is at least --gain faster; rounds until
nothing changes. (A change that pays only beside another product's is still missed.) Each candidate is
timed as `decode_floor.py` times a `chain@OPTS` variant (greedy `generate`, batch 1,
random weights), so the winner is what the front door would run. It prints the
`plan.MEASURED` entry to add for the shape.

    python3 experiments/tune_chain_splits.py --preset llama3.2-1b --out $OUT     # one H200

Writes tune_chain_splits_<preset>.json (every candidate's time) to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_floor import run_case  # noqa: E402

from pallas_kernels.chain import attention as ca  # noqa: E402
from pallas_kernels.chain import plan  # noqa: E402

NAMES = ("qkv", "o", "gu", "down")


def alternatives(D: int, N1: int, F: int, blocks: int, att_blocks: int, spare: bool,
                 k: int = 3) -> dict[str, list[tuple[int, int]]]:
    """Per product, the cost model's k best splits after its choice, each with a chunk-group
    count of its own, as (sk, st) in the model's order; o's within the blocks it may use
    (blocks - att_blocks when spare)."""
    ranked = {}
    chosen = plan.products(D, N1, F, blocks, True, att_blocks=att_blocks if spare else 0, ranked=ranked)
    out = {}
    for p in chosen:
        picks, groups = [], {p.split.sk}
        for _, split in ranked[p.name]:
            if split.sk not in groups and len(picks) < k:
                groups.add(split.sk)
                picks.append((split.sk, split.st))
        out[p.name] = picks
    return out


def variant(splits: dict, spare: bool, stages: int = 16) -> str:
    """The `chain@OPTS` variant of a candidate (`decode_floor.chain_options`)."""
    opts = [str(stages), f"spare={int(spare)}"] + [f"{n}={sk}x{st}" for n, (sk, st) in sorted(splits.items())]
    return "chain@" + ",".join(opts)


def descend(time_ms, alts_for, gain: float = 0.005, rounds: int = 3):
    """Coordinate descent: (best splits {name: (sk, st)}, best spare, best ms, every timing
    {variant: ms}). time_ms(splits, spare) -> ms (inf for a candidate that fails);
    alts_for(spare) -> {name: [(sk, st), ...]} (`alternatives`). A change is kept when it is
    at least `gain` (relative) faster than the best so far."""
    seen = {}

    def timed(splits, spare):
        key = variant(splits, spare)
        if key not in seen:
            seen[key] = time_ms(dict(splits), spare)
        return seen[key]

    best, best_spare = {}, False
    best_ms = timed(best, best_spare)
    for _ in range(rounds):
        changed = False
        ms = timed(best, not best_spare)
        if ms < best_ms * (1 - gain):
            best_spare, best_ms, changed = not best_spare, ms, True
        for name in NAMES:  # each alternative under both o placements: they interact
            for spare in (best_spare, not best_spare):
                for split in alts_for(spare)[name]:
                    trial = {**best, name: split}
                    ms = timed(trial, spare)
                    if ms < best_ms * (1 - gain):
                        best, best_spare, best_ms, changed = trial, spare, ms, True
        if not changed:
            break
    return best, best_spare, best_ms, seen


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--alternatives", type=int, default=3, help="next-best splits tried a product")
    ap.add_argument("--gain", type=float, default=0.005, help="least relative gain that counts")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import jax  # noqa: PLC0415

    from gendist.inference import decoder  # noqa: PLC0415
    from gendist.models import transformer  # noqa: PLC0415
    from gendist.presets import preset  # noqa: PLC0415
    from gendist.timing import warm_gpu  # noqa: PLC0415
    from pallas_kernels._mgpu import sm_count  # noqa: PLC0415

    cfg = preset(args.preset).model
    D, F, hd = cfg.d_model, cfg.d_ff, cfg.head_dim
    N1 = D + 2 * cfg.num_kv_heads * hd
    heads = D // hd // ca.group_of(D // hd, cfg.num_kv_heads)
    blocks = sm_count()
    warm_gpu()
    params = decoder.layout(cfg, transformer.init_params(cfg, 0), "megakernel")

    def time_ms(splits, spare):
        v = variant(splits, spare)
        try:
            ms = run_case(cfg, params, 1, v, args, profile=False)["ms_per_step"]
        except Exception as e:  # noqa: BLE001 - a split the kernel cannot take: say so, go on
            print(f"{v}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return float("inf")
        print(f"{v}: {ms:.4f} ms a step", flush=True)
        return ms

    best, spare, ms, seen = descend(
        time_ms, lambda s: alternatives(D, N1, F, blocks, heads, s, args.alternatives),
        args.gain, args.rounds)
    start = seen[variant({}, False)]
    entry = tuple((n, *best[n]) for n in NAMES if n in best)
    print(f"best: {variant(best, spare)} {ms:.4f} ms a step, the cost model's {start:.4f} "
          f"({1 - ms / start:.1%} faster)")
    print(f"plan.MEASURED entry: {(D, N1, F, blocks, heads)}: ({entry}, {spare}),  "
          f"# {args.preset}: {ms:.3f} ms, not {start:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"tune_chain_splits_{args.preset}.json").write_text(json.dumps(dict(
        device=jax.devices()[0].device_kind, jax=jax.__version__, preset=args.preset,
        key=[D, N1, F, blocks, heads], cost_model_ms=start, best=variant(best, spare), best_ms=ms,
        entry=[list(entry), spare], timed=seen), indent=1))


if __name__ == "__main__":
    main()
