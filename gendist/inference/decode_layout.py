"""Weights as a decode loop reads them: cast once, output-major, fused, one buffer per layer.

A decode step multiplies one token's vector by every weight matrix, so its time is the time
to read the weights. On a GPU, XLA turns each one-row matmul into a reduction, and how well
that reduction streams the matrix depends on its layout: with the reduced (input) axis minor
it is one fused row reduction per matrix; with the stored [input, output] layout XLA wrote
the whole elementwise product to memory and read it back (three times the bytes; seen in
the compiled HLO of a decode loop for an H200, `benchmarks/decode.md`). So `decode_params`
stores every matrix output-major, cast once to the compute dtype, fuses q|k|v and gate|up
into one matrix each, and keeps every layer in its own buffer (a tuple, run straight-line by
`decode_block.run_layers`): no slices of a stacked weight inside the loop.

    wqkv_CHD [N+2K, H, D]   wo_DNH [D, N, H]   w_gate_up_GD [2F, D] (SwiGLU) or
    w_up_FD [F, D] (GELU)   w_down_DF [D, F]   head_VD [V, D] (untied output layer)
    attn_norm, mlp_norm, final_norm [D] (fp32, as the model keeps them)

`decode_block` runs a layer in this layout; the math is the model's, the same sums over the
same products (a float sum's order may differ: logits agree to rounding, greedy tokens are
tested equal). `inference_params` is the reference path's layout: the model's own stacked
weights, cast once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gendist.config import ModelConfig
from gendist.models import params as P


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
    blocks = tuple(decode_layer({k: w[i] for k, w in stacked.items()}, cfg) for i in range(num))
    out = {k: v for k, v in base.items() if k not in ("blocks", "head")}
    if not cfg.tie_embeddings:
        out["head_VD"] = base["head"].T
    return {**out, "blocks": blocks}


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

