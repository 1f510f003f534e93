"""The decoder-only transformer (RoPE, RMSNorm, GQA, SwiGLU, optional MoE), as stage functions.

The model is written once, as pure functions of one params pytree (named in `params.py`):

    embed(params, tokens)                       -> x_BTD
    block(p_l, x, pos, cfg, ops, cache)         -> x, layer state, MoE stats   (one layer)
    run_layers(layers, x, pos, cfg, ops, cache) -> x, cache, MoE stats          (a stack)
    head_logits(params, x) / head_loss(params, x, targets)

and everything else calls them: the plain forward below, pipeline stages (a contiguous
slice of the stacked layers), TeraPipe token slices (a cache holding earlier slices' K/V),
PipeDream, and the decode loop (a KV cache).

Why pure functions over a pytree, not NNX modules: every consumer wants arrays, not
objects. jit, `shard_map` stage slices, optax, orbax, the pipeline executors and the
Hugging Face converter all take nested dicts, and a stage must be able to run layers
[a, b) of a stack by slicing, which a pytree gives for free. The one thing modules add,
per-parameter metadata, is the table in `params.py` (shape, logical axes, init), from which
the shardings come. (An earlier version kept the math in functions and init/metadata in NNX
modules, merging the two on every call; there is now one representation.)

`ops` (see `ops.py`) is how the math meets the mesh: the default is the annotated SPMD form
(constraints by logical axes, no-ops without a mesh); `gendist.parallel` passes the explicit
per-device form inside `shard_map` and the expert-parallel MoE under a mesh.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gendist.config import ModelConfig
from gendist.models import moe as moe_lib
from gendist.models import params as P
from gendist.models.attention import attention
from gendist.models.layers import (
    apply_rope,
    mlp_hidden,
    mlp_inputs,
    rms_norm,
    rope_angles,
)
from gendist.models.ops import DEFAULT_OPS, Ops

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Re-exported: the parameter table's views.
init_params = P.init_params
logical_axes = P.logical_axes
param_shapes = P.param_shapes


class MoEStats(NamedTuple):
    """Router statistics of the MoE blocks a stack ran, one row per MoE block (G)."""

    loss_G: jax.Array  # weighted load-balance + z loss, added to the training loss
    drop_G: jax.Array  # fraction of token-choices dropped
    load_GE: jax.Array  # token-choices routed to each expert, before capacity


@functools.lru_cache(maxsize=64)
def _block_axes(cfg: ModelConfig, moe: bool) -> dict:
    return {k: s.axes for k, s in P.block_specs(cfg, moe).items()}


def compute_dtype(cfg: ModelConfig):
    return DTYPES[cfg.dtype]


def embed(params: dict, tokens_BT: jax.Array, cfg: ModelConfig, ops: Ops = DEFAULT_OPS):
    """Token embedding in the compute dtype, in the residual stream's layout."""
    return ops.embed(params["embed"], tokens_BT, compute_dtype(cfg))


