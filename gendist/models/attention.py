"""Attention backends behind one call: `attention(q, k, v, q_pos, kv_len, backend=...)`.

Positions make one code path serve training (q_pos = arange, kv_len = T), chunked prefill
and decoding against a cache (q_pos = length + t). A query at absolute position p sees
keys at positions <= p and < kv_len of its sequence.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp

BACKENDS = ("xla", "cudnn", "pallas")
_fell_back: set[str] = set()  # platforms already told about the cuDNN fallback


def resolve_backend(backend: str) -> str:
    """`backend`, except "cudnn" off-GPU: cuDNN exists only on NVIDIA GPUs, so attention
    falls back to "xla" there (the presets ask for cuDNN), saying so once per process.
    "pallas" stays: off-GPU its kernels run in interpret mode (slow, but exact)."""
    platform = jax.default_backend()
    if backend != "cudnn" or platform == "gpu":
        return backend
    if platform not in _fell_back:
        _fell_back.add(platform)
        logging.getLogger("gendist").warning(
            f"model.attention='cudnn' needs an NVIDIA GPU; using 'xla' attention on {platform}")
    return "xla"


def xla_attention(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, kv_len_B, sm_scale):
    """Plain jnp attention with grouped-query heads; fp32 softmax. The reference."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    S = k_BSKH.shape[1]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    s_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH,
                         preferred_element_type=jnp.float32) * sm_scale
    k_pos_S = jnp.arange(S)
    mask_BTS = (k_pos_S[None, None, :] <= q_pos_BT[:, :, None]) & (
        k_pos_S[None, None, :] < kv_len_B[:, None, None])
    s_BKGTS = jnp.where(mask_BTS[:, None, None], s_BKGTS, -jnp.inf)
    # A query with no visible key (only padding rows) gets zeros, not NaN.
    m = jnp.max(s_BKGTS, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s_BKGTS - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l == 0, 1.0, l)
    o_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", p.astype(v_BSKH.dtype), v_BSKH,
                         preferred_element_type=jnp.float32)
    return o_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)


def attention(q_BTNH, k_BSKH, v_BSKH, *, q_pos_BT=None, kv_len_B=None,
              backend: str = "xla", sm_scale: float | None = None):
    """Causal attention. Without positions: plain causal self-attention over T == S."""
    B, T, N, H = q_BTNH.shape
    S = k_BSKH.shape[1]
    sm_scale = 1.0 / math.sqrt(H) if sm_scale is None else sm_scale
    plain = q_pos_BT is None and kv_len_B is None
    if backend not in BACKENDS:
        raise ValueError(f"model.attention={backend!r}; choose one of {BACKENDS}.")
    backend = resolve_backend(backend)
    if backend == "cudnn" and plain:
        return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, is_causal=True,
                                            scale=sm_scale, implementation="cudnn")
    if backend == "pallas" and plain:
        from pallas_kernels.flash_attention import flash_attention
        return flash_attention(q_BTNH, k_BSKH, v_BSKH, causal=True, sm_scale=sm_scale)
    if q_pos_BT is None:
        q_pos_BT = jnp.broadcast_to(jnp.arange(T) + (S - T), (B, T))
    if kv_len_B is None:
        kv_len_B = jnp.full((B,), S, jnp.int32)
    return xla_attention(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, kv_len_B, sm_scale)
