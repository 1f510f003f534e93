"""The model's explicit per-device form: every collective written out, for `shard_map` bodies.

`gendist.models.ops.Ops` leaves the collectives to XLA (sharding annotations). Inside a
`shard_map` that is manual over every mesh axis - the pipeline stages, TeraPipe, PipeDream -
no partitioner runs (so custom-partitioned ops such as cuDNN attention work there), and the
model must say where data moves. `ManualOps` does, with the same block math:

    enter / leave   Megatron's f / g (`tensor.f_op`, `g_op`), or with sequence parallelism
                    `gather_seq` / `scatter_seq` (Korthikanti et al. 2022)
    column / row    with `collective=True` (sequence parallel only): the gather and the
                    column-parallel matmuls, and the row-parallel matmul and its
                    reduce-scatter, as collective matmuls (`collective_matmul`): rings of
                    ppermutes that overlap the partial products
    weights         matrices cast to the compute dtype, ZeRO-3 shards all-gathered just in
                    time (their gradient is the reduce-scatter, by transposition); under
                    sequence parallelism norm scales pass through f so that their partial
                    gradients (one per sequence shard) are summed over `tensor`
    embed / logits  vocabulary-parallel lookup and output layer (rows / columns of the
                    table on `tensor`); the loss reduces over `tensor` with `g_op`
    moe             the expert-parallel layer's per-device body (all-to-all over `expert`),
                    its partial sums over `tensor` completed by the block's g

Collectives are differentiated only through these custom-VJP operators (and all-gather /
all-to-all, whose transposes are exact), so the bodies may run without JAX's varying-axes
check. Router losses and metrics stay per routing group; the engines average them.

`tp_block_forward` runs one block this way under its own shard_map: the tests check it
against the annotated block in value and gradient.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from gendist.config import ModelConfig
from gendist.models import params as model_params
from gendist.models.ops import Ops
from gendist.models.transformer import block
from gendist.parallel import collective_matmul as cm
from gendist.parallel import tensor as tp
from gendist.parallel.compat import shard_map
from gendist.parallel.expert import moe_local
from gendist.sharding import BATCH_AXES, DEFAULT_RULES, SEQUENCE_PARALLEL, Rules, logical_to_spec


@dataclasses.dataclass(frozen=True)
class ManualOps(Ops):
    """The explicit per-device form of the model's mesh operations (module docstring)."""

    tensor: str | None = None  # Megatron's axis; None when tensor parallelism is off
    sequence_parallel: bool = False  # norms and residuals on sequence shards of `tensor`
    zero_axis: str | None = None  # ZeRO-3: block weights arrive split over this axis ...
    zero_dims: tuple[tuple[str, int], ...] = ()  # ... on these dims (name, per-layer dim)
    expert: str = "expert"  # the MoE all-to-all axis
    batch_axes: tuple[str, ...] = BATCH_AXES  # the axes tokens are split over
    collective: bool = False  # sequence-parallel matmuls as collective matmuls (ppermute rings)

    def __hash__(self):  # dataclass fields, not Ops' type-only hash
        return hash(dataclasses.astuple(self))

    def __eq__(self, other):
        return type(self) is type(other) and dataclasses.astuple(self) == dataclasses.astuple(
            other)

    def enter(self, h_BTD):
        if self.tensor is None:
            return h_BTD
        op = tp.gather_seq if self.sequence_parallel else tp.f_op
        return op(h_BTD, self.tensor)

    def leave(self, y_BTD):
        if self.tensor is None:
            return y_BTD
        op = tp.scatter_seq if self.sequence_parallel else tp.g_op
        return op(y_BTD, self.tensor)

    def _ring(self) -> bool:
        return self.collective and self.sequence_parallel and self.tensor is not None

    def column(self, h_BTD, ws, fp8=None):
        if not self._ring():
            return super().column(h_BTD, ws, fp8)
        assert fp8 is None, "collective matmuls run bf16 products (checks refuse FP8 here)"
        return cm.all_gather_matmul(h_BTD, ws, self.tensor, jax.lax.axis_size(self.tensor))

    def row(self, a, w, dims, fp8=None):
        if not self._ring():
            return super().row(a, w, dims, fp8)
        assert fp8 is None, "collective matmuls run bf16 products (checks refuse FP8 here)"
        return cm.matmul_reduce_scatter(a, w, dims, self.tensor, jax.lax.axis_size(self.tensor))

    def constrain(self, x, names):
        return x

    def weights(self, p: dict, axes: dict, dtype) -> dict:
        dims = dict(self.zero_dims)
        out = {}
        for k, w in p.items():
            if w.ndim >= 2:
                w = w.astype(dtype)
            if k in dims:
                w = jax.lax.all_gather(w, self.zero_axis, axis=dims[k], tiled=True)
            if self.sequence_parallel and self.tensor is not None and k.endswith("norm"):
                w = tp.f_op(w, self.tensor)
            out[k] = w
        return out

    def embed(self, table_VD, tokens_BT, dtype):
        if self.tensor is None:
            return jnp.take(table_VD, tokens_BT, axis=0).astype(dtype)
        v_loc = table_VD.shape[0]
        local_BT = tokens_BT - jax.lax.axis_index(self.tensor) * v_loc
        mine_BT = (local_BT >= 0) & (local_BT < v_loc)
        rows_BTD = jnp.take(table_VD, jnp.clip(local_BT, 0, v_loc - 1), axis=0)
        x_BTD = jnp.where(mine_BT[..., None], rows_BTD, 0).astype(dtype)
        return self.leave(x_BTD)  # the rows live on one shard each: sum (or scatter) them

    def nll(self, logits_BTV, targets_BT):
        if self.tensor is None:
            return super().nll(logits_BTV, targets_BT)
        return tp.local_vocab_nll(logits_BTV.astype(jnp.float32), targets_BT, self.tensor,
                                  psum=tp.g_op)

    def moe(self, p_moe, h_BTD, cfg: ModelConfig, fp8=None):
        return moe_local(p_moe, h_BTD, cfg, expert_axis=self.expert,
                         data_axes=self.batch_axes, tensor_axis=None, mean_aux=False, fp8=fp8)


