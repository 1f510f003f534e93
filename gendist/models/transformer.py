"""A Flax NNX decoder-only transformer with its blocks stacked on a leading `layers` axis.

The block math lives in `block_forward`, a pure function of one layer's weights, applied to
the stack with `lax.scan`: pipeline stages take contiguous slices of the stacked arrays,
and the decode loop scans the KV cache's per-layer arrays alongside the weights.
Every parameter carries its logical axis names as `axes` metadata (see gendist.sharding).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from gendist.config import ModelConfig
from gendist.models.attention import attention
from gendist.models.layers import apply_rope, mlp, rms_norm, rope_angles
from gendist.sharding import column_input, compute_layout, constrain, row_output

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def block_param_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Shape and logical axes of one block's weights (without the `layers` axis)."""
    D, N, K, H, F = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_ff
    shapes = {
        "attn_norm": ((D,), ("embed",)),
        "wq": ((D, N, H), ("embed", "heads", "head_dim")),
        "wk": ((D, K, H), ("embed", "kv_heads", "head_dim")),
        "wv": ((D, K, H), ("embed", "kv_heads", "head_dim")),
        "wo": ((N, H, D), ("heads", "head_dim", "embed")),
        "mlp_norm": ((D,), ("embed",)),
        "w_up": ((D, F), ("embed", "mlp")),
        "w_down": ((F, D), ("mlp", "embed")),
    }
    if cfg.mlp == "swiglu":
        shapes["w_gate"] = ((D, F), ("embed", "mlp"))
    return shapes


def _init_block_param(key, name, shape, cfg: ModelConfig, num_layers: int):
    if name.endswith("norm"):
        return jnp.ones((num_layers, *shape), jnp.float32)
    std = cfg.init_std
    if name in ("wo", "w_down"):  # GPT-2: scale residual projections by 1/sqrt(2L)
        std = std / math.sqrt(2 * cfg.num_layers)
    return std * jax.random.normal(key, (num_layers, *shape), jnp.float32)


