"""The decoder-only transformer (RoPE, RMSNorm, GQA, SwiGLU, optional MoE), as stage functions.

The model is written once, as pure functions of one params pytree (named in `params.py`):

    embed(params, tokens)                       -> x_BTD
    block(p_l, x, pos, cfg, ops, cache)         -> x, layer state, MoE stats   (one layer)
    run_layers(layers, x, pos, cfg, ops, cache) -> x, cache, MoE stats          (a stack)
    head_logits(params, x) / head_loss(params, x, targets)

and everything else calls them: the plain forward below, pipeline stages (a contiguous
slice of the stacked layers), TeraPipe token slices (a cache holding earlier slices' K/V),
PipeDream, and the reference decode path and prompt prefill (a KV cache: `cache.attend`).
The decode fast path runs its own layer over weights laid out for decoding
(`gendist.inference.decode_block`).

Why pure functions over a pytree, not NNX modules: every consumer wants arrays, not
objects. jit, `shard_map` stage slices, optax, orbax, the pipeline executors and the
Hugging Face converter all take nested dicts, and a stage must be able to run layers
[a, b) of a stack by slicing, which a pytree gives for free. The one thing modules add,
per-parameter metadata, is the table in `params.py` (shape, logical axes, init), from which
the shardings come.

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
from gendist.models import fp8 as fp8_lib
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

# Re-exported: the parameter table's views.
DTYPES = P.DTYPES
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
    load [E]) for an MoE block and None for a dense one. With a `cache`, attention writes
    this layer's keys and values into `layer_state` and reads them back (`cache.attend`).
    """
    moe = "moe_router" in p
    dt = x_BTD.dtype
    fp8 = _Fp8Products(p.get(fp8_lib.STATE_KEY))  # FP8 products' scaling state, or none
    # Weights in their compute layout: under ZeRO-3 this is the layer's just-in-time gather.
    p = ops.weights({k: v for k, v in p.items() if k != fp8_lib.STATE_KEY},
                    _block_axes(cfg, moe), dt)
    h_BTD = rms_norm(x_BTD, p["attn_norm"], cfg.norm_eps)
    cos, sin = rope_angles(pos_BT, cfg.head_dim, cfg.rope_theta, cfg.rope_llama3)
    sm_scale = 1.0 / math.sqrt(cfg.head_dim)
    o_BTNH, layer_state = _attention(p, h_BTD, pos_BT, cos, sin, sm_scale, cfg, ops, cache,
                                     layer_state, fp8)
    o_BTNH = ops.constrain(o_BTNH, ("batch", "seq", "heads", "head_dim"))
    attn_BTD = ops.row(o_BTNH, p["wo"], 2, **fp8.take(1, one=True))  # row-parallel, then g
    x_BTD = ops.constrain(x_BTD + attn_BTD, ("batch", "act_seq", "embed"))
    h_BTD = rms_norm(x_BTD, p["mlp_norm"], cfg.norm_eps)
    stats = None
    if moe:
        n = len(fp8_lib.products(cfg, moe=True)) - fp8.next  # the experts' products
        y_BTD, aux = ops.moe(moe_lib.layer_weights(p), ops.enter(h_BTD), cfg,
                             **fp8.take(n))  # f
        stats = (aux.weighted_loss(cfg), aux.drop_fraction, aux.expert_load_E)
        y_BTD = ops.leave(y_BTD)  # g
    else:
        ws = mlp_inputs(p, cfg.mlp, cfg.fused_projections)
        outs = ops.column(h_BTD, ws, **fp8.take(len(ws)))
        y_BTD = ops.row(mlp_hidden(outs, cfg.mlp), p["w_down"], 1, **fp8.take(1, one=True))
    x_BTD = x_BTD + y_BTD
    x_BTD = ops.constrain(x_BTD, ("batch", "act_seq", "embed"))
    return x_BTD, layer_state, stats


class _Fp8Products:
    """A block's FP8 products handed out in the order the block runs them (`fp8.products`):
    `take(n)` gives ops.column/ops.row their keyword (nothing when FP8 is off)."""

    def __init__(self, state):
        self.state, self.next = state, 0

    def take(self, n: int, one: bool = False) -> dict:
        if self.state is None:
            return {}
        metas = tuple(self.state.product(self.next + i) for i in range(n))
        self.next += n
        return {"fp8": metas[0] if one else metas}


def _attention(p, h_BTD, pos_BT, cos, sin, sm_scale, cfg: ModelConfig, ops: Ops, cache,
               layer_state, fp8: _Fp8Products | None = None):
    """Self-attention of the normed input: q, k, v, RoPE, attention (through the cache when
    one is given). Returns (o [B, T, N, H], layer_state)."""
    dt = h_BTD.dtype
    fp8 = fp8 or _Fp8Products(None)
    if cfg.fused_projections:  # one [D, N+2K, H] matmul: fewer, larger GEMMs
        w_DCH = jnp.concatenate([p["wq"], p["wk"], p["wv"]], axis=1).astype(dt)
        (qkv_BTCH,) = ops.column(h_BTD, (w_DCH,), **fp8.take(1))  # Megatron f, then the matmul
        n, k = p["wq"].shape[1], p["wk"].shape[1]  # local heads (per tensor shard)
        q_BTNH, k_BTKH, v_BTKH = jnp.split(qkv_BTCH, [n, n + k], axis=2)
    else:
        q_BTNH, k_BTKH, v_BTKH = ops.column(h_BTD, (p["wq"], p["wk"], p["wv"]), **fp8.take(3))
    q_BTNH = ops.constrain(q_BTNH, ("batch", "seq", "heads", "head_dim"))
    k_BTKH = ops.constrain(k_BTKH, ("batch", "seq", "kv_heads", "head_dim"))
    v_BTKH = ops.constrain(v_BTKH, ("batch", "seq", "kv_heads", "head_dim"))
    q_BTNH, k_BTKH = apply_rope(q_BTNH, cos, sin), apply_rope(k_BTKH, cos, sin)
    if cache is None:
        return attention(q_BTNH, k_BTKH, v_BTKH, backend=cfg.attention, sm_scale=sm_scale), None
    return cache.attend(layer_state, q_BTNH, k_BTKH, v_BTKH, pos_BT, sm_scale)


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


def head_params(params: dict, cfg: ModelConfig) -> dict:
    """What the output side reads: the final norm and the output matrix (the token table
    when tied)."""
    return {"final_norm": params["final_norm"],
            **({"embed": params["embed"]} if cfg.tie_embeddings else {"head": params["head"]})}


def head_logits(params: dict, x_BTD, cfg: ModelConfig, ops: Ops = DEFAULT_OPS):
    """fp32 logits [B, T, V] from the last block's output (final RMSNorm, output layer)."""
    final_norm = ops.weights({"final_norm": params["final_norm"]},
                             {"final_norm": ("embed",)}, x_BTD.dtype)["final_norm"]
    h_BTD = rms_norm(x_BTD, final_norm, cfg.norm_eps)
    w_DV = params["embed"].T if cfg.tie_embeddings else params["head"]
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