def block(p: dict, x_BTD, pos_BT, cfg: ModelConfig, ops: Ops = DEFAULT_OPS, *, cache=None,
          layer_state=None):
    """One pre-norm block: x + attn(norm(x)), then + ffn(norm(x)).

    `p` holds one layer's weights (a dense block, or an MoE block when it has `moe_router`).
    Returns (x, layer_state, stats) with stats = (weighted router loss, drop fraction,
    load [E]) for an MoE block and None for a dense one.
    """
    moe = "moe_router" in p
    dt = x_BTD.dtype
    # Weights in their compute layout: under ZeRO-3 this is the layer's just-in-time gather.
    p = ops.weights(p, _block_axes(cfg, moe), dt)
    h_BTD, eps = norm_input(x_BTD, p, "attn_norm", cfg)
    if "wqkv_CHD" in p:  # the decode layout (`decode_params`): one output-major matrix
        qkv_BTCH = folded_matmul("BTD,CHD->BTCH", ops.enter(h_BTD), p["wqkv_CHD"].astype(dt),
                                 eps)
        k = cfg.num_kv_heads
        n = qkv_BTCH.shape[2] - 2 * k
        q_BTNH, k_BTKH, v_BTKH = jnp.split(qkv_BTCH, [n, n + k], axis=2)
    elif cfg.fused_projections:  # one [D, N+2K, H] matmul: fewer, larger GEMMs
        w_DCH = jnp.concatenate([p["wq"], p["wk"], p["wv"]], axis=1).astype(dt)
        (qkv_BTCH,) = ops.column(h_BTD, (w_DCH,))  # Megatron f, then the matmul
        n, k = p["wq"].shape[1], p["wk"].shape[1]  # local heads (per tensor shard)
        q_BTNH, k_BTKH, v_BTKH = jnp.split(qkv_BTCH, [n, n + k], axis=2)
    else:
        q_BTNH, k_BTKH, v_BTKH = ops.column(h_BTD, (p["wq"], p["wk"], p["wv"]))
    q_BTNH = ops.constrain(q_BTNH, ("batch", "seq", "heads", "head_dim"))
    k_BTKH = ops.constrain(k_BTKH, ("batch", "seq", "kv_heads", "head_dim"))
    v_BTKH = ops.constrain(v_BTKH, ("batch", "seq", "kv_heads", "head_dim"))
    cos, sin = rope_angles(pos_BT, cfg.head_dim, cfg.rope_theta, cfg.rope_llama3)
    q_BTNH, k_BTKH = apply_rope(q_BTNH, cos, sin), apply_rope(k_BTKH, cos, sin)
    sm_scale = 1.0 / math.sqrt(cfg.head_dim)
    if cache is None:
        o_BTNH = attention(q_BTNH, k_BTKH, v_BTKH, backend=cfg.attention, sm_scale=sm_scale)
    else:
        o_BTNH, layer_state = cache.attend(layer_state, q_BTNH, k_BTKH, v_BTKH, pos_BT,
                                           sm_scale)
    o_BTNH = ops.constrain(o_BTNH, ("batch", "seq", "heads", "head_dim"))
    if "wo_DNH" in p:  # decode layout
        attn_BTD = ops.leave(jnp.einsum("BTNH,DNH->BTD", o_BTNH, p["wo_DNH"].astype(dt)))
    else:
        attn_BTD = ops.row(o_BTNH, p["wo"], 2)  # the row-parallel matmul, then g
    x_BTD = x_BTD + attn_BTD
    x_BTD = ops.constrain(x_BTD, ("batch", "act_seq", "embed"))
    h_BTD, eps = norm_input(x_BTD, p, "mlp_norm", cfg)
    stats = None
    if moe:
        y_BTD, aux = ops.moe(moe_lib.layer_weights(p), ops.enter(h_BTD), cfg)  # f
        stats = (aux.weighted_loss(cfg), aux.drop_fraction, aux.expert_load_E)
        y_BTD = ops.leave(y_BTD)  # g
    elif "w_down_DF" in p:  # decode layout
        y_BTD = ops.leave(decode_mlp(ops.enter(h_BTD), p, cfg, eps))
    else:
        outs = ops.column(h_BTD, mlp_inputs(p, cfg.mlp, cfg.fused_projections))
        y_BTD = ops.row(mlp_hidden(outs, cfg.mlp), p["w_down"], 1)
    x_BTD = x_BTD + y_BTD
    x_BTD = ops.constrain(x_BTD, ("batch", "act_seq", "embed"))
    return x_BTD, layer_state, stats


def inv_rms(x_BTD, eps: float):
    """1 / rms(x) over the last axis, [B, T, 1] fp32: RMSNorm's scale (`layers.rms_norm`)."""
    x = x_BTD.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def norm_input(x_BTD, p: dict, name: str, cfg: ModelConfig):
    """(the next matmul's input, the eps of a folded norm): (rms_norm(x, p[name]), None), or
    for a decode layout whose gain is folded into the next matrix (`decode_params`: the
    layer has no `name`), (x, eps), the matmul applying 1/rms(x) (`folded_matmul`)."""
    if name in p:
        return rms_norm(x_BTD, p[name], cfg.norm_eps), None
    return x_BTD, cfg.norm_eps


# XLA's GPU compiler computes a matrix-vector product as a reduction (not a GEMM) when its
# operands hold at most this many elements (`ShouldStrengthReduceDotToReduce`,
# `IsMatrixMultiplicationTooSmallForRewriting(dot, 10000000)`, jax 0.11-0.12).
MATVEC_AS_REDUCTION = 10_000_000


