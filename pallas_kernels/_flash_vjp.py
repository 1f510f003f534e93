"""The custom VJP that both FlashAttention implementations share (Triton in
`flash_attention_triton.py`, Mosaic GPU in `flash_attention_mgpu.py`): pad the sequences to
whole tiles, run the forward kernel, keep O(seq) residuals (inputs, output, one fp32 LSE per
query row), and in the backward compute delta = rowsum(dO · O) and run the gradient kernels
on the padded inputs. Only the kernels and how segment ids are padded differ.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def pad_seq(x, length: int, value=0):
    """x [B, T, ...] padded with `value` to `length` on axis 1 (None stays None)."""
    if x is None or x.shape[1] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    return jnp.pad(x, widths, constant_values=value)


def make_flash(pad_inputs, forward, backward):
    """A jitted f(cfg, q, k, v, qoff, q_seg, kv_seg) -> O with a custom VJP (cfg static: it
    has q_len, kv_len, q_pad). pad_inputs(cfg, q, k, v, q_seg, kv_seg) -> the five padded;
    forward(cfg, q, k, v, qoff, q_seg, kv_seg) -> (O, LSE) on padded inputs;
    backward(cfg, q, k, v, qoff, q_seg, kv_seg, lse, do, delta, o) -> (dq, dk, dv), padded,
    where delta() computes rowsum(dO * O) [B, N, q_pad] in XLA and o is the padded output (a
    backward may compute delta in its own kernel from it instead)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def flash(cfg, q, k, v, qoff, q_seg, kv_seg):
        return flash_fwd(cfg, q, k, v, qoff, q_seg, kv_seg)[0]

    def flash_fwd(cfg, q, k, v, qoff, q_seg, kv_seg):
        qp, kp, vp, qsp, kvsp = pad_inputs(cfg, q, k, v, q_seg, kv_seg)
        o, lse = forward(cfg, qp, kp, vp, qoff, qsp, kvsp)
        o = o[:, : cfg.q_len]
        # Residuals are O(seq): the inputs, the output and one fp32 LSE per query row.
        return o, (q, k, v, qoff, q_seg, kv_seg, o, lse)

    def flash_bwd(cfg, res, do):
        q, k, v, qoff, q_seg, kv_seg, o, lse = res
        def delta():
            # delta_i = sum_h dO_ih O_ih = sum_j P_ij dP_ij: the row term of the softmax Jacobian.
            d = jnp.einsum("btnh,btnh->bnt", o.astype(jnp.float32), do.astype(jnp.float32))
            return jnp.pad(d, ((0, 0), (0, 0), (0, cfg.q_pad - cfg.q_len)))

        qp, kp, vp, qsp, kvsp = pad_inputs(cfg, q, k, v, q_seg, kv_seg)
        # Padded query rows get dO = 0 and delta = 0, so they add nothing to dK and dV.
        dop = pad_seq(do.astype(q.dtype), cfg.q_pad)
        dq, dk, dv = backward(cfg, qp, kp, vp, qoff, qsp, kvsp, lse, dop, delta, pad_seq(o, cfg.q_pad))
        return dq[:, : cfg.q_len], dk[:, : cfg.kv_len], dv[:, : cfg.kv_len], None, None, None

    flash.defvjp(flash_fwd, flash_bwd)
    return jax.jit(flash, static_argnums=(0,))
