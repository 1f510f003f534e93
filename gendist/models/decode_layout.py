"""Weights as a decode loop reads them: cast once, output-major, fused, one buffer per layer.

A decode step multiplies one token's vector by every weight matrix, so its time is the time
to read the weights. On a GPU, XLA turns each one-row matmul into a reduction, and how well
that reduction streams the matrix depends on its layout: with the reduced (input) axis minor
it is one fused row reduction per matrix; with the stored [input, output] layout XLA wrote
the whole elementwise product to memory and read it back (three times the bytes; seen in
the compiled HLO of `generate_tokens` for an H200, `benchmarks/README.md`). So
`decode_params` stores every matrix output-major, cast once to the compute dtype, fuses
q|k|v and gate|up into one matrix each, and keeps every layer in its own buffer (a tuple,
run straight-line by `transformer.run_layers`): no slices of a stacked weight inside the
loop.

    wqkv_CHD [N+2K, H, D]   wo_DNH [D, N, H]   w_gate_up_GD [2F, D] (SwiGLU) or
    w_up_FD [F, D] (GELU)   w_down_DF [D, F]   head_VD [V, D] (untied output layer)
    attn_norm, mlp_norm, final_norm [D] (fp32, as the model keeps them)

`transformer.block` runs a layer in this layout through `qkv` (or `qkv_fused`, the
unsplit projection for the fused decode attention kernel), `attention_output`, `mlp`,
`rms_norm` and `add_rms_norm` below (a layer is in it when `is_layer`; the norms are one
Pallas kernel each on a cache's fused decode path, `KVCache.decode_kernels`); the math is
the model's, the same sums over the same products (a float sum's order may differ: logits
agree to rounding, greedy tokens are tested equal).

Tried and removed: folding each RMSNorm's gain into the next matrix, with the sum of
squares computed as one more row of the matrix-vector reduction. It cut a 350m batch-1
step from 325 to 240 kernels, but on an H200 the step got slower (350m 0.706 against
0.650 ms, 1b 1.354 against 1.214 ms; `benchmarks/decode_floor_fold_nvidia_h200.json`):
XLA's reduction over the extended matrix lost its fast path. Also tried and removed: a
Pallas matrix-vector kernel that computes SwiGLU (down projection) or the split context's
merge (output projection) inside the product: 350m batch 1 went from 229 to 181 kernels
per step but from 0.503 to 0.540-0.619 ms (`benchmarks/decode_floor_matvec2_h200.json`).
And the products through a Mosaic GPU matrix-vector kernel (`pallas_kernels.matvec_mgpu`,
TMA ring; split products' partial sums summed inside the norm and attention kernels): faster
only on the two largest 1b products, a whole step slower (1b 1.106 against 1.065 ms, 350m
0.699 against 0.511; `benchmarks/decode_floor_matvec_mgpu_h200.json`, code in 123ede2).
And the SwiGLU MLP (gate|up, SwiGLU, down) as one persistent Mosaic GPU kernel
(`pallas_kernels.mlp_mgpu`, grid-wide barrier between the products): a 1b step 1.094 against
1.096 ms, 350m 0.620 against 0.528 (`benchmarks/decode_floor_mlp_h200.json`, the switch in
328416e).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gendist.config import ModelConfig
from gendist.models import layers
from gendist.models import params as P
from gendist.models.layers import mlp_hidden
from pallas_kernels import rms_norm as norm_kernel


def is_layout(params: dict) -> bool:
    """Whether `params` is in the decode layout already (its layers are a tuple)."""
    return isinstance(params.get("blocks"), (list, tuple))


def is_layer(p: dict) -> bool:
    """Whether one layer's weights are in the decode layout."""
    return "wqkv_CHD" in p


def inference_params(cfg: ModelConfig, params: dict) -> dict:
    """Parameters for decoding: every matrix cast once to the compute dtype.

    The forward pass casts each weight matrix to `cfg.dtype` where it uses it, so inside a
    decode loop that cast (a read of the fp32 matrix and a write of its copy) would repeat
    for every token. Casting once before the loop gives bitwise the same logits. Vectors
    (norm scales) and MoE routers stay fp32, as the model computes with them in fp32.
    """
    if is_layout(params):
        return params  # the decode layout (`decode_params`) is cast already
    dt = P.DTYPES[cfg.dtype]

    def cast(path, w, axes):
        router = any("router" in str(getattr(k, "key", "")) for k in path)
        matrix = len([a for a in axes if a != "layers"]) >= 2  # per layer, as the model sees it
        return w.astype(dt) if matrix and not router else w

    return jax.tree_util.tree_map_with_path(cast, params, P.logical_axes(cfg),
                                            is_leaf=lambda x: isinstance(x, tuple))