def folded_matmul(spec: str, h, w, eps: float | None, dtype=None):
    """einsum(spec, h, w) (h [B, T, D], w [..., D]: output-major), in `dtype` (h's by
    default); with `eps`, w has a norm's gain folded in and the product is
    rms_norm(h) @ w = (h @ w) * 1/rms(h):

    * several tokens (a GEMM): h is scaled first, which XLA fuses with the residual add
      and the sum of squares into one normalisation kernel, as for an unfolded norm;
    * one token (B·T = 1, a decode step at batch 1), a matrix small enough for XLA to
      compute as a row reduction: h is appended to w as one more row, so the same
      reduction also gives sum(h²), and 1/rms scales the output in fp32 where it fuses into
      its consumers (RoPE and the KV writes, SwiGLU, the argmax): the norm costs no kernel
      (it was two: the sum of squares, and the scaling of h, which XLA does not fuse into a
      reduction that reads each element once per output row);
    * one token, a larger matrix (a GEMM on a GPU, which would copy an extended matrix):
      the product is scaled afterwards; the sum of squares is its own kernel.
    """
    dtype = dtype or h.dtype
    if eps is None:
        return jnp.einsum(spec, h, w).astype(dtype)
    if not one_row(h):
        return jnp.einsum(spec, scale_rows(h, inv_rms(h, eps)), w).astype(dtype)
    D = h.shape[-1]
    C = w.size // D
    out_shape = h.shape[:2] + w.shape[:-1]
    if (C + 2) * D <= MATVEC_AS_REDUCTION:
        x_D = h.reshape(D)
        wx_CD = jnp.concatenate([w.reshape(C, D), x_D[None, :].astype(w.dtype)], axis=0)
        y_C = jnp.sum(wx_CD.astype(jnp.float32) * x_D.astype(jnp.float32)[None, :], axis=1)
        r = jax.lax.rsqrt(y_C[C] / D + eps)
        return (y_C[:C] * r).reshape(out_shape).astype(dtype)
    y = jnp.einsum(spec, h, w, preferred_element_type=jnp.float32)
    r_BT1 = inv_rms(h, eps)
    return (y * r_BT1.reshape(r_BT1.shape[:2] + (1,) * (y.ndim - 2))).astype(dtype)


def one_row(h_BTD) -> bool:
    """Whether a matmul of h is a matrix-vector product (one token: B·T = 1)."""
    return h_BTD.shape[0] * h_BTD.shape[1] == 1


def scale_rows(h_BTD, r_BT1):
    """h * r per token, in fp32, cast back (RMSNorm without its gain)."""
    return (h_BTD.astype(jnp.float32) * r_BT1).astype(h_BTD.dtype)


def decode_mlp(h_BTD, p: dict, cfg: ModelConfig, eps: float | None = None):
    """The MLP on decode-layout weights (`decode_params`: output-major w_gate_up_GD or
    w_up_FD, and w_down_DF); eps: the norm folded into its input matrix (`norm_input`)."""
    dt = h_BTD.dtype
    w_in = p["w_gate_up_GD"] if cfg.mlp == "swiglu" else p["w_up_FD"]
    u_BTG = folded_matmul("BTD,GD->BTG", h_BTD, w_in.astype(dt), eps)
    return jnp.einsum("BTF,DF->BTD", mlp_hidden((u_BTG,), cfg.mlp), p["w_down_DF"].astype(dt))


def remat_policy(name: str):
    if name == "none":
        return None
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    if name == "save_matmuls":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    raise ValueError(f"model.remat={name!r}; choose none, full or save_matmuls.")


def layer_units(cfg: ModelConfig) -> int:
    """How many units the layer stack splits into: layers, or MoE groups of moe_every layers
    (moe_every - 1 dense blocks, then one MoE block). Pipeline stages take whole units."""
    return cfg.num_moe_layers or cfg.num_layers


def layers_of(params: dict) -> dict:
    """The layer-stacked part of the params: {'blocks'} (+ 'moe_blocks')."""
    return {k: params[k] for k in ("blocks", "moe_blocks") if k in params}


def unit_params(layers: dict, cfg: ModelConfig):
    """The layers as a stack of units on one leading axis: a dense model's blocks, or
    (dense blocks [G, moe_every - 1, ...], MoE blocks [G, ...]) for MoE groups."""
    moe = layers.get("moe_blocks")
    if moe is None:
        return layers["blocks"]
    G = jax.tree.leaves(moe)[0].shape[0]
    dense = jax.tree.map(lambda a: a.reshape(G, cfg.moe_every - 1, *a.shape[1:]),
                         layers["blocks"])
    return (dense, moe)


