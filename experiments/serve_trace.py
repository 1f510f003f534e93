"""Serving a request trace: continuous batching over paged KV memory against static batching
with a contiguous max-length cache, at the same KV memory budget.

A seeded synthetic trace: Poisson arrivals at `--rate` requests/s; prompt and output lengths
log-normal as in `kv_utilisation.py` (medians 160 and 180 tokens, σ 0.9), clipped to the
prompt width and the maximum length. Random weights and greedy decoding, so no request
stops early: every request asks for exactly its output length.

* engine: `gendist.inference.engine` (continuous batching, paged KV, preemption, prefill of
  the joining requests only, the host one call ahead of the device), with a pool of
  budget / page_size pages and up to `--slots` sequences at once;
* static: batches of budget / max_len sequences (each reserves max_len slots), formed from
  the requests that have arrived, prefilled together and decoded until the longest one is
  done, with no joins (FasterTransformer-style). Same model, same jitted step per token.

Reports output tokens/s (all output tokens / time to the last one), time to first token
(from arrival) and inter-token latency p50/p99, KV memory reserved and holding tokens, with
a progress bar and a plot.

    python experiments/serve_trace.py --preset 350m --requests 200 --rate 50 --out $OUT

On a CPU: `--preset tiny --requests 12 --max-len 64 --max-prompt 24 --budget-seqs 2 --slots 8`
(a smoke test; the figures only mean something on a GPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gendist.inference import decoder
from gendist.inference.engine import Engine, EngineConfig, Request
from gendist.inference.sampling import SamplingParams, sample
from gendist.models import transformer
from gendist.presets import preset

GREEDY = SamplingParams(temperature=0.0)


def make_trace(n: int, rate: float, max_prompt: int, max_len: int, vocab: int, seed: int):
    """Requests with Poisson arrival times, log-normal prompt and output lengths."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n)) if rate > 0 else np.zeros(n)
    prompt = np.clip(rng.lognormal(np.log(160), 0.9, n), 4, max_prompt).astype(int)
    output = np.clip(rng.lognormal(np.log(180), 0.9, n), 1, max_len - prompt).astype(int)
    return [Request(rng.integers(0, vocab, p).astype(np.int32), int(o), arrival=float(a))
            for p, o, a in zip(prompt, output, arrivals, strict=True)]


def fresh(trace):
    return [Request(r.prompt, r.max_new_tokens, arrival=r.arrival) for r in trace]


class Progress:
    """tqdm when installed, else a line every 10%."""

    def __init__(self, total: int, desc: str):
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="tok", mininterval=1.0)
        except ImportError:
            self.bar, self.total, self.done, self.desc, self.next = None, total, 0, desc, 0.1

    def update(self, n: int):
        if self.bar is not None:
            self.bar.update(n)
            return
        self.done += n
        if self.done >= self.next * self.total:
            print(f"{self.desc}: {self.done}/{self.total} tokens", flush=True)
            self.next += 0.1

    def close(self):
        if self.bar is not None:
            self.bar.close()


@jax.jit
def _static_prefill(plan, cache, prompt_BT, len_B):
    logits, cache = plan.prefill(prompt_BT, len_B, cache)
    return cache, sample(None, logits, GREEDY)


@functools.partial(jax.jit, donate_argnums=(1,))
def _static_step(plan, cache, tok_B):
    logits, cache = plan.step(tok_B, cache)
    return cache, sample(None, logits, GREEDY)


