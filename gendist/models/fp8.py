"""FP8 matrix products with per-tensor scaling (Micikevicius et al. 2022, arXiv:2209.05433).

A product x @ w runs as quantize -> dot -> scale: both operands are scaled into float8 E4M3
(3 mantissa bits, max 448), the gradient flowing back into the product into E5M2 (2 mantissa
bits, max 57344: the wider range that gradients need), and each of the three GEMMs (forward,
dx, dw) is a dot_general of two float8 tensors whose result is multiplied by the two scales.
That is the form XLA's GEMM rewriter turns into one cuBLASLt FP8 GEMM on Hopper/Ada (its
"native FP8" pattern; flax's `fp8_ops` also hands float8 operands to the dot); on a CPU it is
the exact emulation, the products of the rounded values computed wider.

Those GEMMs take both operands with the contracted axis minor, so each is written as
[M, K] . [N, K] of float8 matrices: the forward transposes the quantized weight, the
backward keeps the quantized input transposed and transposes the quantized gradient for dw.
`Fp8Meta.transpose` says who moves them: "xla" (`x.T`, which XLA compiles to its own
transpose kernels, slow for one-byte elements) or "pallas" (`pallas_kernels.transpose`, on
one GPU: 3.4-5.3% of the step, `benchmarks/training.md`). Both give the same bits.

A product may share leading batch axes between its operands (an MoE layer's experts,
[E, C, D] . [E, D, F]: one scale per tensor, all experts). Each product keeps an amax history
`hist_3H` (rows: input x, weight w, gradient g; column 0
the newest step). Two recipes choose the scale:

    delayed   Transformer Engine's recipe: scale = max(history) / fp8_max * 2**margin, the
              history holding earlier steps only, so quantizing does not wait for this
              tensor's amax: XLA reads the tensor once for both (one multi-output fusion).
              An empty history (a fresh run's first step) scales by 1, as Transformer
              Engine's scales start; that step's amaxes fill the history
    current   scale = amax(this tensor) / fp8_max * 2**margin: a reduction over the tensor
              before it is quantized, a second read of it

Either way every product observes its three amaxes. They leave the step as the cotangent of
`hist_3H` (the only way a backward pass can hand out a value, as in flax's fp8 meta), shaped
like the history with the new amax in column 0 and zeros elsewhere; `roll` makes the next
history from them. Reductions are global (jit's SPMD semantics), so a sharded step sees the
amaxes one device would.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import transpose as transpose_kernel

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
RECIPES = ("delayed", "current")
STATE_KEY = "fp8"  # where a stack of dense blocks holds its products' histories
HISTORY_AXES = ("layers", None, None, None)  # the histories' logical axes [L, P, x|w|g, H]


def is_history(path) -> bool:
    """Whether a pytree key path leads into the FP8 histories (their gradients are observed
    amaxes: they combine by max, not by sum)."""
    return any(getattr(k, "key", None) == STATE_KEY for k in path)


def accumulate(acc, tree):
    """acc + tree leaf by leaf, in acc's dtype, but max where the leaf is an FP8 history's
    observed amaxes (over microbatches the amax of the whole batch is their max)."""
    def one(path, a, b):
        b = b.astype(a.dtype)
        return jnp.maximum(a, b) if is_history(path) else a + b
    return jax.tree_util.tree_map_with_path(one, acc, tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Products:
    """One layer's (or a stack's) amax histories [..., P, 3, H] and how to use them."""

    hist: jax.Array
    recipe: str = dataclasses.field(default="delayed", metadata=dict(static=True))
    margin: int = dataclasses.field(default=0, metadata=dict(static=True))
    transpose: str = dataclasses.field(default="xla", metadata=dict(static=True))

    def product(self, i: int) -> Fp8Meta:
        return Fp8Meta(self.hist[i], self.recipe, self.margin, self.transpose)


@dataclasses.dataclass(frozen=True)
class Fp8Meta:
    """One product's history [3, H] and recipe."""

    hist_3H: jax.Array
    recipe: str
    margin: int
    transpose: str = "xla"  # the GEMM operands' float8 transposes: "xla" or "pallas" (kernel)


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


def amax(x):
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _scale(hist_H, current_amax, fp8_dtype, recipe: str, margin: int):
    if recipe == "current":
        return scale_for(current_amax, fp8_dtype, margin)
    return scale_for(jnp.max(hist_H), fp8_dtype, margin)  # 1 while the history is empty