def _unit_fn(cfg: ModelConfig, ops: Ops, pos_BT, cache, moe: bool):
    """unit(x, (unit params, unit cache states)) -> (x, (states, MoE stats or None))."""
    if not moe:
        def unit(x, inp):
            p, ls = inp
            x, ls, _ = block(p, x, pos_BT, cfg, ops, cache=cache, layer_state=ls)
            return x, (ls, None)
    else:
        n = cfg.moe_every

        def unit(x, inp):
            (dp, mp), ls = inp
            sl = lambda a, b: None if ls is None else jax.tree.map(lambda s: s[a:b], ls)

            def dense_body(x, q):
                p, s = q
                x, s, _ = block(p, x, pos_BT, cfg, ops, cache=cache, layer_state=s)
                return x, s

            x, dense_ls = jax.lax.scan(dense_body, x, (dp, sl(0, n - 1)))
            moe_ls = None if ls is None else jax.tree.map(lambda s: s[n - 1], ls)
            x, moe_ls, stats = block(mp, x, pos_BT, cfg, ops, cache=cache, layer_state=moe_ls)
            new_ls = None if ls is None else jax.tree.map(
                lambda a, b: jnp.concatenate([a, b[None]], 0), dense_ls, moe_ls)
            return x, (new_ls, stats)

    if cfg.remat != "none":
        unit = jax.checkpoint(unit, policy=remat_policy(cfg.remat), prevent_cse=False)
    return unit


def apply_unit(pu, x_BTD, pos_BT, cfg: ModelConfig, ops: Ops = DEFAULT_OPS):
    """One unit of `unit_params` (one layer, or one MoE group), without a cache:
    (x, (weighted router loss, drop fraction, load [E]) or None)."""
    unit = _unit_fn(cfg, ops, pos_BT, None, isinstance(pu, tuple))
    x_BTD, (_, stats) = unit(x_BTD, (pu, None))
    return x_BTD, stats


def run_layers(layers: dict, x_BTD, pos_BT, cfg: ModelConfig, ops: Ops = DEFAULT_OPS,
               cache=None):
    """The stack: a scan of `block` over units of `layers` (a contiguous slice of the
    model's layer units, stacked on their leading axis), threading the cache's per-layer
    state. Returns (x, cache, MoEStats or None)."""
    if isinstance(layers["blocks"], (list, tuple)):  # the decode layout: one buffer per layer
        return _run_layer_list(layers["blocks"], x_BTD, pos_BT, cfg, ops, cache)
    units = unit_params(layers, cfg)
    moe = isinstance(units, tuple)
    num_units = jax.tree.leaves(units)[0].shape[0]
    states = None if cache is None else cache.layer_state()
    if states is not None and moe:
        states = jax.tree.map(lambda a: a.reshape(num_units, cfg.moe_every, *a.shape[1:]),
                              states)
    unit = _unit_fn(cfg, ops, pos_BT, cache, moe)
    unroll = max(1, min(cfg.scan_unroll, num_units))
    x_BTD, (new_states, stats) = jax.lax.scan(unit, x_BTD, (units, states), unroll=unroll)
    if moe:
        stats = MoEStats(*stats)
        if new_states is not None:
            new_states = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), new_states)
    if cache is not None:
        cache = cache.with_layer_state(new_states)
    return x_BTD, cache, stats


def _run_layer_list(blocks, x_BTD, pos_BT, cfg: ModelConfig, ops: Ops, cache):
    """The stack as straight-line code over separate per-layer weights (the decode layout):
    no layer loop, and a cache with one buffer per layer is updated in place, layer by
    layer, instead of being sliced and re-stacked around a scan."""
    states = None if cache is None else cache.layer_states()
    new_states = []
    for i, p in enumerate(blocks):
        ls = None if states is None else states[i]
        x_BTD, ls, _ = block(p, x_BTD, pos_BT, cfg, ops, cache=cache, layer_state=ls)
        new_states.append(ls)
    if cache is not None:
        cache = cache.with_layer_states(new_states)
    return x_BTD, cache, None


def head_params(params: dict, cfg: ModelConfig) -> dict:
    """What the output side reads: the final norm and the output matrix (the token table
    when tied)."""
    return {"final_norm": params["final_norm"],
            **({"embed": params["embed"]} if cfg.tie_embeddings else {"head": params["head"]})}