def run_static(plan, trace, max_prompt: int, progress):
    """Static batching: up to `plan.batch` arrived requests at a time, each holding
    `plan.max_len` slots of a contiguous cache, decoded together until the longest is done."""
    slots, max_len = plan.batch, plan.max_len
    cache0 = plan.make_cache()
    pending = sorted(trace, key=lambda r: r.arrival)
    t0 = time.perf_counter()
    steps = useful = reserved_steps = 0
    while pending:
        now = time.perf_counter() - t0
        if pending[0].arrival > now:
            time.sleep(pending[0].arrival - now)
            now = time.perf_counter() - t0
        n = min(slots, sum(r.arrival <= now for r in pending))  # pending is arrival-sorted
        batch, pending = pending[:n], pending[n:]
        prompts = np.zeros((slots, max_prompt), np.int32)
        lens = np.ones(slots, np.int32)
        for i, r in enumerate(batch):
            prompts[i, : len(r.prompt)] = r.prompt
            lens[i] = len(r.prompt)
        cache = cache0.rollback(jnp.zeros((slots,), jnp.int32))
        cache, tok = _static_prefill(plan, cache, jnp.asarray(prompts), jnp.asarray(lens))
        out = np.asarray(tok)
        stamp = time.perf_counter() - t0
        for i, r in enumerate(batch):
            r.output.append(int(out[i]))
            r.token_times.append(stamp)
        progress.update(len(batch))
        for _ in range(max(r.max_new_tokens for r in batch) - 1):
            cache, tok = _static_step(plan, cache, tok)
            out = np.asarray(tok)
            stamp = time.perf_counter() - t0
            steps += 1
            live = [r for r in batch if len(r.output) < r.max_new_tokens]
            for i, r in enumerate(batch):
                if len(r.output) < r.max_new_tokens:
                    r.output.append(int(out[i]))
                    r.token_times.append(stamp)
            useful += sum(len(r.prompt) + len(r.output) for r in batch)
            reserved_steps += 1
            progress.update(len(live))
    return dict(steps=steps, mean_kv_tokens_reserved=slots * max_len,
                mean_kv_tokens_used=useful / max(reserved_steps, 1))


def summarize(trace, kv_bytes_per_token: int, extra: dict) -> dict:
    ttft = np.array([r.token_times[0] - r.arrival for r in trace])
    itl = np.concatenate([np.diff(r.token_times) for r in trace if len(r.token_times) > 1]
                         or [np.zeros(0)])
    end = max(r.token_times[-1] for r in trace)
    tokens = sum(len(r.output) for r in trace)
    pct = lambda x, q: float(np.percentile(x, q)) * 1e3 if len(x) else float("nan")  # noqa: E731
    out = dict(output_tokens=tokens, seconds=end, output_tokens_per_s=tokens / end,
               ttft_ms_p50=pct(ttft, 50), ttft_ms_p99=pct(ttft, 99),
               itl_ms_p50=pct(itl, 50), itl_ms_p99=pct(itl, 99), **extra)
    for k in ("mean_kv_tokens_reserved", "mean_kv_tokens_used"):
        out[k.replace("tokens", "GB")] = out[k] * kv_bytes_per_token / 1e9
    return out


