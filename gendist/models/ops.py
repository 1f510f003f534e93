"""How the model's math meets the mesh: the few operations that differ between parallel forms.

The transformer (`transformer.py`) is written once. Where a parallel form needs something
other than plain math - Megatron's f and g around the tensor-parallel matmuls, the
just-in-time gather of ZeRO-3 weights, a vocabulary-parallel lookup and loss, an
expert-parallel MoE layer - the model calls a method of an `Ops` object instead:

    enter(h)            Megatron f: the input of column-parallel matmuls
    leave(y)            Megatron g: the partial sums of row-parallel matmuls
    column(h, ws, fp8)  f, then the column-parallel matmuls h @ w (q/k/v, MLP up/gate)
    row(a, w, dims, fp8) a row-parallel matmul (wo, MLP down), then g
                        (fp8: the products' scaling state, `models.fp8`; None = plain dots)
    constrain(x, names) a layout hint by logical axis names
    weights(p, axes)    one layer's weights as its matmuls use them (dtype, gather)
    embed(table, tok)   the token lookup
    logits(h, w_DV)     the output layer, fp32
    nll(logits, tgt)    per-token negative log-likelihood
    moe(p, h, fp8)      the MoE FFN of one block (fp8: its experts' products' state)

`Ops` here is the annotated SPMD form: under `sharding.use_mesh` the constraints place the
arrays by the one logical-axis table and XLA inserts the collectives; outside a mesh they
are no-ops, so it is also the single-device model and the decode path. The explicit
per-device form (every collective written out, for `shard_map` bodies such as pipeline
stages) and the expert-parallel MoE live in `gendist.parallel`, which subclasses this.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gendist.config import ModelConfig
from gendist.models import fp8 as fp8_lib
from gendist.models import moe as moe_lib
from gendist.sharding import column_input, compute_layout, constrain, row_output


class Ops:
    """The annotated SPMD form (see the module docstring); stateless, so hashable."""

    def enter(self, h_BTD: jax.Array) -> jax.Array:
        return column_input(h_BTD)

    def leave(self, y_BTD: jax.Array) -> jax.Array:
        return row_output(y_BTD)

    def column(self, h_BTD: jax.Array, ws: tuple, fp8: tuple | None = None) -> tuple:
        """Megatron f, then h @ w for each w [D, ...] (the column-parallel matmuls that share
        one input). A form may fuse the two (`parallel.collective_matmul`). `fp8`: one
        `fp8.Fp8Meta` a product (FP8 products), or None."""
        h_BTD = self.enter(h_BTD)
        if fp8 is not None:
            return tuple(fp8_lib.dot(h_BTD, w, m) for w, m in zip(ws, fp8, strict=True))
        return tuple(jnp.tensordot(h_BTD, w.astype(h_BTD.dtype), axes=1) for w in ws)

    def row(self, a: jax.Array, w: jax.Array, dims: int, fp8=None) -> jax.Array:
        """A row-parallel matmul (a's last `dims` axes against w's first), then Megatron g."""
        if fp8 is not None:
            return self.leave(fp8_lib.dot(a, w, fp8, dims))
        return self.leave(jnp.tensordot(a, w.astype(a.dtype), axes=dims))

    def constrain(self, x: jax.Array, names) -> jax.Array:
        return constrain(x, names)

    def weights(self, p: dict, axes: dict, dtype) -> dict:
        return compute_layout(p, axes, dtype)

    def embed(self, table_VD: jax.Array, tokens_BT: jax.Array, dtype) -> jax.Array:
        x_BTD = jnp.take(table_VD, tokens_BT, axis=0).astype(dtype)
        # Vocab-parallel lookup: each shard's rows, summed over `tensor`, then sequence shards.
        x_BTD = constrain(x_BTD, ("batch", "seq", "embed"))
        return constrain(x_BTD, ("batch", "act_seq", "embed"))

    def logits(self, h_BTD: jax.Array, w_DV: jax.Array) -> jax.Array:
        h_BTD = self.enter(h_BTD)  # Megatron f before the vocab-parallel output layer
        logits_BTV = jnp.einsum("BTD,DV->BTV", h_BTD, w_DV.astype(h_BTD.dtype),
                                preferred_element_type=jnp.float32)
        return self.constrain(logits_BTV, ("batch", "seq", "vocab"))

    def nll(self, logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
        logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]

    def moe(self, p_moe: dict, h_BTD: jax.Array, cfg: ModelConfig, fp8: tuple | None = None):
        return moe_lib.moe_ffn(p_moe, h_BTD, cfg, fp8=fp8)

    def __hash__(self):
        return hash(type(self))

    def __eq__(self, other):
        return type(self) is type(other)


DEFAULT_OPS = Ops()