def scaled_dot(a_q, b_q, contract: tuple, scale, dtype, batch: int = 0):
    """dot_general of two float8 tensors (their first `batch` axes shared batch axes),
    accumulated by the GEMM and written in `dtype`, times the product of their scales: the
    form XLA on Hopper/Ada lowers to one FP8 GEMM (cuBLASLt's, or a Triton GEMM fusion) with
    the scale folded into its epilogue (float8 operands straight into the dot; a dequantize
    in between would leave a bf16 GEMM). On a CPU the same product of the rounded values,
    computed wider."""
    b = tuple(range(batch))
    y = jax.lax.dot_general(a_q, b_q, (contract, (b, b)), preferred_element_type=dtype)
    return y * scale.astype(dtype)


def _contractions(x_ndim: int, w_ndim: int, dims: int, batch: int = 0):
    """The three products of y = x . w over x's last / w's first `dims` axes after `batch`
    shared leading axes, as dot_general contracting axes: forward, dx = g . w (over w's
    output axes), dw = x . g (over x's leading axes). dot_general puts the batch axes first,
    then the left operand's free axes, then the right's: y, dx and dw come out in x's, x's
    and w's layouts."""
    lead, out = x_ndim - dims, w_ndim - dims  # g has lead + out - batch axes
    fwd = (tuple(range(lead, x_ndim)), tuple(range(batch, batch + dims)))
    dx = (tuple(range(lead, lead + out - batch)), tuple(range(batch + dims, w_ndim)))
    dw = (tuple(range(batch, lead)), tuple(range(batch, lead)))
    return fwd, dx, dw


def _transpose(x_MN, how: str):
    """The transpose of a float8 matrix that a GEMM takes with its contracted axis minor:
    `how` = "pallas" through the tiled kernel (`pallas_kernels.transpose`; XLA's own
    transposes of one-byte elements run far below bandwidth), "xla" as `x.T`."""
    if how == "pallas" and transpose_kernel.block_for(x_MN.shape) is not None:
        return transpose_kernel.transpose(x_MN)
    return x_MN.T