def decode_params(cfg: ModelConfig, params: dict) -> dict:
    """Parameters in the decode layout (module docstring), built once per generation.

    MoE models are returned as `inference_params` (their blocks stay stacked), params
    already in the layout unchanged. Not for a tensor-parallel mesh (the fused matrices
    mix sharded axes).
    """
    if is_layout(params):
        return params
    base = inference_params(cfg, params)
    if "moe_blocks" in base:
        return base
    stacked = base["blocks"]
    num = jax.tree.leaves(stacked)[0].shape[0]
    layers = tuple(decode_layer({k: w[i] for k, w in stacked.items()}, cfg) for i in range(num))
    out = {k: v for k, v in base.items() if k not in ("blocks", "head")}
    if not cfg.tie_embeddings:
        out["head_VD"] = base["head"].T
    return {**out, "blocks": layers}


def decode_layer(p: dict, cfg: ModelConfig) -> dict:
    """One layer's weights (no `layers` axis) in the decode layout, in the compute dtype."""
    dt = P.DTYPES[cfg.dtype]
    wqkv_CHD = jnp.concatenate([p["wq"], p["wk"], p["wv"]], axis=1).transpose(1, 2, 0)
    out = {"attn_norm": p["attn_norm"], "mlp_norm": p["mlp_norm"],
           "wqkv_CHD": wqkv_CHD.astype(dt), "wo_DNH": p["wo"].transpose(2, 0, 1).astype(dt),
           "w_down_DF": p["w_down"].T.astype(dt)}
    if cfg.mlp == "swiglu":
        out["w_gate_up_GD"] = jnp.concatenate([p["w_gate"], p["w_up"]], axis=1).T.astype(dt)
    else:
        out["w_up_FD"] = p["w_up"].T.astype(dt)
    return out


def rms_norm(x_BTD, scale_D, eps: float, kernel: bool):
    """`layers.rms_norm`, as one Pallas kernel when `kernel` (a decode step on the fused
    path, `KVCache.decode_kernels`) and the width is a power of two; XLA's two kernels
    (sum of squares, scaling) otherwise."""
    if kernel and norm_kernel.supports(x_BTD.shape[-1]):
        return norm_kernel.rms_norm(x_BTD, scale_D, eps=eps)
    return layers.rms_norm(x_BTD, scale_D, eps)


def add_rms_norm(x_BTD, delta_BTD, scale_D, eps: float, kernel: bool,
                 constrain=lambda s_BTD: s_BTD):
    """(x + delta, its RMSNorm): the residual add and the norm after it, in one Pallas kernel
    under the same conditions as `rms_norm`. `constrain` (a sharding constraint) applies to
    the sum before the norm reads it, as the model's own `x + delta` would be."""
    if kernel and norm_kernel.supports(x_BTD.shape[-1]):
        s_BTD, h_BTD = norm_kernel.rms_norm(x_BTD, scale_D, delta_BTD.astype(x_BTD.dtype),
                                            eps=eps)
        return constrain(s_BTD), h_BTD
    s_BTD = constrain(x_BTD + delta_BTD)
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
    """The attention's output projection [B, T, D]."""
    return jnp.einsum("BTNH,DNH->BTD", o_BTNH, p["wo_DNH"].astype(o_BTNH.dtype))


def mlp(h_BTD, p: dict, cfg: ModelConfig):
    """The MLP on the normed input: w_gate_up_GD (or w_up_FD), the activation, w_down_DF."""
    dt = h_BTD.dtype
    w_in = p["w_gate_up_GD"] if cfg.mlp == "swiglu" else p["w_up_FD"]
    u_BTG = jnp.einsum("BTD,GD->BTG", h_BTD, w_in.astype(dt))
    return jnp.einsum("BTF,DF->BTD", mlp_hidden((u_BTG,), cfg.mlp), p["w_down_DF"].astype(dt))