def head_logits(params: dict, x_BTD, cfg: ModelConfig, ops: Ops = DEFAULT_OPS):
    """fp32 logits [B, T, V] from the last block's output (final RMSNorm, output layer)."""
    if "final_norm" not in params:  # the decode layout, gain folded into head_VD
        w_VD = params["head_VD"]
        if one_row(x_BTD):  # fp32 logits (`folded_matmul`: the sum of squares fused in)
            return folded_matmul("BTD,VD->BTV", x_BTD, w_VD.astype(x_BTD.dtype), cfg.norm_eps,
                                 jnp.float32)
        return ops.logits(scale_rows(x_BTD, inv_rms(x_BTD, cfg.norm_eps)), w_VD.T)
    final_norm = ops.weights({"final_norm": params["final_norm"]},
                             {"final_norm": ("embed",)}, x_BTD.dtype)["final_norm"]
    h_BTD = rms_norm(x_BTD, final_norm, cfg.norm_eps)
    if cfg.tie_embeddings:
        w_DV = params["embed"].T
    else:  # the decode layout stores the output layer output-major (`decode_params`)
        w_DV = params["head_VD"].T if "head_VD" in params else params["head"]
    return ops.logits(h_BTD, w_DV)


def head_loss(params: dict, x_BTD, targets_BT, cfg: ModelConfig, ops: Ops = DEFAULT_OPS):
    """(summed next-token cross-entropy in fp32, token count) of the last block's output."""
    nll_BT = ops.nll(head_logits(params, x_BTD, cfg, ops), targets_BT)
    return jnp.sum(nll_BT), targets_BT.size


def _positions(tokens_BT, positions_BT):
    if positions_BT is not None:
        return positions_BT
    B, T = tokens_BT.shape
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def forward(cfg: ModelConfig, params: dict, tokens_BT, positions_BT=None, cache=None,
            ops: Ops = DEFAULT_OPS):
    """Logits [B, T, V] in fp32 (and the updated cache when one is given)."""
    pos_BT = _positions(tokens_BT, positions_BT)
    x_BTD = embed(params, tokens_BT, cfg, ops)
    if cache is not None:
        cache = cache.prepare(pos_BT)
    x_BTD, cache, _ = run_layers(layers_of(params), x_BTD, pos_BT, cfg, ops, cache)
    logits_BTV = head_logits(params, x_BTD, cfg, ops)
    return logits_BTV if cache is None else (logits_BTV, cache)


def moe_summary(stats: MoEStats | None) -> dict:
    """{} for a dense model; MoE: the summed router loss and the mean drop fraction."""
    if stats is None:
        return {}
    return {"moe_loss": jnp.sum(stats.loss_G), "moe_drop_fraction": jnp.mean(stats.drop_G),
            "moe_expert_load_GE": stats.load_GE}


def forward_with_aux(cfg: ModelConfig, params: dict, tokens_BT, ops: Ops = DEFAULT_OPS):
    """(fp32 logits, aux): aux holds the MoE router loss and metrics ({} when dense)."""
    pos_BT = _positions(tokens_BT, None)
    x_BTD = embed(params, tokens_BT, cfg, ops)
    x_BTD, _, stats = run_layers(layers_of(params), x_BTD, pos_BT, cfg, ops)
    return head_logits(params, x_BTD, cfg, ops), moe_summary(stats)


def inference_params(cfg: ModelConfig, params: dict) -> dict:
    """Parameters for decoding: every matrix cast once to the compute dtype.

    The forward pass casts each weight matrix to `cfg.dtype` where it uses it, so inside a
    decode loop that cast (a read of the fp32 matrix and a write of its copy) would repeat
    for every token. Casting once before the loop gives bitwise the same logits. Vectors
    (norm scales) and MoE routers stay fp32, as the model computes with them in fp32.
    """
    if isinstance(params.get("blocks"), (list, tuple)):
        return params  # the decode layout (`decode_params`) is cast already
    dt = DTYPES[cfg.dtype]

    def cast(path, w, axes):
        router = any("router" in str(getattr(k, "key", "")) for k in path)
        matrix = len([a for a in axes if a != "layers"]) >= 2  # per layer, as the model sees it
        return w.astype(dt) if matrix and not router else w

    return jax.tree_util.tree_map_with_path(cast, params, logical_axes(cfg),
                                            is_leaf=lambda x: isinstance(x, tuple))


