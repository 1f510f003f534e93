"""Version-stable names for the shard_map API (jax 0.11.2 on the GPU image, newest here).

`jax.shard_map` (with `check_vma`) replaced `jax.experimental.shard_map.shard_map` (with
`check_rep`); `lax.pcast(x, axis, to="varying")` replaced `lax.pvary`. Callers import from
here and never spell either version.
"""

from __future__ import annotations

import jax

try:  # jax >= 0.7: the stable name, keyword check_vma
    from jax import shard_map as _shard_map

    _CHECK_KW = "check_vma"
except ImportError:  # pragma: no cover - depends on the installed jax
    from jax.experimental.shard_map import shard_map as _shard_map

    _CHECK_KW = "check_rep"


def shard_map(f, *, mesh, in_specs, out_specs, check: bool = True):
    """`shard_map` with the replication/varying-axes check switched by one keyword.

    `check=True` (the default) lets JAX type every value as invariant or varying over each
    mesh axis, which is what makes reverse-mode AD through collectives exact; the explicit
    tensor-parallel code relies on it.
    """
    return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                      **{_CHECK_KW: check})


def shard_map_manual(f, *, mesh, in_specs, out_specs, axis_names: frozenset[str]):
    """`shard_map` manual over `axis_names` only (the other axes stay with the compiler),
    with the varying-axes check off: the pipeline executors move values between stages
    with ppermute and pick branches per stage, and reduce gradients explicitly."""
    return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                      axis_names=frozenset(axis_names), **{_CHECK_KW: False})


def to_varying(x, axis_name):
    """Mark an axis-invariant value as varying over `axis_name` (identity on the values).

    Its transpose is a psum over the axis: this is Megatron's `f` operator, in JAX's types.
    """
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axis_name, to="varying")
    if hasattr(jax.lax, "pvary"):  # pragma: no cover - jax < 0.8
        return jax.lax.pvary(x, axis_name)
    return x  # pragma: no cover - pre-vma jax: nothing to mark
