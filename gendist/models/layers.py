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


def rope_angles(positions_BT: jax.Array, head_dim: int, theta: float):
    """cos, sin of the rotary angles (Su et al. 2021), shapes [B, T, H/2], fp32."""
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    ang_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    return jnp.cos(ang_BTh), jnp.sin(ang_BTh)


def apply_rope(x_BTNH: jax.Array, cos_BTh: jax.Array, sin_BTh: jax.Array) -> jax.Array:
    """Rotate pairs (x[:h], x[h:]) of each head by the position's angle (NeoX layout)."""
    h = x_BTNH.shape[-1] // 2
    x = x_BTNH.astype(jnp.float32)
    x1, x2 = x[..., :h], x[..., h:]
    c, s = cos_BTh[:, :, None, :], sin_BTh[:, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x_BTNH.dtype)


def mlp(x_BTD: jax.Array, p: dict, kind: str, fused: bool = False) -> jax.Array:
    """SwiGLU (Shazeer 2020) or GELU MLP; weights w_gate/w_up [D, F], w_down [F, D].

    `fused`: gate and up as one [D, 2F] matmul (one larger GEMM instead of two).
    """
    dt = x_BTD.dtype
    if kind == "swiglu" and fused:
        w_DG = jnp.concatenate([p["w_gate"], p["w_up"]], axis=1).astype(dt)
        gate_BTF, up_BTF = jnp.split(jnp.einsum("BTD,DG->BTG", x_BTD, w_DG), 2, axis=-1)
        h_BTF = jax.nn.silu(gate_BTF) * up_BTF
    elif kind == "swiglu":
        up_BTF = jnp.einsum("BTD,DF->BTF", x_BTD, p["w_up"].astype(dt))
        gate_BTF = jnp.einsum("BTD,DF->BTF", x_BTD, p["w_gate"].astype(dt))
        h_BTF = jax.nn.silu(gate_BTF) * up_BTF
    else:
        h_BTF = jax.nn.gelu(jnp.einsum("BTD,DF->BTF", x_BTD, p["w_up"].astype(dt)))
    return jnp.einsum("BTF,FD->BTD", h_BTF, p["w_down"].astype(dt))
