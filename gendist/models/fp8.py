"""FP8 matrix products with per-tensor scaling (Micikevicius et al. 2022, arXiv:2209.05433).

A product x @ w runs as quantize -> dequantize -> dot: both operands are scaled into float8
E4M3 (3 mantissa bits, max 448), the gradient flowing back into the product into E5M2 (2
mantissa bits, max 57344: the wider range that gradients need). XLA on Hopper turns a dot
whose operands are `convert(f8) * scale` into one cuBLASLt FP8 GEMM with the scales folded in
(the "native XLA FP8" pattern that flax's `fp8_ops` also emits); on a CPU the same program is
the exact emulation: the products of the rounded values in bf16/fp32.

Each product keeps an amax history `hist_3H` (rows: input x, weight w, gradient g; column 0
the newest step). Two recipes choose the scale:

    delayed   Transformer Engine's recipe: scale = max(history) / fp8_max * 2**margin, the
              history holding earlier steps only (quantizing does not wait for a reduction);
              the first step, with an empty history, uses the current amax
    current   scale = amax(this tensor) / fp8_max * 2**margin

Either way every product observes its three amaxes. They leave the step as the cotangent of
`hist_3H` (the only way a backward pass can hand out a value, as in flax's fp8 meta), shaped
like the history with the new amax in column 0 and zeros elsewhere; `roll` makes the next
history from them. Reductions are global (jit's SPMD semantics), so a sharded step sees the
amaxes one device would.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
RECIPES = ("delayed", "current")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Products:
    """One layer's (or a stack's) amax histories [..., P, 3, H] and how to use them."""

    hist: jax.Array
    recipe: str = dataclasses.field(default="delayed", metadata=dict(static=True))
    margin: int = dataclasses.field(default=0, metadata=dict(static=True))

    def product(self, i: int) -> "Fp8Meta":
        return Fp8Meta(self.hist[i], self.recipe, self.margin)


@dataclasses.dataclass(frozen=True)
class Fp8Meta:
    """One product's history [3, H] and recipe."""

    hist_3H: jax.Array
    recipe: str
    margin: int


def fp8_max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def scale_for(amax, fp8_dtype, margin: int = 0):
    """The per-tensor scale s of x = s * q: amax / fp8_max * 2**margin (1 where amax is 0,
    so an all-zero tensor quantizes to zeros)."""
    amax = jnp.asarray(amax, jnp.float32)
    s = amax / fp8_max(fp8_dtype) * (2.0 ** margin)
    return jnp.where(amax > 0, s, 1.0)


def quantize(x, fp8_dtype, scale):
    """x / scale, clipped to the format's range, rounded to `fp8_dtype`."""
    m = fp8_max(fp8_dtype)
    y = x.astype(jnp.float32) / scale
    return jnp.clip(y, -m, m).astype(fp8_dtype)


def dequantize(q, dtype, scale):
    return q.astype(dtype) * scale.astype(dtype)


def qdq(x, fp8_dtype, scale):
    """x rounded through `fp8_dtype` at `scale`, in x's dtype.

    The optimization barrier keeps the FP8 value in the program: XLA on GPUs (with its
    default excess precision) otherwise folds convert(convert(x, f8), bf16) into one
    convert, which drops the rounding and leaves the GEMM in bf16. Through the barrier the
    dot's operand is still convert(f8) * scale, the pattern its FP8 GEMM rewrite takes."""
    q = jax.lax.optimization_barrier(quantize(x, fp8_dtype, scale))
    return dequantize(q, x.dtype, scale)


def amax(x):
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _scale(hist_H, current_amax, fp8_dtype, recipe: str, margin: int):
    if recipe == "current":
        return scale_for(current_amax, fp8_dtype, margin)
    past = jnp.max(hist_H)
    return scale_for(jnp.where(past > 0, past, current_amax), fp8_dtype, margin)


