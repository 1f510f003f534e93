"""The model's ops for a jitted step over a mesh (the annotated SPMD form, plus two collectives).

Most of a data / tensor / sequence / ZeRO-parallel step needs nothing but the sharding
annotations of `gendist.models.ops.Ops`. Two layers need their collectives said:

* the loss: logits stay split over the vocabulary on `tensor` (Megatron's
  vocabulary-parallel cross-entropy, `tensor.vocab_parallel_nll`);
* the MoE layer with more than one batch shard: GShard's two all-to-alls over `expert`
  (`expert.moe_ffn_sharded`), one routing group per batch shard.
"""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import Mesh

from gendist.config import ModelConfig
from gendist.models import moe as moe_lib
from gendist.models.ops import Ops
from gendist.parallel.expert import moe_ffn_sharded
from gendist.parallel.tensor import vocab_parallel_nll
from gendist.sharding import BATCH_AXES, DEFAULT_RULES, Rules, mesh_axes_of


@dataclasses.dataclass(frozen=True, eq=False)
class MeshOps(Ops):
    """`Ops` with the vocabulary-parallel loss and the expert-parallel MoE on `mesh`."""

    mesh: Mesh
    rules: Rules = DEFAULT_RULES

    def __hash__(self):
        return hash((type(self), id(self.mesh), self.rules))

    def __eq__(self, other):
        return (type(self) is type(other) and self.mesh is other.mesh
                and self.rules == other.rules)

    def nll(self, logits_BTV, targets_BT):
        return vocab_parallel_nll(logits_BTV, targets_BT, self.mesh, self.rules)

    def moe(self, p_moe, h_BTD, cfg: ModelConfig, fp8=None):
        if math.prod(self.mesh.shape[a] for a in BATCH_AXES) == 1:
            return moe_lib.moe_ffn(p_moe, h_BTD, cfg, fp8=fp8)
        tensor = mesh_axes_of("mlp", self.rules)
        tensor = tensor[0] if tensor and self.mesh.shape[tensor[0]] > 1 else None
        return moe_ffn_sharded(p_moe, h_BTD, cfg, self.mesh, tensor_axis=tensor, fp8=fp8)
