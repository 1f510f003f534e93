"""The one jitted function evaluation runs: each row's summed next-token cross-entropy over
the positions a mask keeps, the model placed on the mesh by the logical-axis table.

The per-token loss is the training loss's own (`gendist.training.gradients.loss_and_metrics`):
the forward `transformer.forward_with_aux` and `ops.nll` under `MeshOps` (the vocabulary-
parallel cross-entropy when the vocabulary is split over `tensor`), so the mean over a batch
with every position kept is the training loss. Rows are split over the mesh's batch axes
(`data`, `expert`); the weights stay whole on `data` (ZeRO stage 0) and split on `tensor`.
Row counts are padded to a multiple of `batch_size` (itself a multiple of the batch shards)
and lengths to one of `bucket_lengths` by the callers, so the number of compiles stays small.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from gendist.config import ModelConfig
from gendist.data.batches import process_rows, shard_batch
from gendist.models import transformer
from gendist.parallel import zero
from gendist.parallel.mesh_ops import MeshOps
from gendist.sharding import BATCH_AXES, DEFAULT_RULES, check_divisible, named_sharding, use_mesh


def token_nll(cfg: ModelConfig, params, inputs_BT, targets_BT, ops):
    """Per-token next-token cross-entropy [B, T] in fp32 nats: the training loss before its
    mean (MoE router losses are not part of it, as in validation)."""
    logits_BTV, _ = transformer.forward_with_aux(cfg, params, inputs_BT, ops)
    return ops.nll(logits_BTV, targets_BT)


def bucket_lengths(max_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Padded lengths: powers of two from `smallest` below max_len, then max_len."""
    out = []
    n = smallest
    while n < max_len:
        out.append(n)
        n *= 2
    return (*out, max_len)


def bucket(length: int, lengths: tuple[int, ...]) -> int:
    for n in lengths:
        if n >= length:
            return n
    raise ValueError(f"a sequence of {length} tokens is longer than the longest bucket "
                     f"{lengths[-1]}")


@dataclasses.dataclass
class Scorer:
    """The model on a mesh and its jitted masked loss. `row_nll(inputs_NT, targets_NT,
    mask_NT)` (host arrays, any N) returns each row's summed loss over the kept positions
    (float64 on the host)."""

    cfg: ModelConfig
    mesh: jax.sharding.Mesh
    params: dict
    batch_size: int
    fn: object
    traces: dict

    @property
    def shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in BATCH_AXES)

    def row_nll(self, inputs_NT, targets_NT, mask_NT, progress=None) -> np.ndarray:
        n = len(inputs_NT)
        out = np.zeros((n,), np.float64)
        B = self.batch_size
        rows = process_rows(self.mesh, B)
        for lo in range(0, n, B):
            hi = min(lo + B, n)
            batch = {}
            for k, a in (("inputs", inputs_NT), ("targets", targets_NT), ("mask", mask_NT)):
                full = np.zeros((B, a.shape[1]), np.float32 if k == "mask" else np.int32)
                full[: hi - lo] = a[lo:hi]
                batch[k] = full[rows]
            placed = shard_batch(batch, self.mesh, B)
            sums = self.fn(self.params, placed["inputs"], placed["targets"], placed["mask"])
            out[lo:hi] = np.asarray(sums.addressable_data(0), np.float64)[: hi - lo]
            if progress is not None:
                progress.update(hi - lo)
        return out


def make_scorer(cfg: ModelConfig, params, mesh, batch_size: int = 16) -> Scorer:
    """Place `params` (host or device arrays) on `mesh` and jit the masked loss.
    `batch_size` is rounded up to a multiple of the mesh's batch shards."""
    if mesh.shape["pipeline"] > 1:
        raise ValueError(f"mesh.pipeline={mesh.shape['pipeline']}: evaluation runs the whole "
                         "model on each data shard; pass --mesh.pipeline 1 (and --mesh.data / "
                         "--mesh.tensor for the devices).")
    check_divisible(mesh, model__num_heads=(cfg.num_heads, "heads"),
                    model__num_kv_heads=(cfg.num_kv_heads, "kv_heads"),
                    model__d_ff=(cfg.d_ff, "mlp"), model__vocab_size=(cfg.vocab_size, "vocab"))
    rules = DEFAULT_RULES
    shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
    batch_size = -(-max(batch_size, 1) // shards) * shards
    p_sh = zero.param_shardings(mesh, transformer.logical_axes(cfg),
                                transformer.param_shapes(cfg), 0, rules)
    params = jax.tree.map(_place, params, p_sh)
    rows_sh = named_sharding(mesh, ("batch", "seq"), rules)
    ops = MeshOps(mesh, rules)
    traces = {"score": 0}

    def masked_row_sums(params, inputs_BT, targets_BT, mask_BT):
        traces["score"] += 1
        with use_mesh(mesh, rules):
            nll_BT = token_nll(cfg, params, inputs_BT, targets_BT, ops)
            return jnp.sum(nll_BT * mask_BT, axis=1)

    fn = jax.jit(masked_row_sums, in_shardings=(p_sh, rows_sh, rows_sh, rows_sh),
                 out_shardings=NamedSharding(mesh, PartitionSpec()))
    return Scorer(cfg, mesh, params, batch_size, fn, traces)


def _place(x, sharding):
    """A host array placed on `sharding` (each process writing its own devices' slices)."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if isinstance(x, jax.Array) and x.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