def _observed(hist_H, a):
    """The cotangent a history receives: the new amax in column 0, zeros elsewhere."""
    return jnp.zeros_like(hist_H).at[0].set(a.astype(hist_H.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def in_qdq(x, hist_H, fp8_dtype, recipe: str, margin: int):
    """Forward: x through `fp8_dtype`. Backward: the gradient passes straight through (the
    rounding's straight-through estimator) and hist_H's cotangent carries amax(x)."""
    return qdq(x, fp8_dtype, _scale(hist_H, amax(x), fp8_dtype, recipe, margin))


def _in_fwd(x, hist_H, fp8_dtype, recipe, margin):
    a = amax(x)
    return qdq(x, fp8_dtype, _scale(hist_H, a, fp8_dtype, recipe, margin)), (a, hist_H)


def _in_bwd(fp8_dtype, recipe, margin, res, g):
    a, hist_H = res
    return g, _observed(hist_H, a)


in_qdq.defvjp(_in_fwd, _in_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def out_qdq(y, hist_H, fp8_dtype, recipe: str, margin: int):
    """Forward: y unchanged. Backward: y's gradient through `fp8_dtype` (E5M2), and hist_H's
    cotangent carries the gradient's amax."""
    return y


def _out_fwd(y, hist_H, fp8_dtype, recipe, margin):
    return y, hist_H


def _out_bwd(fp8_dtype, recipe, margin, hist_H, g):
    a = amax(g)
    return qdq(g, fp8_dtype, _scale(hist_H, a, fp8_dtype, recipe, margin)), _observed(hist_H, a)


out_qdq.defvjp(_out_fwd, _out_bwd)


def dot(x, w, meta: Fp8Meta, dims: int = 1):
    """x's last `dims` axes against w's first, as an FP8 product: x and w in E4M3, the
    gradient of the result in E5M2, each at its per-tensor scale. Same shapes and dtype as
    `jnp.tensordot(x, w.astype(x.dtype), dims)`."""
    h = meta.hist_3H
    w = w.astype(x.dtype)
    xq = in_qdq(x, h[0], E4M3, meta.recipe, meta.margin)
    wq = in_qdq(w, h[1], E4M3, meta.recipe, meta.margin)
    y = jnp.tensordot(xq, wq, axes=dims)
    return out_qdq(y, h[2], E5M2, meta.recipe, meta.margin)


def roll(hist, observed):
    """The next histories: each shifted one step older, the observed amax in column 0.
    `hist`, `observed`: [..., H] (observed is `dot`'s cotangent of the histories)."""
    return jnp.roll(hist, 1, axis=-1).at[..., 0].set(observed[..., 0])


def products(cfg) -> tuple[str, ...]:
    """The FP8 products of one dense block, in the order the block runs them."""
    attn = ("qkv",) if cfg.fused_projections else ("q", "k", "v")
    if cfg.mlp != "swiglu":
        mlp = ("up",)
    else:
        mlp = ("gate_up",) if cfg.fused_projections else ("gate", "up")
    return attn + ("o",) + mlp + ("down",)


def init_history(cfg, layers: int, length: int) -> jax.Array:
    """Empty histories [L, P, 3, H] (zeros: the first step scales by the current amax)."""
    return jnp.zeros((layers, len(products(cfg)), 3, length), jnp.float32)


def product_flops_per_token(cfg) -> float:
    """Training FLOPs per token of the products that run in FP8 (the dense blocks'
    projections, forward + backward: 6 per weight), out of `cfg.flops_per_token`."""
    D, H = cfg.d_model, cfg.head_dim
    per_layer = D * (cfg.num_heads + 2 * cfg.num_kv_heads) * H + cfg.num_heads * H * D
    per_layer += D * cfg.d_ff * (3 if cfg.mlp == "swiglu" else 2)
    return 6.0 * per_layer * (cfg.num_layers - cfg.num_moe_layers)


def ideal_speedup(cfg, seq_len: int, peak_bf16: float, peak_fp8: float) -> float:
    """The step's speedup if every FLOP ran at its peak (FP8 products at the FP8 peak, the
    rest at bf16's): Amdahl's bound for what FP8 can give this model."""
    total = cfg.flops_per_token(seq_len)
    f8 = product_flops_per_token(cfg)
    return (total / peak_bf16) / (f8 / peak_fp8 + (total - f8) / peak_bf16)
