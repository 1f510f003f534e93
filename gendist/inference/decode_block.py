"""The decode block: a model in the decode layout (`decode_layout`) run over a KV cache.

    forward(cfg, params, tokens_BT, pos_BT, cache) -> (fp32 logits [B, T, V], cache)

The math is the model's (`models.transformer`), for one process and no mesh: the layers run
straight-line over their separate weights (no layer loop), each reading and writing its own
cache buffers in place (`KVCache.layer_states`), or, where the weights come stacked on a
leading layer axis (the megakernel's prompt, `megakernel.prompt_params`), as one scan over
them (`scan_layers`); each layer is

    h = norm(x);  q|k|v = one matmul;  o = attention over the cache;  x += o @ wo
    h = norm(x);  x += mlp(h)           (mlp: one gate|up matmul, the activation, down)

On a cache's fused decode path (`KVCache.decode_kernels`: a GPU's "pallas" `LayerKVCache`)
each RMSNorm is one Pallas kernel and RoPE + the cache write + attention another
(`KVCache.attend_qkv`). A residual add is then done inside the norm kernel that follows it;
for the add that ends a layer that norm is the next layer's, so every layer returns its MLP
output unsummed and the next one adds it (`add_rms_norm`). Without the kernels the same
adds run in XLA, in the same order: the sums are the model's.

Nothing here takes the training model's `Ops` (Megatron f/g, ZeRO gathers, constraints):
a decode step is a single-device program over weights cast and laid out once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gendist.config import ModelConfig
from gendist.models import layers
from gendist.models.attention import attention
from gendist.models.params import DTYPES
from pallas_kernels import head as head_kernel
from pallas_kernels import rms_norm as norm_kernel


def embed(params: dict, tokens_BT, cfg: ModelConfig):
    """The tokens' embedding rows in the compute dtype [B, T, D]. Token ids are clamped to the
    table (mode="clip"): XLA then reads a row as a plain dynamic slice, where `jnp.take`'s
    default fill of out-of-range ids costs a kernel of its own a decode step (measured in the
    megakernel step, benchmarks/decode.md)."""
    return jnp.take(params["embed"], tokens_BT, axis=0, mode="clip").astype(DTYPES[cfg.dtype])


def head_logits(params: dict, x_BTD, cfg: ModelConfig, kernel: bool = False):
    """fp32 logits [B, T, V]: the final RMSNorm, then the output layer (the token table when
    tied, else `head_VD`). `kernel`: both in one Pallas kernel (`pallas_kernels.head`) where
    it takes the rows and the table (up to 16 rows), else XLA's."""
    B, T, D = x_BTD.shape
    table_VD = params["embed"] if cfg.tie_embeddings else params["head_VD"]
    if kernel and head_kernel.supports(B * T, *table_VD.shape):
        logits = head_kernel.head_logits(x_BTD.reshape(B * T, D), params["final_norm"],
                                         table_VD.astype(x_BTD.dtype), eps=cfg.norm_eps)
        return logits.reshape(B, T, -1)
    h_BTD = layers.rms_norm(x_BTD, params["final_norm"], cfg.norm_eps)
    return jnp.einsum("BTD,VD->BTV", h_BTD, table_VD.astype(h_BTD.dtype),
                      preferred_element_type=jnp.float32)


def rms_norm(x_BTD, scale_D, eps: float, kernel: bool):
    """`layers.rms_norm`, as one Pallas kernel when `kernel` and the width is a power of two;
    XLA's two kernels (sum of squares, scaling) otherwise."""
    if kernel and norm_kernel.supports(x_BTD.shape[-1]):
        return norm_kernel.rms_norm(x_BTD, scale_D, eps=eps)
    return layers.rms_norm(x_BTD, scale_D, eps)


def add_rms_norm(x_BTD, delta_BTD, scale_D, eps: float, kernel: bool):
    """(x + delta, its RMSNorm): the residual add and the norm after it, in one Pallas kernel
    under the same conditions as `rms_norm`."""
    if kernel and norm_kernel.supports(x_BTD.shape[-1]):
        return norm_kernel.rms_norm(x_BTD, scale_D, delta_BTD.astype(x_BTD.dtype), eps=eps)
    s_BTD = x_BTD + delta_BTD
    return s_BTD, layers.rms_norm(s_BTD, scale_D, eps)


def qkv_fused(h_BTD, p: dict):
    """The q|k|v projection [B, T, N+2K, H] of the normed input: one matmul."""
    return jnp.einsum("BTD,CHD->BTCH", h_BTD, p["wqkv_CHD"].astype(h_BTD.dtype))


def qkv(h_BTD, p: dict, num_kv_heads: int):
    """q [B, T, N, H], k and v [B, T, K, H] from the normed input: one fused matmul."""
    qkv_BTCH = qkv_fused(h_BTD, p)
    n = qkv_BTCH.shape[2] - 2 * num_kv_heads
    return tuple(jnp.split(qkv_BTCH, [n, n + num_kv_heads], axis=2))


def attention_output(o_BTNH, p: dict):
    """The attention's output projection [B, T, D] (from `wo_DC` [D, N*H] where a layer has
    it: a layer's slice of stacked weights fuses into XLA's matmul only where the product
    contracts one axis, else it is copied out first)."""
    if "wo_DC" in p:
        B, T = o_BTNH.shape[:2]
        return jnp.einsum("BTC,DC->BTD", o_BTNH.reshape(B, T, -1), p["wo_DC"].astype(o_BTNH.dtype))
    return jnp.einsum("BTNH,DNH->BTD", o_BTNH, p["wo_DNH"].astype(o_BTNH.dtype))


