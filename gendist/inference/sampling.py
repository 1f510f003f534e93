"""Temperature, top-k and top-p in fp32, shared by plain and speculative decoding.

`processed_logits` is the single place that turns raw logits into the distribution that
is sampled, so a draft and a target are always transformed identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy).")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off).")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 = off).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def processed_logits(logits_BV: jax.Array, sp: SamplingParams) -> jax.Array:
    """fp32 logits after temperature, top-k and top-p (masked entries are -inf)."""
    x = logits_BV.astype(jnp.float32)
    if sp.greedy:
        return x
    x = x / sp.temperature
    V = x.shape[-1]
    if 0 < sp.top_k < V:
        kth = jax.lax.top_k(x, sp.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if sp.top_p < 1.0:
        sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_x, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = mass_before < sp.top_p
        cutoff = jnp.min(jnp.where(keep_sorted, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < cutoff, -jnp.inf, x)
    return x


def probs(logits_BV: jax.Array, sp: SamplingParams) -> jax.Array:
    """The sampling distribution; one-hot of the argmax when greedy."""
    x = processed_logits(logits_BV, sp)
    if sp.greedy:
        return jax.nn.one_hot(jnp.argmax(x, axis=-1), x.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(x, axis=-1)


def sample(key, logits_BV: jax.Array, sp: SamplingParams) -> jax.Array:
    """One token per row, int32 [B]."""
    x = processed_logits(logits_BV, sp)
    if sp.greedy:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)
