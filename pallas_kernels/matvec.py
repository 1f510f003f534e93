"""A decode step's matrix-vector products with the elementwise work before them fused in.

At batch 1 a decode step is bound by kernel count, not bytes: on an H200 a 350m step ran
229 kernels in 0.50 ms against a 0.19 ms bandwidth floor (`benchmarks/README.md`, issue
19). Two of a layer's ~9.5 kernels exist only to prepare the next product's input:

* the log-sum-exp merge of a split context's partial attention results (flash-decoding,
  `decode_attention`), before the output projection;
* SwiGLU, silu(gate) · up, before the down projection.

XLA fuses neither into the matrix-vector reduction after it. Here one kernel computes
y [B, O] = x [B, I] · W [O, I]ᵀ for an output-major weight (the decode layout's), with x
computed chunk by chunk from its inputs inside the kernel (the "prologue"):

* `matvec`: x given;
* `swiglu_matvec`: x = silu(g) · u from the gate|up projection's output [B, 2F];
* `merge_matvec`: x = the merged attention output from the per-split partials
  (`decode_attention.SplitAttention`), flattened over heads.

One row only (a batch-1 decode step: a product and a row sum per chunk, no tensor-core
tile). Grid: one program per `block_o` output features; each streams its [block_o, I] rows
of W in chunks of `block_i` (coalesced: I is W's minor axis) and recomputes the prologue
for each chunk (a few KB read from L2; every program needs the whole of x).

Rounding follows the unfused path: the prologue's result is cast to W's dtype before the
products (as XLA's SwiGLU and merge write bf16), products accumulate in fp32, y is cast
back.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._compat import next_pow2, plgpu, resolve_interpret, triton_params

_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # a padding split's max: exp2(_NEG - m) = 0


def parse_tiling(tag: str) -> dict:
    """Keyword arguments from a tag such as "o8_i512_w4_st3" (block_o, block_i, num_warps,
    num_stages; any subset, in any order; "" for the defaults)."""
    names = {"o": "block_o", "i": "block_i", "w": "num_warps", "st": "num_stages"}
    out = {}
    for part in filter(None, tag.split("_")):
        key = part.rstrip("0123456789")
        if key not in names or key == part:
            raise ValueError(f"matvec tiling {tag!r}: parts are o<N>, i<N>, w<N>, st<N> joined "
                             "by '_' (e.g. 'o8_i512_w4_st3')")
        out[names[key]] = int(part[len(key):])
    return out


def default_tiling(out_features: int, in_features: int) -> dict:
    """About one wave of an H200's 132 SMs: the fewest output rows per program (>= 8) that
    still give >= 128 programs, chunks of 512 inputs."""
    block_o = 8
    while out_features // (2 * block_o) >= 128:
        block_o *= 2
    return dict(block_o=block_o, block_i=min(512, next_pow2(in_features)), num_warps=4,
                num_stages=3)


def supports(rows: int, out_features: int, block_o: int | None = None) -> bool:
    """Whether the kernel takes this product: one row (a batch-1 decode step) and whole
    programs of output features."""
    block_o = block_o or default_tiling(out_features, 1)["block_o"]
    return rows == 1 and out_features % block_o == 0


def _plain(x_ref, i, live, dt):
    return plgpu.load(x_ref.at[0, i], mask=live, other=0).astype(jnp.float32)


def _swiglu(gu_ref, i, live, F, dt):
    """silu(g) · u in fp32, rounded once to dt: XLA computes the bf16 `jax.nn.silu(g) * u`
    as one fusion in fp32 (it allows excess precision) and writes it rounded."""
    g = plgpu.load(gu_ref.at[0, i], mask=live, other=0).astype(jnp.float32)
    u = plgpu.load(gu_ref.at[0, i + F], mask=live, other=0).astype(jnp.float32)
    return (g * jax.nn.sigmoid(g) * u).astype(dt).astype(jnp.float32)


def _merge(o_ref, m_ref, l_ref, i, live, geometry, dt):
    """The log-sum-exp merge (`paged_attention.merge_splits`) of the splits' partials at
    flat output indices i = head · H + h: o_ref [S, K·R·H], m_ref and l_ref [S, K·R] (R: a
    KV head's query rows, padded)."""
    group, padded_rows, head_dim = geometry
    splits = o_ref.shape[0]
    head = i // head_dim
    row = (head // group) * padded_rows + head % group  # [C]
    s = jnp.arange(next_pow2(splits), dtype=jnp.int32)[:, None]  # [S', 1]: Triton's
    mask = live[None, :] & (s < splits)  # power-of-two tiles; padding splits weigh 0
    m = plgpu.load(m_ref.at[s, row[None, :]], mask=mask, other=_NEG)  # [S', C]
    l = plgpu.load(l_ref.at[s, row[None, :]], mask=mask, other=0.0)
    o = plgpu.load(o_ref.at[s, (row * head_dim + i % head_dim)[None, :]], mask=mask, other=0.0)
    w = jnp.exp2(m - jnp.max(m, axis=0)[None, :])
    l_tot = jnp.sum(w * l, axis=0)
    inv = jnp.where(l_tot > 0, 1.0 / jnp.where(l_tot > 0, l_tot, 1.0), 0.0)
    return (jnp.sum(w * o, axis=0) * inv).astype(dt).astype(jnp.float32)


def _kernel(*refs, prologue, n_in, in_features, block_o, block_i):
    x_refs, w_ref, y_ref = refs[:n_in], refs[n_in], refs[n_in + 1]
    c = jnp.arange(block_i, dtype=jnp.int32)

    def body(step, acc):
        i = step * block_i + c
        live = i < in_features
        x = prologue(*x_refs, i, live)  # [C] fp32, 0 outside
        w = plgpu.load(w_ref.at[:, pl.ds(step * block_i, block_i)],
                       mask=jnp.broadcast_to(live[None, :], (block_o, block_i)), other=0)
        return acc + jnp.sum(w.astype(jnp.float32) * x[None, :], axis=1)

    acc = jax.lax.fori_loop(0, pl.cdiv(in_features, block_i), body,
                            jnp.zeros((block_o,), jnp.float32))
    y_ref[...] = acc[None, :].astype(y_ref.dtype)


def _call(prologue, inputs, w_OI, B, in_features, name, block_o=None, block_i=None,
          num_warps=None, num_stages=None, interpret=None):
    O, I = w_OI.shape
    if I != in_features:
        raise ValueError(f"{name}: weight {w_OI.shape} must be [out, in] with in = {in_features} "
                         "(the decode layout's output-major matrix)")
    given = dict(block_o=block_o, block_i=block_i, num_warps=num_warps, num_stages=num_stages)
    t = {**default_tiling(O, I), **{k: v for k, v in given.items() if v is not None}}
    if not supports(B, O, t["block_o"]):
        raise ValueError(f"{name}: {B} rows x {O} outputs; the kernel takes one row and outputs "
                         f"a multiple of block_o={t['block_o']} (use XLA's product)")
    kernel = functools.partial(_kernel, prologue=prologue, n_in=len(inputs), in_features=I,
                               block_o=t["block_o"], block_i=t["block_i"])
    whole = [pl.BlockSpec(x.shape, lambda j, n=x.ndim: (0,) * n) for x in inputs]
    return pl.pallas_call(
        kernel, grid=(O // t["block_o"],),
        in_specs=[*whole, pl.BlockSpec((t["block_o"], I), lambda j: (j, 0))],
        out_specs=pl.BlockSpec((1, t["block_o"]), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((1, O), w_OI.dtype),
        interpret=resolve_interpret(interpret), name=f"{name}_o{t['block_o']}",
        compiler_params=triton_params(t["num_warps"], t["num_stages"]),
    )(*inputs, w_OI)


_TILING = ("block_o", "block_i", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_TILING)
def matvec(x_BI, w_OI, **tiling):
    """x [B, I] · W [O, I]ᵀ -> [B, O] in W's dtype (fp32 accumulation)."""
    B, I = x_BI.shape
    return _call(functools.partial(_plain, dt=w_OI.dtype), [x_BI], w_OI, B, I, "matvec",
                 **tiling)


@functools.partial(jax.jit, static_argnames=_TILING)
def swiglu_matvec(gu_BG, w_OF, **tiling):
    """(silu(g) · u) · W [O, F]ᵀ -> [B, O] for the gate|up output gu = [g | u] of [B, 2F]:
    the down projection of a SwiGLU MLP with its activation fused in."""
    B, G = gu_BG.shape
    if G % 2 or G // 2 != w_OF.shape[1]:
        raise ValueError(f"swiglu_matvec: gate|up {gu_BG.shape} must be [B, 2F] with F = "
                         f"{w_OF.shape[1]}, the down weight's input width")
    F = G // 2
    return _call(functools.partial(_swiglu, F=F, dt=w_OF.dtype), [gu_BG], w_OF, B, F,
                 "swiglu_matvec", **tiling)


@functools.partial(jax.jit, static_argnames=("group", *_TILING))
def merge_matvec(o_SBKRH, m_SBKR, l_SBKR, w_ON, *, group: int, **tiling):
    """merge(partials) · W [O, N·H]ᵀ -> [B, O]: the attention output projection with the
    split context's log-sum-exp merge fused in. o [S, B, K, R, H] fp32 unnormalised per
    split, m and l [S, B, K, R] (base-2 running max and sum); the first `group` of a KV
    head's R rows are its query heads (N = K · group)."""
    S, B, K, R, H = o_SBKRH.shape
    if m_SBKR.shape != (S, B, K, R) or l_SBKR.shape != (S, B, K, R) or group > R:
        raise ValueError(f"merge_matvec: partials o {o_SBKRH.shape}, m {m_SBKR.shape}, "
                         f"l {l_SBKR.shape} must be [S, B, K, R, H] and [S, B, K, R], group <= R")
    prologue = functools.partial(_merge, geometry=(group, R, H), dt=w_ON.dtype)
    if B != 1:
        raise ValueError(f"merge_matvec: batch {B}; the kernel takes one sequence (use "
                         "SplitAttention.merged and XLA's product)")
    inputs = [o_SBKRH.reshape(S, K * R * H), m_SBKR.reshape(S, K * R), l_SBKR.reshape(S, K * R)]
    return _call(prologue, inputs, w_ON, B, K * group * H, "merge_matvec", **tiling)