class Blocks(nnx.Module):
    """All transformer blocks, each weight stacked on a leading `layers` axis."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, num_layers: int | None = None):
        num_layers = cfg.num_layers if num_layers is None else num_layers
        for name, (shape, axes) in block_param_shapes(cfg).items():
            value = _init_block_param(rngs.params(), name, shape, cfg, num_layers)
            setattr(self, name, nnx.Param(value, axes=("layers", *axes)))

    def stacked(self) -> dict[str, jax.Array]:
        return {n: getattr(self, n)[...] for n in block_param_shapes_names(self)}


def block_param_shapes_names(blocks: Blocks) -> list[str]:
    return [n for n in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up",
                        "w_down") if hasattr(blocks, n)]


def block_forward(p: dict, x_BTD, pos_BT, cfg: ModelConfig, *, cache=None, layer_state=None,
                  ffn=None):
    """One pre-norm block: x + attn(norm(x)), then + mlp(norm(x)). Returns (x, layer_state)."""
    dt = x_BTD.dtype
    # Weights in their compute layout: under ZeRO-3 this is the layer's just-in-time gather.
    p = compute_layout(p, {k: a for k, (_, a) in block_param_shapes(cfg).items()}, dt)
    h_BTD = column_input(rms_norm(x_BTD, p["attn_norm"], cfg.norm_eps))  # Megatron f
    if cfg.fused_projections:  # one [D, N+2K, H] matmul: fewer, larger GEMMs
        w_DCH = jnp.concatenate([p["wq"], p["wk"], p["wv"]], axis=1).astype(dt)
        qkv_BTCH = jnp.einsum("BTD,DCH->BTCH", h_BTD, w_DCH)
        N, K = cfg.num_heads, cfg.num_kv_heads
        q_BTNH, k_BTKH, v_BTKH = jnp.split(qkv_BTCH, [N, N + K], axis=2)
    else:
        q_BTNH = jnp.einsum("BTD,DNH->BTNH", h_BTD, p["wq"].astype(dt))
        k_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, p["wk"].astype(dt))
        v_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, p["wv"].astype(dt))
    q_BTNH = constrain(q_BTNH, ("batch", "seq", "heads", "head_dim"))
    k_BTKH = constrain(k_BTKH, ("batch", "seq", "kv_heads", "head_dim"))
    v_BTKH = constrain(v_BTKH, ("batch", "seq", "kv_heads", "head_dim"))
    cos, sin = rope_angles(pos_BT, cfg.head_dim, cfg.rope_theta, cfg.rope_llama3)
    q_BTNH, k_BTKH = apply_rope(q_BTNH, cos, sin), apply_rope(k_BTKH, cos, sin)
    sm_scale = 1.0 / math.sqrt(cfg.head_dim)
    if cache is None:
        o_BTNH = attention(q_BTNH, k_BTKH, v_BTKH, backend=cfg.attention, sm_scale=sm_scale)
    else:
        o_BTNH, layer_state = cache.attend(layer_state, q_BTNH, k_BTKH, v_BTKH, pos_BT,
                                           sm_scale)
    o_BTNH = constrain(o_BTNH, ("batch", "seq", "heads", "head_dim"))
    x_BTD = x_BTD + row_output(jnp.einsum("BTNH,NHD->BTD", o_BTNH, p["wo"].astype(dt)))  # g
    x_BTD = constrain(x_BTD, ("batch", "act_seq", "embed"))
    h_BTD = column_input(rms_norm(x_BTD, p["mlp_norm"], cfg.norm_eps))  # Megatron f
    x_BTD = x_BTD + row_output(mlp(h_BTD, p, cfg.mlp, cfg.fused_projections) if ffn is None else ffn(h_BTD))  # g
    x_BTD = constrain(x_BTD, ("batch", "act_seq", "embed"))
    return x_BTD, layer_state


def remat_policy(name: str):
    if name == "none":
        return None
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    if name == "save_matmuls":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    raise ValueError(f"model.remat={name!r}; choose none, full or save_matmuls.")


def apply_blocks(stacked: dict, x_BTD, pos_BT, cfg: ModelConfig, cache=None):
    """Scan `block_forward` over the stacked layers (and the cache's per-layer arrays)."""

    def body(x, layer):
        p, layer_state = layer
        x, layer_state = block_forward(p, x, pos_BT, cfg, cache=cache, layer_state=layer_state)
        return x, layer_state

    policy = remat_policy(cfg.remat)
    if cfg.remat != "none":
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    layer_states = None if cache is None else cache.layer_state()
    unroll = min(cfg.scan_unroll, jax.tree.leaves(stacked)[0].shape[0])
    x_BTD, new_states = jax.lax.scan(body, x_BTD, (stacked, layer_states), unroll=unroll)
    return x_BTD, (None if cache is None else cache.with_layer_state(new_states))


class Transformer(nnx.Module):
    """Token embedding -> stacked blocks -> RMSNorm -> logits (tied or untied output)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, V = cfg.d_model, cfg.vocab_size
        self.embed = nnx.Param(cfg.init_std * jax.random.normal(rngs.params(), (V, D)),
                               axes=("vocab", "embed"))
        self.blocks = Blocks(cfg, rngs=rngs, num_layers=cfg.num_layers - cfg.num_moe_layers)
        if cfg.moe is not None:
            from gendist.models.moe_stack import MoEBlocks
            self.moe_blocks = MoEBlocks(cfg, rngs=rngs)
        self.final_norm = nnx.Param(jnp.ones((D,)), axes=("embed",))
        if not cfg.tie_embeddings:
            self.head = nnx.Param(cfg.init_std * jax.random.normal(rngs.params(), (D, V)),
                                  axes=("embed", "vocab"))

    def hidden(self, tokens_BT, positions_BT=None, cache=None):
        """Final normalised hidden states [B, T, D] (and the updated cache)."""
        h_BTD, cache, _ = self.hidden_and_aux(tokens_BT, positions_BT, cache)
        return h_BTD, cache

    def hidden_and_aux(self, tokens_BT, positions_BT=None, cache=None):
        """hidden(), plus auxiliary losses/metrics ({} for a dense model; MoE: moe_loss...)."""
        cfg = self.cfg
        B, T = tokens_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        dt = DTYPES[cfg.dtype]
        x_BTD = jnp.take(self.embed[...], tokens_BT, axis=0).astype(dt)
        # Vocab-parallel lookup: each shard's rows, summed over `tensor`, then sequence shards.
        x_BTD = constrain(x_BTD, ("batch", "seq", "embed"))
        x_BTD = constrain(x_BTD, ("batch", "act_seq", "embed"))
        aux = {}
        if cache is not None:
            cache = cache.prepare(positions_BT)
        if cfg.moe is None:
            x_BTD, cache = apply_blocks(self.blocks.stacked(), x_BTD, positions_BT, cfg, cache)
        else:
            from gendist.models.moe_stack import apply_moe_groups
            x_BTD, cache, aux = apply_moe_groups(self.blocks.stacked(), self.moe_blocks.stacked(),
                                                 x_BTD, positions_BT, cfg, cache)
        return rms_norm(x_BTD, self.final_norm[...], cfg.norm_eps), cache, aux

    def output_weights_DV(self) -> jax.Array:
        return self.embed[...].T if self.cfg.tie_embeddings else self.head[...]

    def logits_and_aux(self, tokens_BT):
        """Training view: fp32 logits [B, T, V] and the auxiliary dict."""
        h_BTD, _, aux = self.hidden_and_aux(tokens_BT)
        return self.logits(h_BTD), aux

    def logits(self, h_BTD):
        """fp32 logits [B, T, V] from final hidden states."""
        h_BTD = column_input(h_BTD)  # Megatron f before the vocab-parallel output layer
        w_DV = self.output_weights_DV().astype(h_BTD.dtype)
        logits_BTV = jnp.einsum("BTD,DV->BTV", h_BTD, w_DV, preferred_element_type=jnp.float32)
        return constrain(logits_BTV, ("batch", "seq", "vocab"))

    def __call__(self, tokens_BT, positions_BT=None, cache=None):
        """Logits [B, T, V] in fp32 (and the updated cache when one is given)."""
        h_BTD, cache = self.hidden(tokens_BT, positions_BT, cache)
        logits_BTV = self.logits(h_BTD)
        return logits_BTV if cache is None else (logits_BTV, cache)


# --- functional view: pure dicts of arrays for jit, optax, orbax and shardings ---------

def init_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    return Transformer(cfg, rngs=nnx.Rngs(params=seed))


def split_model(model: Transformer):
    """(graphdef, template state, params as a pure dict, logical axes as a pure dict)."""
    graphdef, state = nnx.split(model, nnx.Param)
    params = _pure(state)
    axes = _pure(jax.tree.map(lambda v: tuple(v.axes), state,
                              is_leaf=lambda v: isinstance(v, nnx.Variable)))
    return graphdef, state, params, axes


def _pure(state) -> dict:
    """nnx.State -> nested dict (the helper moved between flax versions)."""
    if hasattr(nnx, "to_pure_dict"):
        return nnx.to_pure_dict(state)
    return state.to_pure_dict()


def merge_model(graphdef, template_state, params: dict) -> Transformer:
    """A model whose Params are `params` (tracers inside jit)."""
    state = jax.tree.map(lambda v: v, template_state,
                         is_leaf=lambda v: isinstance(v, nnx.Variable))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


@functools.lru_cache(maxsize=16)
def abstract_model(cfg: ModelConfig):
    """graphdef, template state and logical axes without allocating weights."""
    model = nnx.eval_shape(lambda: init_model(cfg, 0))
    graphdef, state, _, axes = split_model(model)
    return graphdef, state, axes


def init_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Parameters as a pure dict (fp32)."""
    return split_model(init_model(cfg, seed))[2]


def forward(cfg: ModelConfig, params: dict, tokens_BT, positions_BT=None, cache=None):
    """Functional forward: logits (and cache) from a pure params dict."""
    graphdef, template, _ = abstract_model(cfg)
    return merge_model(graphdef, template, params)(tokens_BT, positions_BT, cache)


def forward_with_aux(cfg: ModelConfig, params: dict, tokens_BT):
    """(logits, aux) from a pure params dict; aux holds MoE losses and metrics."""
    graphdef, template, _ = abstract_model(cfg)
    return merge_model(graphdef, template, params).logits_and_aux(tokens_BT)


def inference_params(cfg: ModelConfig, params: dict) -> dict:
    """Parameters for decoding: every matrix cast once to the compute dtype.

    The forward pass casts each weight matrix to `cfg.dtype` where it uses it, so inside a
    decode loop that cast (a read of the fp32 matrix and a write of its copy) would repeat
    for every token. Casting once before the loop gives bitwise the same logits. Vectors
    (norm scales) and MoE routers stay fp32, as the model computes with them in fp32.
    """
    dt = DTYPES[cfg.dtype]

    def cast(path, w, axes):
        router = any("router" in str(getattr(k, "key", "")) for k in path)
        matrix = len([a for a in axes if a != "layers"]) >= 2  # per layer, as the model sees it
        return w.astype(dt) if matrix and not router else w

    return jax.tree_util.tree_map_with_path(cast, params, logical_axes(cfg),
                                            is_leaf=lambda x: isinstance(x, tuple))


def logical_axes(cfg: ModelConfig) -> dict:
    """Logical axis names of every parameter, as a pure dict matching `init_params`."""
    return abstract_model(cfg)[2]