def mlp(h_BTD, p: dict, cfg: ModelConfig):
    """The MLP on the normed input: w_gate_up_GD (or w_up_FD), the activation, w_down_DF."""
    dt = h_BTD.dtype
    w_in = p["w_gate_up_GD"] if cfg.mlp == "swiglu" else p["w_up_FD"]
    u_BTG = jnp.einsum("BTD,GD->BTG", h_BTD, w_in.astype(dt))
    return jnp.einsum("BTF,DF->BTD", layers.mlp_hidden((u_BTG,), cfg.mlp),
                      p["w_down_DF"].astype(dt))


def block(p: dict, x_BTD, pending_BTD, pos_BT, cfg: ModelConfig, cache, layer_state, angles=None):
    """One layer in the decode layout: (x after attention, the MLP's output not yet added,
    the layer's new cache state). `pending_BTD` is the previous layer's MLP output (None for
    the first layer), added here before the first norm; angles: RoPE's (cos, sin) at pos_BT
    (`layers.rope_angles`), made here when not given."""
    B, T = pos_BT.shape
    norm_k, attn_k = cache.decode_kernels(B, T) if cache is not None else (False, False)
    if pending_BTD is None:
        h_BTD = rms_norm(x_BTD, p["attn_norm"], cfg.norm_eps, norm_k)
    else:
        x_BTD, h_BTD = add_rms_norm(x_BTD, pending_BTD, p["attn_norm"], cfg.norm_eps, norm_k)
    cos, sin = angles or layers.rope_angles(pos_BT, cfg.head_dim, cfg.rope_theta, cfg.rope_llama3)
    sm_scale = 1.0 / math.sqrt(cfg.head_dim)
    if attn_k:  # RoPE, the cache write and attention in one kernel, from q|k|v unsplit
        o_BTNH, layer_state = cache.attend_qkv(layer_state, qkv_fused(h_BTD, p), cfg.num_heads,
                                               pos_BT, cos, sin, sm_scale)
    else:
        q_BTNH, k_BTKH, v_BTKH = qkv(h_BTD, p, cfg.num_kv_heads)
        q_BTNH = layers.apply_rope(q_BTNH, cos, sin)
        k_BTKH = layers.apply_rope(k_BTKH, cos, sin)
        if cache is None:  # the whole sequence at once, causal
            o_BTNH = attention(q_BTNH, k_BTKH, v_BTKH, backend=cfg.attention, sm_scale=sm_scale)
        else:
            o_BTNH, layer_state = cache.attend(layer_state, q_BTNH, k_BTKH, v_BTKH, pos_BT,
                                               sm_scale)
    x_BTD, h_BTD = add_rms_norm(x_BTD, attention_output(o_BTNH, p), p["mlp_norm"],
                                cfg.norm_eps, norm_k)
    return x_BTD, mlp(h_BTD, p, cfg), layer_state


def run_layers(blocks, x_BTD, pos_BT, cfg: ModelConfig, cache=None):
    """The layers, straight-line, each over its own cache buffers: (x, cache)."""
    states = [None] * len(blocks) if cache is None else cache.layer_states()
    pending_BTD, new_states = None, []
    for p, ls in zip(blocks, states, strict=True):
        x_BTD, pending_BTD, ls = block(p, x_BTD, pending_BTD, pos_BT, cfg, cache, ls)
        new_states.append(ls)
    x_BTD = x_BTD + pending_BTD
    return x_BTD, None if cache is None else cache.with_layer_states(new_states)


def scan_layers(blocks: dict, x_BTD, pos_BT, cfg: ModelConfig, cache):
    """The layers as one scan over weights stacked on a leading layer axis (`blocks`: the
    decode layout's keys, [L, ...] each): one layer body, compiled once. Layer l reads the
    cache through `cache.scan_state(l)` (the whole cache and the layer's index: nothing is
    copied a layer), its new rows come out of the scan and `cache.with_scanned_states`
    writes them all at once: (x, cache)."""
    num = jax.tree.leaves(blocks)[0].shape[0]
    angles = layers.rope_angles(pos_BT, cfg.head_dim, cfg.rope_theta, cfg.rope_llama3)  # once

    def body(carry, xs):
        x_BTD, pending_BTD = carry
        p, layer = xs
        x_BTD, pending_BTD, rows = block(p, x_BTD, pending_BTD, pos_BT, cfg, cache,
                                         cache.scan_state(layer), angles)
        return (x_BTD, pending_BTD), rows

    # the first layer's pending MLP output is zeros: x + 0 is x, so its sums are run_layers'
    (x_BTD, pending_BTD), rows = jax.lax.scan(body, (x_BTD, jnp.zeros_like(x_BTD)),
                                              (blocks, jnp.arange(num, dtype=jnp.int32)))
    return x_BTD + pending_BTD, cache.with_scanned_states(rows, pos_BT)


def forward(cfg: ModelConfig, params: dict, tokens_BT, pos_BT=None, cache=None,
            head: bool = False):
    """fp32 logits [B, T, V] of a model in the decode layout (and the cache when one is
    given: reserved by `prepare`, written at `pos_BT`; its lengths are the caller's).
    `head`: the output layer through its kernel (`head_logits`). Layers given as a dict of
    stacked arrays run as a scan (`scan_layers`; a cache is then needed), as a tuple
    straight-line (`run_layers`)."""
    B, T = tokens_BT.shape
    if pos_BT is None:
        pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if cache is not None:
        cache = cache.prepare(pos_BT)
    layers_ = scan_layers if isinstance(params["blocks"], dict) else run_layers
    x_BTD, cache = layers_(params["blocks"], embed(params, tokens_BT, cfg), pos_BT, cfg, cache)
    logits_BTV = head_logits(params, x_BTD, cfg, kernel=head)
    return logits_BTV if cache is None else (logits_BTV, cache)
