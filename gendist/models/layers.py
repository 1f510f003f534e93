"""Stateless pieces of a transformer block: RMSNorm, rotary embeddings, MLPs.

Pure functions of arrays, so the same math serves the NNX module, the explicit
tensor-parallel form, pipeline stages and the decode loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x_BTD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019), computed in fp32 and cast back."""
    x = x_BTD.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    scale = scale_D.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
    return (y * scale).astype(x_BTD.dtype)


def rope_angles(positions_BT: jax.Array, head_dim: int, theta: float, llama3=None):
    """cos, sin of the rotary angles (Su et al. 2021), shapes [B, T, H/2], fp32.

    `llama3`: (factor, low_freq_factor, high_freq_factor, original_max_len) rescales the
    frequencies as Llama 3.1 does (`ModelConfig.rope_llama3`); None leaves them alone.
    """
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if llama3 is not None:
        inv_freq = llama3_inv_freq(inv_freq, *llama3)
    ang_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    return jnp.cos(ang_BTh), jnp.sin(ang_BTh)


def llama3_inv_freq(inv_freq, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_len: int):
    """Llama 3.1's RoPE scaling (Meta's `apply_scaling`, HF's `rope_type: llama3`).

    Wavelengths longer than original_len/low_freq_factor (the slow dimensions, which never
    completed a turn in pre-training) are stretched by `factor`; those shorter than
    original_len/high_freq_factor are kept; in between the two are blended linearly in
    original_len/wavelength. No attention rescaling (HF's attention_factor is 1 here).
    """
    wavelen = 2 * jnp.pi / inv_freq
    low_wavelen = original_max_len / low_freq_factor
    high_wavelen = original_max_len / high_freq_factor
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, blended, scaled)


def apply_rope(x_BTNH: jax.Array, cos_BTh: jax.Array, sin_BTh: jax.Array) -> jax.Array:
    """Rotate pairs (x[:h], x[h:]) of each head by the position's angle (NeoX layout)."""
    h = x_BTNH.shape[-1] // 2
    x = x_BTNH.astype(jnp.float32)
    x1, x2 = x[..., :h], x[..., h:]
    c, s = cos_BTh[:, :, None, :], sin_BTh[:, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x_BTNH.dtype)


def mlp_inputs(p: dict, kind: str, fused: bool = False) -> tuple:
    """The MLP's input matrices [D, ...] (all multiply the same x): (w_gate, w_up) for
    SwiGLU, their [D, 2F] concatenation when `fused`, (w_up,) for GELU."""
    if kind == "swiglu" and fused:
        return (jnp.concatenate([p["w_gate"], p["w_up"]], axis=1),)
    if kind == "swiglu":
        return (p["w_gate"], p["w_up"])
    return (p["w_up"],)


def mlp_hidden(outs: tuple, kind: str) -> jax.Array:
    """The MLP's hidden activation [B, T, F] from x @ w for w in `mlp_inputs`."""
    if kind != "swiglu":
        return jax.nn.gelu(outs[0])
    gate_BTF, up_BTF = outs if len(outs) == 2 else jnp.split(outs[0], 2, axis=-1)
    return jax.nn.silu(gate_BTF) * up_BTF