def block_specs(cfg: ModelConfig, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> dict:
    """PartitionSpecs of one dense block's weights, from the logical-axis table."""
    return {k: logical_to_spec(s.axes, rules, mesh)
            for k, s in model_params.block_specs(cfg).items()}


def tp_block_forward(p: dict, x_BTD, pos_BT, cfg: ModelConfig, mesh: Mesh, *,
                     sequence_parallel: bool = False, collective: bool = False,
                     rules: Rules = DEFAULT_RULES):
    """`transformer.block` (dense, no cache) as one shard_map with explicit f and g.

    Weights are split as the table says (heads, kv_heads, mlp -> `tensor`); x is split over
    the batch axes, and with sequence parallelism also over the sequence on `tensor`
    (`collective`: its gathers and reduce-scatters as collective matmuls).
    """
    if sequence_parallel:
        rules = rules.with_overrides(**SEQUENCE_PARALLEL)
    axis = rules["heads"]
    size = mesh.shape[axis]
    for name, dim in (("model.num_heads", cfg.num_heads),
                      ("model.num_kv_heads", cfg.num_kv_heads), ("model.d_ff", cfg.d_ff)):
        if dim % size:
            raise ValueError(f"{name}={dim} is not divisible by mesh.tensor={size}; choose "
                             f"{name} divisible by {size} or a smaller mesh.tensor.")
    if sequence_parallel and x_BTD.shape[1] % size:
        raise ValueError(f"sequence length {x_BTD.shape[1]} is not divisible by mesh.tensor="
                         f"{size}; sequence parallelism needs train.seq_len divisible by it.")
    x_spec = logical_to_spec(("batch", "act_seq", "embed"), rules, mesh)
    pos_spec = logical_to_spec(("batch", "seq"), rules, mesh)
    ops = ManualOps(tensor=axis, sequence_parallel=sequence_parallel, collective=collective)
    body = lambda p, x, pos: block(p, x, pos, cfg, ops)[0]
    specs = block_specs(cfg, mesh, rules)
    fn = shard_map(body, mesh=mesh, in_specs=(specs, x_spec, pos_spec), out_specs=x_spec)
    return fn({k: p[k] for k in specs}, x_BTD, pos_BT)

