"""A language model as decoding sees it: params, an apply function and a cache factory.

Speculative decoding runs two of these (draft and target); tests plug in exact Markov
tables behind the same interface, so the sampler can be checked against enumeration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gendist.config import ModelConfig
from gendist.inference.cache import KVCache


@dataclasses.dataclass(frozen=True)
class LM:
    """apply(params, tokens_BT, positions_BT, cache) -> (fp32 logits_BTV, cache)."""

    apply: Callable[..., tuple[jax.Array, Any]]
    make_cache: Callable[[int, int], Any]  # (batch, max_len) -> empty cache
    vocab_size: int
    name: str = "lm"
    prepare: Callable[[Any], Any] = lambda params: params  # once per generation (dtype casts)
    # greedy(params, tokens_B, cache, n) -> (tokens [B, n], the cache n longer): n greedy tokens
    # after tokens_B (at the cache's length) in one call; None: a call a token only
    greedy: Callable[..., tuple[jax.Array, Any]] | None = None
    path: str = ""  # the decode path of a transformer's plan (its XLA options: `decoder.jit_by_path`)


def transformer_lm(plan, name: str = "transformer", cache_factory=None) -> LM:
    """A gendist transformer behind the LM interface, decoding as its `decoder.DecodePlan`
    does (its path, its cache; `cache_factory(cfg, batch, max_len)` instead when given).
    Pass the plan's weights (`plan.params`) as the LM's params; other weights are laid out
    for the path by `prepare`. A plan that takes greedy steps inside the megakernel
    (`greedy_steps` > 1) gives the LM `greedy`: a greedy draft then proposes its tokens in
    one kernel launch (`speculative._draft`)."""
    skeleton = dataclasses.replace(plan, params=None)  # the path alone: no weights held

    def make_cache(batch, max_len):
        if cache_factory is not None:
            return cache_factory(plan.cfg, batch, max_len)
        return skeleton.make_cache(batch, max_len)

    def apply(params, tokens_BT, pos_BT, cache):
        return dataclasses.replace(skeleton, params=params).forward(tokens_BT, pos_BT, cache)

    def greedy(params, tokens_B, cache, n: int):  # n >= 2 steps in one megakernel launch
        return dataclasses.replace(skeleton, params=params, greedy_steps=n).greedy_tokens(tokens_B, cache)

    return LM(apply, make_cache, plan.cfg.vocab_size, name,
              prepare=lambda params: skeleton.with_params(params).params,
              greedy=greedy if plan.greedy_steps > 1 else None, path=plan.path)


def draft_config(target: ModelConfig, width: int, num_layers: int) -> ModelConfig:
    """A small draft for `target`: `num_layers` blocks of width `width` (64-wide heads, SwiGLU
    width 8/3·width), the target's dtype, length and vocabulary. Its few layers run
    straight-line (no layer loop), which takes the loop's per-layer launches out of each
    draft call."""
    heads = max(1, width // 64)
    return ModelConfig(vocab_size=target.vocab_size, d_model=width, num_layers=num_layers,
                       num_heads=heads, num_kv_heads=heads, head_dim=64,
                       d_ff=int(width * 8 // 3) // 64 * 64 or 64,
                       max_seq_len=target.max_seq_len, dtype=target.dtype,
                       attention="xla" if target.attention == "pallas" else target.attention,
                       scan_unroll=num_layers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NoCache(KVCache):
    """Bookkeeping only, for models that need no keys and values (Markov tables)."""

    lengths: jax.Array

    def layer_state(self):
        return ()

    def with_layer_state(self, state):
        return self

    def attend(self, layer_state, q, k, v, q_pos, sm_scale):
        raise TypeError("NoCache holds no keys or values")


def markov_lm(name: str = "markov") -> LM:
    """Next-token logits depend only on the current token: params is a [V, V] logit table."""

    def apply(table_VV, tokens_BT, pos_BT, cache):
        return jnp.take(table_VV, tokens_BT, axis=0).astype(jnp.float32), cache

    def make_cache(batch, max_len):
        return NoCache(jnp.zeros((batch,), jnp.int32))

    return LM(apply, make_cache, vocab_size=-1, name=name)
