"""Prefill + autoregressive decoding as one jitted `lax.while_loop` (no host round-trips).

Prompts of different lengths are right-padded; each sequence writes and attends at its own
positions (`cache.lengths`), so a batch needs no left-padding tricks. The model's path, its
weights and its cache come from the decode front door (`decoder.plan`): `generate` runs a
plan, `generate_tokens` builds one for its call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gendist.config import ModelConfig
from gendist.inference import decoder
from gendist.inference.cache import KVCache
from gendist.inference.sampling import SamplingParams, sample


def check_lengths(cfg: ModelConfig, prompt_len: int, max_new_tokens: int) -> None:
    total = prompt_len + max_new_tokens
    if total > cfg.max_seq_len:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
            f"exceeds model.max_seq_len={cfg.max_seq_len}; shorten the prompt or lower "
            "max_new_tokens.")


def pad_prompts(prompts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists into [B, T] int32 plus their lengths [B]."""
    if not prompts or min(len(p) for p in prompts) == 0:
        raise ValueError("every prompt needs at least one token")
    T = max(len(p) for p in prompts)
    out = np.zeros((len(prompts), T), np.int32)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = p
    return out, np.array([len(p) for p in prompts], np.int32)


def _generate(plan: decoder.DecodePlan, prompt_BT, prompt_len_B, key, *, max_new_tokens: int,
              sp: SamplingParams, eos_id: int = -1, cache: KVCache | None = None):
    """New tokens [B, max_new_tokens] (eos-padded after a sequence stops) and counts [B],
    decoded by `plan` (`decoder.plan`) into `cache` (the plan's own by default). Greedy
    decoding with a plan of `greedy_steps` N > 1 takes N tokens a megakernel call, the first
    call fewer where N does not divide the tokens after the prompt's (max_new_tokens - 1), so
    that no call decodes a token past max_new_tokens."""
    B, T = prompt_BT.shape
    n = plan.greedy_steps if sp.greedy else 1  # tokens a loop step
    first = (max_new_tokens - 1) % n  # the first call's tokens when n does not divide them
    if cache is None:
        cache = plan.make_cache(B, T + max_new_tokens)
    logits_BV, cache = plan.prefill(prompt_BT, prompt_len_B, cache)
    key, sub = jax.random.split(key)
    tok_B = sample(sub, logits_BV, sp)
    out_BN = jnp.full((B, max_new_tokens), max(eos_id, 0), jnp.int32).at[:, 0].set(tok_B)
    done_B = tok_B == eos_id
    count_B = jnp.ones((B,), jnp.int32)

    def cond(carry):
        i, _, _, _, done_B, _, _ = carry
        if eos_id < 0:  # nothing stops early: a plain count, which XLA sees as a known trip
            return i < max_new_tokens  # count (on a GPU, no predicate read back per step)
        return (i < max_new_tokens) & ~jnp.all(done_B)

    def chunk(carry, steps: int = n):  # `steps` greedy tokens from one megakernel call
        i, tok_B, cache, out_BN, done_B, count_B, key = carry
        toks_BN, cache = plan.greedy_tokens(tok_B, cache, steps)
        if eos_id >= 0:  # past a sequence's first eos (in an earlier chunk or this one): eos, not counted
            after_BN = jnp.cumsum(toks_BN == eos_id, axis=1) - (toks_BN == eos_id) > 0
            after_BN = after_BN | done_B[:, None]
            toks_BN = jnp.where(after_BN, eos_id, toks_BN)
            count_B = count_B + (~after_BN).sum(axis=1).astype(jnp.int32)
            done_B = done_B | (toks_BN == eos_id).any(axis=1)
        out_BN = jax.lax.dynamic_update_slice_in_dim(out_BN, toks_BN, i, axis=1)
        return i + steps, toks_BN[:, -1], cache, out_BN, done_B, count_B, key

    def body(carry):
        i, tok_B, cache, out_BN, done_B, count_B, key = carry
        logits_BV, cache = plan.step(tok_B, cache, order_only=sp.greedy)  # greedy: the argmax
        if not sp.greedy:  # greedy draws nothing: no key split (a kernel a step) in the loop
            key, sub = jax.random.split(key)
        else:
            sub = key
        nxt_B = sample(sub, logits_BV, sp)
        if eos_id >= 0:  # without an eos nothing stops: no flags or counts kept a step (at batch 1
            nxt_B = jnp.where(done_B, eos_id, nxt_B)  # each is a kernel of ~1 us)
            count_B = count_B + (~done_B).astype(jnp.int32)
            done_B = done_B | (nxt_B == eos_id)
        # i < max_new_tokens: an update in place with no bounds check (`.at[:, i].set` would
        # compute one, a kernel a step at batch 1)
        out_BN = jax.lax.dynamic_update_slice_in_dim(out_BN, nxt_B[:, None], i, axis=1)
        return i + 1, nxt_B, cache, out_BN, done_B, count_B, key

    carry = (jnp.int32(1), tok_B, cache, out_BN, done_B, count_B, key)
    if n > 1 and first:
        carry = chunk(carry, first)
    if n == 1 or max_new_tokens - 1 >= n:  # a loop that runs (a loop of n tokens a call traced
        carry = jax.lax.while_loop(cond, chunk if n > 1 else body, carry)  # only where one fits)
    _, _, _, out_BN, _, count_B, _ = carry
    if eos_id < 0:
        count_B = jnp.full((B,), max_new_tokens, jnp.int32)
    return out_BN[:, :max_new_tokens], jnp.minimum(count_B, max_new_tokens)


# jitted with the XLA options its plan's path needs (`decoder.jit_by_path`)
generate = decoder.jit_by_path(_generate, ("max_new_tokens", "sp", "eos_id"), lambda plan, *a, **kw: (plan.path,))


def generate_tokens(cfg: ModelConfig, params, prompt_BT, prompt_len_B, key, *,
                    max_new_tokens: int, sp: SamplingParams, eos_id: int = -1,
                    cache: KVCache | None = None, path: str = "auto", kernel=None):
    """New tokens [B, max_new_tokens] (eos-padded after a sequence stops) and counts [B].

    Builds the decode plan for this call (`decoder.plan`: `path` "auto" | "megakernel" |
    "fast" | "reference", the megakernel's `kernel`) and runs it (`generate`). To keep the
    weights' layout change out of repeated calls, build the plan once and call `generate`.
    """
    B, T = prompt_BT.shape
    p = decoder.plan(cfg, params, B, T + max_new_tokens, path, kernel)
    return generate(p, prompt_BT, prompt_len_B, key, max_new_tokens=max_new_tokens, sp=sp,
                    eos_id=eos_id, cache=cache)


def generate_text(cfg: ModelConfig, params, prompts: list[str], *, max_new_tokens: int = 200,
                  sp: SamplingParams = SamplingParams(), seed: int = 0, eos_id: int = -1,
                  path: str = "auto") -> list[str]:
    """Convenience: strings in, continuations out (byte-level tokenizer; `path` as in
    `generate_tokens`)."""
    from gendist.data.batches import decode, encode
    prompt_BT, len_B = pad_prompts([encode(p) for p in prompts])
    check_lengths(cfg, prompt_BT.shape[1], max_new_tokens)
    out, count = generate_tokens(cfg, params, jnp.asarray(prompt_BT), jnp.asarray(len_B),
                                 jax.random.key(seed), max_new_tokens=max_new_tokens, sp=sp,
                                 eos_id=eos_id, path=path)
    out, count = jax.device_get((out, count))
    return [decode(o[:c]) for o, c in zip(out, count, strict=True)]
