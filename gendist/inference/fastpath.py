"""Which decode path runs: the fast path on a GPU, the reference path on a CPU.

The fast path is three choices made once per generation, none of which changes the math
beyond rounding:

* weights in the decode layout (`decode_layout.decode_params`: cast once, output-major,
  fused q|k|v and gate|up, one buffer per layer, run straight-line);
* a cache with one buffer per layer, written in place (`layer_cache.LayerKVCache`);
* on a GPU, attention through the paged kernel over that cache, which reads only the
  tokens below each sequence's length (`backend="pallas"`), and each one-token step of a
  layer in four fewer kernels: RMSNorm as one kernel instead of two, and RoPE + the cache
  write + attention as one (`LayerKVCache.decode_kernels`, `pallas_kernels.decode_attention`).

`fast=None` everywhere means "the default": on for a GPU, off for a CPU, where the
reference path (stacked weights, one stacked cache, jnp attention) stays as it was and the
fast path is opt-in (`fast=True`; tests compare the two token for token).
"""

from __future__ import annotations

import jax

from gendist.config import ModelConfig
from gendist.inference.cache import ContiguousKVCache
from gendist.inference.layer_cache import LayerKVCache
from gendist.models import decode_layout, transformer


def enabled(fast: bool | None) -> bool:
    """`fast`, or the default for this machine's backend (GPU: on)."""
    return jax.default_backend() == "gpu" if fast is None else bool(fast)


def per_layer(cfg: ModelConfig, fast: bool | None) -> bool:
    """Whether the model runs as separate per-layer buffers (then caches are per-layer too):
    the fast path for a dense model. MoE blocks stay stacked (`decode_params` leaves them)."""
    return enabled(fast) and not cfg.num_moe_layers


def attention_backend(cfg: ModelConfig, backend: str | None = None) -> str:
    """'pallas' (paged kernel, reads only valid tokens) on a GPU when the kernels take the
    head dim (a power of two >= 16), else 'xla'; an explicit `backend` wins."""
    if backend is not None:
        return backend
    h = cfg.head_dim
    ok = h >= 16 and h & (h - 1) == 0
    return "pallas" if ok and jax.default_backend() == "gpu" else "xla"


def prepare(cfg: ModelConfig, params: dict, fast: bool | None = None) -> dict:
    """Params as the chosen path reads them (cast once; the decode layout when fast)."""
    if enabled(fast):
        return decode_layout.decode_params(cfg, params)
    return decode_layout.inference_params(cfg, params)


def make_cache(cfg: ModelConfig, batch: int, max_len: int, fast: bool | None = None,
               backend: str | None = None, fused: bool = True, tiling: str = ""):
    """An empty cache for `batch` sequences of up to `max_len` tokens on the chosen path
    (`fused`: decode steps through the fused kernels on the "pallas" backend, the attention
    kernel tiled by `tiling`, `LayerKVCache.tiling`)."""
    dt = transformer.DTYPES[cfg.dtype]
    if per_layer(cfg, fast):
        return LayerKVCache.create(cfg.num_layers, batch, max_len, cfg.num_kv_heads,
                                   cfg.head_dim, dt, backend=attention_backend(cfg, backend),
                                   fused=fused, tiling=tiling)
    return ContiguousKVCache.create(cfg.num_layers, batch, max_len, cfg.num_kv_heads,
                                    cfg.head_dim, dt)
