"""Prefill + autoregressive decoding as one jitted `lax.while_loop` (no host round-trips).

Prompts of different lengths are right-padded; each sequence writes and attends at its own
positions (`cache.lengths`), so a batch needs no left-padding tricks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gendist.config import ModelConfig
from gendist.inference import fastpath, megakernel
from gendist.inference.cache import KVCache
from gendist.inference.sampling import SamplingParams, sample
from gendist.models import transformer


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


def prefill(cfg: ModelConfig, params, prompt_BT, prompt_len_B, cache: KVCache):
    """Run the prompts through the model, filling the cache; logits at each last token."""
    B, T = prompt_BT.shape
    pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) + cache.lengths[:, None]
    logits_BTV, cache = transformer.forward(cfg, params, prompt_BT, pos_BT, cache)
    last_BV = jnp.take_along_axis(logits_BTV, (prompt_len_B - 1)[:, None, None], axis=1)[:, 0]
    return last_BV, cache.rollback(cache.lengths + prompt_len_B)


def decode_step(cfg: ModelConfig, params, tokens_B, cache: KVCache):
    """Feed one token per sequence at its own position; returns (logits_BV, cache). With a
    `megakernel.ChainCache` the step is one persistent kernel (`megakernel.step`)."""
    if isinstance(cache, megakernel.ChainCache):
        return megakernel.step(cfg, params, tokens_B, cache)
    logits, cache = transformer.forward(cfg, params, tokens_B[:, None], cache.lengths[:, None],
                                        cache)
    return logits[:, 0], cache.advance(jnp.ones_like(cache.lengths))


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "sp", "eos_id", "fast"))
def generate_tokens(cfg: ModelConfig, params, prompt_BT, prompt_len_B, key, *,
                    max_new_tokens: int, sp: SamplingParams, eos_id: int = -1,
                    cache: KVCache | None = None, fast: bool | None = None):
    """New tokens [B, max_new_tokens] (eos-padded after a sequence stops) and counts [B].

    `fast` (None: on for a GPU, off for a CPU; see `fastpath`): weights in the decode layout
    and a per-layer cache (paged-kernel attention on a GPU). Params already in the decode
    layout are used as given (build them once with `decode_layout.decode_params` to keep the
    layout change out of every call).
    """
    B, T = prompt_BT.shape
    params = fastpath.prepare(cfg, params, fast)  # cast once, not once per token
    if cache is None:
        cache = fastpath.make_cache(cfg, B, T + max_new_tokens, fast)
    logits_BV, cache = prefill(cfg, params, prompt_BT, prompt_len_B, cache)
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

    def body(carry):
        i, tok_B, cache, out_BN, done_B, count_B, key = carry
        logits_BV, cache = decode_step(cfg, params, tok_B, cache)
        if not sp.greedy:  # greedy draws nothing: no key split (a kernel a step) in the loop
            key, sub = jax.random.split(key)
        else:
            sub = key
        nxt_B = sample(sub, logits_BV, sp)
        nxt_B = jnp.where(done_B, max(eos_id, 0), nxt_B)
        out_BN = out_BN.at[:, i].set(nxt_B)
        count_B = count_B + (~done_B).astype(jnp.int32)
        done_B = done_B | (nxt_B == eos_id)
        return i + 1, nxt_B, cache, out_BN, done_B, count_B, key

    carry = (jnp.int32(1), tok_B, cache, out_BN, done_B, count_B, key)
    _, _, _, out_BN, _, count_B, _ = jax.lax.while_loop(cond, body, carry)
    return out_BN, count_B


def generate_text(cfg: ModelConfig, params, prompts: list[str], *, max_new_tokens: int = 200,
                  sp: SamplingParams = SamplingParams(), seed: int = 0, eos_id: int = -1
                  ) -> list[str]:
    """Convenience: strings in, continuations out (byte-level tokenizer)."""
    from gendist.data.batches import decode, encode
    prompt_BT, len_B = pad_prompts([encode(p) for p in prompts])
    check_lengths(cfg, prompt_BT.shape[1], max_new_tokens)
    out, count = generate_tokens(cfg, params, jnp.asarray(prompt_BT), jnp.asarray(len_B),
                                 jax.random.key(seed), max_new_tokens=max_new_tokens, sp=sp,
                                 eos_id=eos_id)
    out, count = jax.device_get((out, count))
    return [decode(o[:c]) for o, c in zip(out, count, strict=True)]
