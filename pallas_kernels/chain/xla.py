"""The decode chain megakernel's math in XLA (any device): what `chain.chain_mgpu` computes,
for its tests and for decoding where the kernel does not run, and the RMSNorm gains folded
into the weights it reads."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.decode_attention import decode_attention_reference


def fold_norms(w_qkv, w_gu, g_attn_LD, g_mlp_LD):
    """w_qkv and w_gu with the RMSNorm gains folded into their columns (once, at load)."""
    fold = lambda w, g: (w.astype(jnp.float32) * g[:, None, :]).astype(jnp.bfloat16)  # noqa: E731
    return fold(w_qkv, g_attn_LD), fold(w_gu, g_mlp_LD)


def fold_head(table_VD, g_D):
    """The output layer's table with the final RMSNorm's gain folded into its columns: what
    `chain_mgpu(w_head=...)` reads (a copy when the table is the token embedding's)."""
    return (table_VD.astype(jnp.float32) * g_D[None, :]).astype(jnp.bfloat16)


def reference(x0_D, w_qkv, w_o, w_gu, w_down, kv=None, pos=None, rope=None, *, norms=None,
              eps: float = 1e-5, w_head=None):
    """The same chain in XLA: each product's input rounded to bf16, fp32 sums. norms:
    (g_attn [L, D], g_mlp [L, D]) for RMSNorms before q|k|v and gate|up (unfolded). With kv,
    pos, rope (`chain_mgpu`'s), each layer attends as `decode_attention_reference` does (D / hd
    query heads over the cache's H kv heads) and the result is (x_L, kv_new [L, 2, H, hd]).
    w_head [V, D]: one more result, z [1, V] = w_head bf16(x_L) (`chain_mgpu`'s, summed)."""
    D, F = w_o.shape[1], w_down.shape[2]

    def mv(w, v):
        return jnp.einsum("NK,K->N", w, v.astype(jnp.bfloat16), preferred_element_type=jnp.float32)

    def rms(v, g_D):
        return v * lax.rsqrt(jnp.mean(v * v) + eps) * g_D

    def attend(l, a):  # a: q|k|v [D + 2 H hd] fp32 -> (o [D], k_new [H, hd], v_new [H, hd])
        H, hd = kv.shape[2], kv.shape[4]
        half = hd // 2
        cos, sin = rope[None, :half], rope[None, half:]
        o, k, v = decode_attention_reference(
            a.reshape(1, D // hd + 2 * H, hd), kv[l, 0][:, None], kv[l, 1][:, None], pos.astype(jnp.int32),
            cos, sin, num_heads=D // hd)
        p = jnp.clip(pos[0], 0, kv.shape[3] - 1)
        return o.reshape(D), k[:, 0, p], v[:, 0, p]

    if rope is not None and rope.ndim == 2:  # a table: the row of the (clipped) position
        rope = rope[jnp.clip(pos[0], 0, kv.shape[3] - 1)]
    x = x0_D.astype(jnp.float32)
    new = []
    for l in range(w_qkv.shape[0]):
        a = mv(w_qkv[l], x if norms is None else rms(x, norms[0][l]))
        if kv is None:
            h = x + mv(w_o[l], a[:D])
        else:
            o, k_new, v_new = attend(l, a)
            new.append(jnp.stack([k_new, v_new]))
            h = x + mv(w_o[l], o)
        g = mv(w_gu[l], h if norms is None else rms(h, norms[1][l]))
        x = h + mv(w_down[l], jax.nn.silu(g[:F]) * g[F:])
    out = (x,) if kv is None else (x, jnp.stack(new))
    if w_head is not None:
        out += (mv(w_head, x)[None],)
    return out[0] if len(out) == 1 else out