def _nt(a_MK, b_NK, scale, dtype):
    """a [M, K] . b [N, K]^T, both operands with the contracted axis minor: the layout
    cuBLASLt's FP8 GEMMs take, so XLA adds no transpose of its own."""
    return scaled_dot(a_MK, b_NK, ((1,), (1,)), scale, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _dot(x, w, hist_3H, dims: int, recipe: str, margin: int, batch: int, how: str):
    return _dot_fwd(x, w, hist_3H, dims, recipe, margin, batch, how)[0]


def _dot_fwd(x, w, hist_3H, dims, recipe, margin, batch, how):
    ax, aw = amax(x), amax(w)
    sx = _scale(hist_3H[0], ax, E4M3, recipe, margin)
    sw = _scale(hist_3H[1], aw, E4M3, recipe, margin)
    xq, wq = quantize(x, E4M3, sx), quantize(w, E4M3, sw)
    if batch:  # an MoE layer's experts: batched dot_generals, XLA lays their operands out
        fwd, _, _ = _contractions(x.ndim, w.ndim, dims, batch)
        y = scaled_dot(xq, wq, fwd, sx * sw, x.dtype, batch)
        return y, (xq, wq, sx, sw, ax, aw, hist_3H)
    # As matrices x [M, K] . w [K, N], each GEMM's operands transposed here to K-minor.
    lead, out = x.shape[:x.ndim - dims], w.shape[dims:]
    K = math.prod(w.shape[:dims])
    xq_MK, wq_KN = xq.reshape(-1, K), wq.reshape(K, -1)
    y = _nt(xq_MK, _transpose(wq_KN, how), sx * sw, x.dtype).reshape(*lead, *out)
    # The float8 operands are what the backward pass keeps (half the bytes of bf16 ones):
    # x as dw's GEMM takes it, w as it is (dx's GEMM contracts its minor axes).
    return y, (_transpose(xq_MK, how), wq, sx, sw, ax, aw, hist_3H)


def _dot_bwd(dims, recipe, margin, batch, how, res, g):
    xq, wq, sx, sw, ax, aw, hist_3H = res
    ag = amax(g)
    sg = _scale(hist_3H[2], ag, E5M2, recipe, margin)
    gq = quantize(g, E5M2, sg)
    observed = jnp.zeros_like(hist_3H).at[:, 0].set(jnp.stack([ax, aw, ag]))
    if batch:
        _, c_dx, c_dw = _contractions(xq.ndim, wq.ndim, dims, batch)
        dx = scaled_dot(gq, wq, c_dx, sg * sw, g.dtype, batch)
        dw = scaled_dot(xq, gq, c_dw, sx * sg, g.dtype, batch)
        return dx, dw, observed
    xqT_KM, w_in = xq, wq.shape[:dims]
    K, N = math.prod(w_in), math.prod(wq.shape[dims:])
    gq_MN = gq.reshape(-1, N)
    dx = _nt(gq_MN, wq.reshape(K, N), sg * sw, g.dtype)  # [M, K]
    dw = _nt(xqT_KM, _transpose(gq_MN, how), sx * sg, g.dtype)  # [K, N]
    lead = g.shape[:g.ndim - (wq.ndim - dims)]
    return dx.reshape(*lead, *w_in), dw.reshape(wq.shape), observed


_dot.defvjp(_dot_fwd, _dot_bwd)


def dot(x, w, meta: Fp8Meta, dims: int = 1, batch: int = 0):
    """x's last `dims` axes against w's first after `batch` shared leading axes (an MoE
    layer's experts: x [E, C, D] . w [E, D, F]), as an FP8 product: x and w in E4M3, the
    gradient of the result in E5M2, each at its per-tensor scale; the three GEMMs (forward,
    dx, dw) take float8 operands. The history's cotangent carries the amaxes of x, w and the
    gradient in column 0 (zeros elsewhere). Same shapes and dtype as
    `jnp.tensordot(x, w.astype(x.dtype), dims)` (batch 0) or the batched einsum."""
    x, w, hist = _same_varying_axes(x, w.astype(x.dtype), meta.hist_3H)
    return _dot(x, w, hist, dims, meta.recipe, meta.margin, batch, meta.transpose)


def _varying_axes(x) -> frozenset:
    """The manual axes `x` varies over (its type's `manual_axis_type.varying`; `vma` in
    jax < 0.12); empty outside a checked `shard_map`."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(t, "vma", ()))


def _same_varying_axes(*xs):
    """The operands varying over the same manual axes, as jax makes them for its own
    dot_general inside a `shard_map` that types values varying or invariant (elsewhere a
    no-op): each cast's transpose sums its operand's cotangent where it was invariant (a
    weight's gradient over the batch shards). A history that should be maxed there, not
    summed, arrives varying already (`parallel.expert.moe_ffn_sharded`)."""
    vmas = [_varying_axes(x) for x in xs]
    union = frozenset().union(*vmas)
    if not union:
        return xs
    cast = (functools.partial(jax.lax.pcast, to="varying") if hasattr(jax.lax, "pcast")
            else jax.lax.pvary)
    return tuple(x if v == union else cast(x, tuple(sorted(union - v)))
                 for x, v in zip(xs, vmas, strict=True))


def roll(hist, observed):
    """The next histories: each shifted one step older, the observed amax in column 0.
    `hist`, `observed`: [..., H] (observed is `dot`'s cotangent of the histories)."""
    return jnp.roll(hist, 1, axis=-1).at[..., 0].set(observed[..., 0])


def products(cfg, moe: bool = False) -> tuple[str, ...]:
    """The FP8 products of one dense block (`moe`: one MoE block, its experts' products
    batched over the experts), in the order the block runs them."""
    attn = ("qkv",) if cfg.fused_projections else ("q", "k", "v")
    if moe:
        up = ("expert_gate", "expert_up") if cfg.mlp == "swiglu" else ("expert_up",)
        return attn + ("o",) + up + ("expert_down",)
    if cfg.mlp != "swiglu":
        mlp = ("up",)
    else:
        mlp = ("gate_up",) if cfg.fused_projections else ("gate", "up")
    return attn + ("o",) + mlp + ("down",)


def init_history(cfg, layers: int, length: int, moe: bool = False) -> jax.Array:
    """Empty histories [L, P, 3, H] (zeros: a fresh run's first step scales by 1)."""
    return jnp.zeros((layers, len(products(cfg, moe)), 3, length), jnp.float32)


def product_flops_per_token(cfg) -> float:
    """Training FLOPs per token of the products that run in FP8 (every block's attention
    projections, the dense MLPs and the experts a token is routed to; forward + backward: 6
    per weight), out of `cfg.flops_per_token`."""
    D, H = cfg.d_model, cfg.head_dim
    attn = D * (cfg.num_heads + 2 * cfg.num_kv_heads) * H + cfg.num_heads * H * D
    mats = 3 if cfg.mlp == "swiglu" else 2
    dense = attn + D * cfg.d_ff * mats
    moe = attn + cfg.moe_top_k * D * cfg.moe_expert_d_ff * mats if cfg.num_moe_layers else 0
    return 6.0 * (dense * (cfg.num_layers - cfg.num_moe_layers) + moe * cfg.num_moe_layers)


def ideal_speedup(cfg, seq_len: int, peak_bf16: float, peak_fp8: float) -> float:
    """The step's speedup if every FLOP ran at its peak (FP8 products at the FP8 peak, the
    rest at bf16's): Amdahl's bound for what FP8 can give this model."""
    total = cfg.flops_per_token(seq_len)
    f8 = product_flops_per_token(cfg)
    return (total / peak_bf16) / (f8 / peak_fp8 + (total - f8) / peak_bf16)
