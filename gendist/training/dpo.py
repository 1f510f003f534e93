"""DPO (Rafailov et al. 2023, arXiv:2305.18290): preference tuning against a frozen reference.

For a prompt x with a chosen answer y_c and a rejected one y_r,

    loss = -log σ(β [(log π(y_c|x) - log π_ref(y_c|x)) - (log π(y_r|x) - log π_ref(y_r|x))])

with log π(y|x) the sum of the response tokens' log-probabilities (prompt tokens masked),
averaged over the pairs of a batch. The reference is the initial model, frozen: with LoRA the
base with the adapters at zero (the state's `base`, no extra copy), else a copy of the
initial params (`state["reference"]`). Its log-probs are computed once per batch inside the
step, without gradients, before the policy's loss (`reference_fn`). The implicit rewards
β(log π - log π_ref) give the metrics: chosen and rejected rewards, their margin and the
fraction of pairs where the chosen one is ahead. Batches come from
`gendist.data.preferences` (pairs interleaved: row 2i chosen, 2i + 1 rejected).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gendist.config import Config
from gendist.models import transformer
from gendist.models.ops import DEFAULT_OPS, Ops

METRICS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")


def enabled(cfg: Config) -> bool:
    return cfg.train.objective == "dpo"


def sequence_logp(cfg: Config, params: dict, batch: dict, ops: Ops = DEFAULT_OPS):
    """[2B] summed log-probabilities of each row's masked (response) target tokens."""
    logits_BTV, _ = transformer.forward_with_aux(cfg.model, params, batch["inputs"], ops)
    nll_BT = ops.nll(logits_BTV, batch["targets"])
    return -jnp.sum(nll_BT * batch["mask"].astype(jnp.float32), axis=-1)


def loss_from_logps(logp_R, ref_logp_R, beta: float):
    """(mean DPO loss, metrics) from the policy's and reference's [2B] sequence log-probs
    (pairs interleaved)."""
    pol = logp_R.reshape(-1, 2)
    ref = ref_logp_R.reshape(-1, 2)
    chosen = beta * (pol[:, 0] - ref[:, 0])
    rejected = beta * (pol[:, 1] - ref[:, 1])
    z = chosen - rejected
    loss = -jnp.mean(jax.nn.log_sigmoid(z))
    return loss, {"reward_chosen": jnp.mean(chosen), "reward_rejected": jnp.mean(rejected),
                  "reward_margin": jnp.mean(z),
                  "reward_accuracy": jnp.mean((z > 0).astype(jnp.float32))}


def loss_and_metrics(cfg: Config, params: dict, batch: dict, ops: Ops = DEFAULT_OPS):
    """The DPO loss of the policy `params` on a batch that carries `ref_logp` [2B]."""
    logp = sequence_logp(cfg, params, batch, ops)
    return loss_from_logps(logp, batch["ref_logp"], cfg.train.dpo_beta)


def reference_params(state: dict) -> dict:
    """The frozen reference in a train state: LoRA's base, or the copy of the initial params."""
    return state["base"] if "base" in state else state["reference"]
