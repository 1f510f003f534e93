"""ModelConfig's parameter counts against the parameter tree the model really builds."""

import jax
import pytest

from gendist.config import ModelConfig
from gendist.models import transformer

VARIANTS = {
    "tiny": {},
    "moe 8 top-2 (the README's MoE line)": {"moe_experts": 8, "moe_top_k": 2},
    "moe gelu, wider experts, untied": {"moe_experts": 4, "moe_top_k": 1, "mlp": "gelu",
                                        "moe_d_ff": 512, "tie_embeddings": False},
    "gqa untied": {"num_kv_heads": 2, "tie_embeddings": False},
}


@pytest.mark.parametrize("kw", VARIANTS.values(), ids=VARIANTS.keys())
def test_num_params_is_the_size_of_the_parameter_tree(kw):
    m = ModelConfig(**kw)
    tree = jax.eval_shape(lambda: transformer.init_params(m, 0))
    assert m.num_params == sum(x.size for x in jax.tree.leaves(tree))


def test_moe_total_and_active_counts():
    m = ModelConfig(moe_experts=8, moe_top_k=2)
    assert m.num_params == 2_952_320
    dense = ModelConfig()
    mlp, router = 128 * 384 * 3, 128 * 8
    assert m.num_active_params == dense.num_params + 2 * (2 * mlp - mlp + router)
    assert m.params_text() == "2.95M params (1.18M active per token)"
    assert dense.num_active_params == dense.num_params and dense.params_text() == "0.89M params"
    # FLOPs count the experts a token uses, not all of them.
    assert m.flops_per_token(128) - dense.flops_per_token(128) == 6 * 2 * (mlp + router)