def plot(res: dict, path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print("plot skipped:", e)
        return
    names = [n for n in ("engine", "static") if "output_tokens_per_s" in res.get(n, {})]
    if not names:
        return
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].bar(names, [res[n]["output_tokens_per_s"] for n in names], color=["C0", "C1"])
    axes[0].set_ylabel("output tokens / s")
    x = np.arange(4)
    keys = ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")
    for i, n in enumerate(names):
        axes[1].bar(x + 0.4 * i, [res[n][k] for k in keys], 0.4, label=n, color=f"C{i}")
    axes[1].set_xticks(x + 0.2, ["TTFT p50", "TTFT p99", "ITL p50", "ITL p99"])
    axes[1].set_yscale("log")
    axes[1].set_ylabel("ms")
    axes[1].legend()
    for i, n in enumerate(names):
        axes[2].bar([2 * i, 2 * i + 0.8], [res[n]["mean_kv_GB_reserved"], res[n]["mean_kv_GB_used"]],
                    0.8, color=[f"C{i}", f"C{i}"], alpha=0.9)
    axes[2].set_xticks([0, 0.8, 2, 2.8], ["engine\nheld", "engine\nused", "static\nheld",
                                          "static\nused"][: 2 * len(names)])
    axes[2].set_ylabel("KV GB (mean over steps)")
    fig.suptitle(f"{res['preset']}, {res['requests']} requests at {res['rate']}/s, "
                 f"KV budget {res['budget_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="350m")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=50.0, help="arrivals per second (0: all at 0)")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--budget-seqs", type=int, default=16,
                    help="KV budget in max-length sequences (= the static batch)")
    ap.add_argument("--slots", type=int, default=64, help="engine: sequences at once")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--systems", nargs="+", default=["engine", "static"],
                    help="engine, static, engine_sync (the engine reading every call before "
                         "the next: isolates the overlapped host loop)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    args = ap.parse_args()

    cfg = preset(args.preset).model
    params = transformer.init_params(cfg, 0)
    trace = make_trace(args.requests, args.rate, args.max_prompt, args.max_len, cfg.vocab_size,
                       args.seed)
    budget = args.budget_seqs * args.max_len
    itemsize = jnp.dtype(transformer.DTYPES[cfg.dtype]).itemsize
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
    res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, preset=args.preset,
               requests=args.requests, rate=args.rate, max_len=args.max_len,
               max_prompt=args.max_prompt, budget_tokens=budget, page_size=args.page_size,
               engine_slots=args.slots, static_slots=args.budget_seqs,
               path=decoder.plan(cfg, params, args.budget_seqs, args.max_len).line,
               kv_bytes_per_token=per_token,
               trace_output_tokens=sum(r.max_new_tokens for r in trace),
               trace_prompt_tokens=sum(len(r.prompt) for r in trace))
    print(res, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = res["device"].replace(" ", "_").lower()
    path = out / f"serve_trace_{tag}.json"
    warm = make_trace(4, 0, args.max_prompt, args.max_len, cfg.vocab_size, args.seed + 1)
    for name in args.systems:
        try:
            reqs = fresh(trace)
            if name in ("engine", "engine_sync"):
                ecfg = EngineConfig(max_slots=args.slots, max_prompt_len=args.max_prompt,
                                    max_len=args.max_len, num_pages=budget // args.page_size,
                                    page_size=args.page_size, overlap=name == "engine")
                eng = Engine(cfg, params, ecfg)
                eng.warmup()  # compile every prefill shape and the step outside the timed run
                bar = Progress(res["trace_output_tokens"], name)
                eng.run(reqs, realtime=True, on_token=bar.update)
                bar.close()
                s = eng.stats
                extra = dict(steps=s["steps"], prefills=s["prefills"],
                             prefill_tokens_computed=s["prefill_tokens"],
                             overlapped_reads=s["overlapped_reads"],
                             preemptions=s["preemptions"],
                             mean_kv_tokens_reserved=s["page_steps"] / max(s["steps"], 1)
                             * args.page_size,
                             peak_kv_tokens_reserved=s["peak_pages"] * args.page_size,
                             mean_kv_tokens_used=s["token_steps"] / max(s["steps"], 1))
            else:
                plan = decoder.plan(cfg, params, args.budget_seqs, args.max_len)
                run_static(plan, fresh(warm), args.max_prompt, Progress(0, "warm-up"))
                bar = Progress(res["trace_output_tokens"], name)
                extra = run_static(plan, reqs, args.max_prompt, bar)
                bar.close()
            res[name] = summarize(reqs, per_token, extra)
        except Exception as e:  # one failing system must not lose the other
            res[name] = dict(error=repr(e)[:2000])
        print(name, json.dumps(res[name]), flush=True)
        path.write_text(json.dumps(res, indent=1))
    if "engine" in res and "static" in res and "output_tokens_per_s" in res.get("static", {}) \
            and "output_tokens_per_s" in res["engine"]:
        res["engine_over_static"] = (res["engine"]["output_tokens_per_s"]
                                     / res["static"]["output_tokens_per_s"])
        print(f"engine / static output tokens/s: {res['engine_over_static']:.2f}")
    path.write_text(json.dumps(res, indent=1))
    plot(res, out / f"serve_trace_{tag}.png")


if __name__ == "__main__":
    main()