def decode_params(cfg: ModelConfig, params: dict, fold_norms: bool = False) -> dict:
    """Parameters in the decode layout: built once per generation, read by the same `block`.

    A decode step multiplies one token's vector by every weight matrix, so its time is the
    time to read the weights. On a GPU, XLA turns each one-row matmul into a reduction, and
    how well that reduction streams the matrix depends on its layout: with the reduced (input)
    axis minor it is one fused row reduction per matrix; with the stored [input, output]
    layout XLA wrote the whole elementwise product to memory and read it back (three times
    the bytes; seen in the compiled HLO of `generate_tokens` for an H200). So every matrix is
    stored output-major here, cast once to the compute dtype, q|k|v and gate|up are fused
    into one matrix each, and every layer is its own buffer (a Python list, run
    straight-line by `run_layers`): no slices of a stacked weight inside the loop.

        wqkv_CHD [N+2K, H, D]   wo_DNH [D, N, H]   w_gate_up_GD [2F, D] (SwiGLU) or
        w_up_FD [F, D] (GELU)   w_down_DF [D, F]   head_VD [V, D] (the output layer)
        attn_norm, mlp_norm, final_norm [D] (fp32; only when not `fold_norms`)

    `fold_norms` (off by default: on an H200 it made batch-1 steps slower, 0.706 against
    0.650 ms for 350m and 1.354 against 1.214 ms for 1b, `benchmarks/README.md`, though
    it cuts the kernels per step from 325 to 240): each RMSNorm's gain g is multiplied into the matrix that
    reads the norm's output, in fp32 before the cast, and the norm's vector is left out
    (its absence is the marker `block` and `head_logits` read): norm(x) @ W =
    (x @ diag(g) W) * 1/rms(x), applied by `folded_matmul`. At batch 1 on a GPU a norm was
    two kernels (sum of squares; the scaling of x, which XLA does not fuse into the
    matrix-vector reduction that reads each element once per output row); now its sum of
    squares is one more row of the next matrix-vector reduction and its scale fuses into
    the consumers (for a matrix XLA multiplies as a GEMM: one kernel, the sum of squares).
    The output layer is its own folded copy of the token table when tied ([V, D]).

    The math is the model's: the same sums over the same products (the order of a float sum
    may differ, and a folded gain rounds once with the matrix, so logits agree to rounding
    and greedy tokens are tested equal). MoE models and params already in this layout are
    returned as `inference_params` / unchanged. Not for a tensor-parallel mesh (the fused
    matrices mix sharded axes).
    """
    if isinstance(params.get("blocks"), (list, tuple)):
        return params  # already in the decode layout
    base = inference_params(cfg, params)
    if "moe_blocks" in base:
        return base
    stacked = params["blocks"]  # as given (fp32): a gain is folded before the cast
    num = jax.tree.leaves(stacked)[0].shape[0]
    layers = tuple(decode_layer({k: w[i] for k, w in stacked.items()}, cfg, fold_norms)
                   for i in range(num))
    out = {k: v for k, v in base.items() if k not in ("blocks", "head")}
    head_VD = params["embed"] if cfg.tie_embeddings else params["head"].T
    if fold_norms:
        head_VD = head_VD * params["final_norm"].astype(jnp.float32)[None, :]
        del out["final_norm"]
    if fold_norms or not cfg.tie_embeddings:
        out["head_VD"] = head_VD.astype(DTYPES[cfg.dtype])
    return {**out, "blocks": layers}


def decode_layer(p: dict, cfg: ModelConfig, fold_norms: bool = True) -> dict:
    """One layer's weights (no `layers` axis) in the decode layout, in the compute dtype;
    `fold_norms`: the norms' gains multiplied into wqkv and w_gate_up (w_up), in fp32."""
    dt = DTYPES[cfg.dtype]
    f32 = lambda w: w.astype(jnp.float32)  # noqa: E731
    g_attn, g_mlp = f32(p["attn_norm"]), f32(p["mlp_norm"])
    out = {} if fold_norms else {"attn_norm": p["attn_norm"], "mlp_norm": p["mlp_norm"]}
    wqkv_CHD = jnp.concatenate([p["wq"], p["wk"], p["wv"]], axis=1).transpose(1, 2, 0)
    out["wqkv_CHD"] = (f32(wqkv_CHD) * g_attn[None, None, :] if fold_norms else wqkv_CHD).astype(dt)
    out["wo_DNH"] = p["wo"].transpose(2, 0, 1).astype(dt)
    if cfg.mlp == "swiglu":
        name, w_in_GD = "w_gate_up_GD", jnp.concatenate([p["w_gate"], p["w_up"]], axis=1).T
    else:
        name, w_in_GD = "w_up_FD", p["w_up"].T
    out[name] = (f32(w_in_GD) * g_mlp[None, :] if fold_norms else w_in_GD).astype(dt)
    out["w_down_DF"] = p["w_down"].T.astype(dt)
    return out
