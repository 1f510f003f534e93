"""Small shims shared by the Pallas kernels so they run on jax 0.11.2 and on 0.12.

JAX 0.11 deprecates the Pallas Triton lowering but keeps it reachable through
`jax.experimental.pallas.triton.CompilerParams`; both versions expose the names used here.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax import lax

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as plgpu


def resolve_interpret(interpret: bool | None) -> bool:
    """`None` means: interpret on a host without a GPU, compile with Triton on a GPU."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


def triton_params(num_warps: int, num_stages: int):
    """Compiler parameters for the Triton lowering (ignored in interpret mode)."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def dividing_block(n: int, block: int, least: int = 16) -> int | None:
    """`block` halved (not below `least`) until it divides n; None if none does."""
    while block >= least and n % block:
        block //= 2
    return block if block >= least else None


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def precision_for(dtype) -> lax.Precision:
    """fp32 tiles need IEEE products (Triton would otherwise use TF32); bf16 uses the MMA."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def dot_f32(a, b, *, trans_b: bool = False, precision=lax.Precision.DEFAULT):
    """a @ b (or a @ b.T) on tiles, accumulated in fp32."""
    dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
