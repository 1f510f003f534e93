"""Checks of a training config against its mesh, before anything is built.

`validate_config(cfg, mesh)` raises a clear error (naming the field, or both fields of a
combination that does not compose, and the fix) for shapes the mesh or the model cannot
take; `batch_shards`, `pipeline_microbatches` and `pipedream_window` are the small
derivations it checks and that `train.build` uses.
"""

from __future__ import annotations

import math

import numpy as np

from gendist.config import Config, check_pipeline
from gendist.parallel import zero
from gendist.sharding import BATCH_AXES, check_divisible

ASYNC_SCHEDULES = {"pipedream": "stash", "pipedream-nostash": "nostash", "2bw": "2bw"}


def validate_config(cfg: Config, mesh) -> None:
    """Clear errors for shapes the mesh or the model cannot take, and for parallel forms
    that do not compose (naming both fields)."""
    m, t = cfg.model, cfg.train
    check_divisible(mesh, model__num_heads=(m.num_heads, "heads"),
                    model__num_kv_heads=(m.num_kv_heads, "kv_heads"),
                    model__d_ff=(m.d_ff, "mlp"), model__vocab_size=(m.vocab_size, "vocab"))
    if t.batch_size % t.grad_accum:
        raise ValueError(f"train.batch_size={t.batch_size} is not divisible by "
                         f"train.grad_accum={t.grad_accum}; make batch_size a multiple of it.")
    shards = batch_shards(mesh)
    if (t.batch_size // t.grad_accum) % shards:
        raise ValueError(
            f"train.batch_size={t.batch_size} (per microbatch {t.batch_size // t.grad_accum}) "
            f"is not divisible by the {shards} batch shards (mesh.data x mesh.expert); use a "
            f"batch size that is a multiple of {shards * t.grad_accum}.")
    zero.check_stage(t.zero_stage)
    tp = mesh.shape["tensor"]
    if cfg.mesh.sequence_parallel and t.seq_len % tp:
        raise ValueError(
            f"train.seq_len={t.seq_len} is not divisible by mesh.tensor={tp}, which "
            "mesh.sequence_parallel splits the sequence over; choose a multiple of it or "
            "turn sequence parallelism off.")
    if t.tp_comm == "collective":
        _validate_collective(cfg, mesh)
    if t.matmul_precision == "fp8":
        _validate_fp8(cfg, mesh)
    if t.lora_rank:
        _validate_lora(cfg, mesh)
    if t.objective == "dpo":
        _validate_dpo(cfg, mesh)
    if t.seq_len > m.max_seq_len:
        raise ValueError(f"train.seq_len={t.seq_len} is longer than model.max_seq_len="
                         f"{m.max_seq_len}; raise model.max_seq_len or shorten train.seq_len.")
    if mesh.shape["pipeline"] > 1:
        _validate_pipeline(cfg, mesh)
    elif t.terapipe_slices or t.pipeline_schedule in ASYNC_SCHEDULES:
        what = ("train.terapipe_slices" if t.terapipe_slices else
                f"train.pipeline_schedule={t.pipeline_schedule}")
        raise ValueError(f"{what} needs pipeline stages, but mesh.pipeline=1; set "
                         "--mesh.pipeline to 2 or more.")


def _validate_fp8(cfg: Config, mesh) -> None:
    """FP8 products: the plain engine (data, tensor, sequence, ZeRO, accumulation) and the
    synchronous pipeline schedules (delayed scaling), on devices with FP8 tensor cores
    (compute capability 8.9+) or a CPU's emulation."""
    what = "train.matmul_precision=fp8"
    t = cfg.train
    if mesh.shape["pipeline"] > 1:
        _refuse(bool(t.terapipe_slices), what, f"train.terapipe_slices={t.terapipe_slices}",
                "TeraPipe's engine does not carry the FP8 scaling state; use a synchronous "
                "schedule (--train.terapipe-slices 0) or --train.matmul-precision bf16.")
        _refuse(t.pipeline_schedule in ASYNC_SCHEDULES, what,
                f"train.pipeline_schedule={t.pipeline_schedule}", "PipeDream's stages update "
                "their own weights without the FP8 scaling state; use 1f1b or gpipe.")
        _refuse(t.fp8_recipe == "current", what, "train.fp8_recipe=current and mesh.pipeline="
                f"{mesh.shape['pipeline']}", "a stage sees only its shard of a tensor, so its "
                "own amax would give each device another scale; use --train.fp8-recipe delayed.")
    shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
    _refuse(t.fp8_recipe == "current" and bool(cfg.model.moe_experts) and shards > 1, what,
            f"train.fp8_recipe=current, model.moe_experts={cfg.model.moe_experts} and "
            f"{shards} batch shards", "the experts run per device, and a device's own amax "
            "would give each its own scale; use --train.fp8-recipe delayed.")
    _refuse(cfg.train.tp_comm == "collective", what, "train.tp_comm=collective",
            "the collective matmuls run bf16 products; use --train.tp-comm xla.")
    for d in mesh.devices.flat:
        cc = getattr(d, "compute_capability", None)
        if d.platform == "gpu" and cc is not None and tuple(map(int, str(cc).split("."))) < (8, 9):
            raise ValueError(f"{what}: {d.device_kind} (compute capability {cc}) has no FP8 "
                             "tensor cores (they start at 8.9: Ada, Hopper); use "
                             "--train.matmul-precision bf16.")


def _validate_lora(cfg: Config, mesh) -> None:
    """LoRA runs on the synchronous engines of a dense model, rank <= each adapted matrix's
    smaller side."""
    m, t = cfg.model, cfg.train
    what = f"train.lora_rank={t.lora_rank}"
    _refuse(t.pipeline_schedule in ASYNC_SCHEDULES and mesh.shape["pipeline"] > 1, what,
            f"train.pipeline_schedule={t.pipeline_schedule}", "PipeDream updates each stage's "
            "weights itself, not adapters; use a synchronous schedule (1f1b, gpipe).")
    _refuse(t.matmul_precision == "fp8", what, "train.matmul_precision=fp8",
            "the adapted projections run in the model dtype; use --train.matmul-precision bf16.")
    _refuse(bool(m.moe_experts), what, f"model.moe_experts={m.moe_experts}",
            "adapters go on dense models' projections here; use a dense model.")
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    sides = {"q": (m.d_model, q), "k": (m.d_model, kv), "v": (m.d_model, kv), "o": (q, m.d_model),
             "gate": (m.d_model, m.d_ff), "up": (m.d_model, m.d_ff), "down": (m.d_ff, m.d_model)}
    most = min(min(sides[x]) for x in t.lora_targets.split(","))
    if t.lora_rank > most:
        raise ValueError(f"{what} is larger than the smaller side ({most}) of an adapted "
                         f"projection (train.lora_targets={t.lora_targets}); pass "
                         f"--train.lora-rank {most} or less.")


def _validate_dpo(cfg: Config, mesh) -> None:
    """DPO's loss pairs rows of a batch: the plain engine, a dense model."""
    what = "train.objective=dpo"
    _refuse(mesh.shape["pipeline"] > 1, what, f"mesh.pipeline={mesh.shape['pipeline']}",
            "the pipeline engines compute the next-token loss per microbatch; use "
            "mesh.pipeline=1 (data, tensor and ZeRO compose with DPO).")
    _refuse(cfg.train.tp_comm == "collective", what, "train.tp_comm=collective",
            "use --train.tp-comm xla.")
    _refuse(bool(cfg.model.moe_experts), what, f"model.moe_experts={cfg.model.moe_experts}",
            "the router's losses have no place in the preference loss; use a dense model.")
    _refuse(cfg.train.matmul_precision == "fp8", what, "train.matmul_precision=fp8",
            "use --train.matmul-precision bf16.")


def _validate_collective(cfg: Config, mesh) -> None:
    """train.tp_comm='collective' rewrites sequence parallelism's collectives, one stage."""
    what = "train.tp_comm=collective"
    _refuse(mesh.shape["tensor"] < 2, what, f"mesh.tensor={mesh.shape['tensor']}",
            "collective matmuls split tensor-parallel matmuls; set --mesh.tensor 2 or more, "
            "or --train.tp-comm xla.")
    _refuse(not cfg.mesh.sequence_parallel, what, "mesh.sequence_parallel=False",
            "it overlaps sequence parallelism's all-gather and reduce-scatter with the "
            "matmuls; pass --mesh.sequence-parallel, or --train.tp-comm xla.")
    _refuse(mesh.shape["pipeline"] > 1, what, f"mesh.pipeline={mesh.shape['pipeline']}",
            "pipeline stages run the explicit f/g form without it; use mesh.pipeline=1 or "
            "--train.tp-comm xla.")


def _refuse(cond: bool, first: str, second: str, why: str) -> None:
    if cond:
        raise ValueError(f"{first} with {second}: {why}")


def _validate_pipeline(cfg: Config, mesh) -> None:
    m, t = cfg.model, cfg.train
    p = mesh.shape["pipeline"]
    check_pipeline(m, p, t.pipeline_stage_layers, t.pipeline_chunks)
    mb = pipeline_microbatches(cfg, mesh)
    if t.pipeline_chunks > 1 and mb % p:
        raise ValueError(
            f"train.pipeline_microbatches={mb} with train.pipeline_schedule=interleaved-1f1b: "
            f"the interleaved schedule runs microbatches in groups of mesh.pipeline={p} "
            f"(Megatron's rule); use a multiple of {p}.")
    per_step = t.batch_size // t.grad_accum
    if per_step % (batch_shards(mesh) * (1 if t.terapipe_slices else mb)):
        raise ValueError(
            f"train.pipeline_microbatches={mb}: train.batch_size={t.batch_size} (per "
            f"accumulation step {per_step}) over {batch_shards(mesh)} batch shards must split "
            f"into {mb} equal microbatches; use a batch size that is a multiple of "
            f"{batch_shards(mesh) * mb * t.grad_accum} or set --train.pipeline-microbatches.")
    if t.terapipe_slices:
        _refuse(t.terapipe_slices > t.seq_len, f"train.terapipe_slices={t.terapipe_slices}",
                f"train.seq_len={t.seq_len}", "use at most one slice per token.")
        _refuse(cfg.mesh.sequence_parallel, "train.terapipe_slices", "mesh.sequence_parallel",
                "TeraPipe cuts the sequence into slices itself; turn sequence parallelism off.")
        _refuse(bool(m.num_moe_layers), "train.terapipe_slices", "model.moe_experts",
                "TeraPipe runs dense models here; set model.moe_experts=0.")
        _refuse(bool(t.pipeline_stage_layers), "train.terapipe_slices",
                "train.pipeline_stage_layers", "TeraPipe takes an even split of the layers.")
    if t.pipeline_schedule in ASYNC_SCHEDULES:
        sched = f"train.pipeline_schedule={t.pipeline_schedule}"
        why = ("PipeDream's per-stage updates need {}; ")
        _refuse(m.tie_embeddings, sched, "model.tie_embeddings=True", why.format(
            "each weight on one stage, but a tied table lives on the first and last") +
            "pass --model.no-tie-embeddings.")
        _refuse(t.terapipe_slices > 0, sched, "train.terapipe_slices", "pick one of them.")
        _refuse(t.zero_stage > 0, sched, f"train.zero_stage={t.zero_stage}", why.format(
            "a stage's whole weights for its optimizer (and clip)") + "use zero_stage 0.")
        _refuse(mesh.shape["tensor"] > 1, sched, f"mesh.tensor={mesh.shape['tensor']}",
                why.format("a stage's whole weights for the per-stage clip") +
                "use mesh.tensor=1.")
        _refuse(bool(m.num_moe_layers), sched, "model.moe_experts",
                "not supported; use a synchronous schedule (gpipe or 1f1b).")
        _refuse(t.grad_accum > 1, sched, f"train.grad_accum={t.grad_accum}",
                "PipeDream updates per microbatch (2BW per window); use grad_accum=1.")
        _refuse(bool(t.pipeline_stage_layers), sched, "train.pipeline_stage_layers",
                "PipeDream takes an even split of the layers.")
        if ASYNC_SCHEDULES[t.pipeline_schedule] == "2bw" and mb % pipedream_window(cfg, mesh):
            raise ValueError(
                f"train.pipedream_window={pipedream_window(cfg, mesh)} must divide "
                f"train.pipeline_microbatches={mb} (2BW updates once per full window).")


def batch_shards(mesh) -> int:
    """How many shards a batch is split into on this mesh (the `batch` logical axis)."""
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def pipeline_microbatches(cfg: Config, mesh) -> int:
    """train.pipeline_microbatches, or twice the number of stages when it is 0."""
    return cfg.train.pipeline_microbatches or 2 * mesh.shape["pipeline"]


def pipedream_window(cfg: Config, mesh) -> int:
    """2BW's update window: train.pipedream_window, or max(1, stages - 1) when it is 0."""
    return cfg.train.pipedream_window or max(1, mesh.shape["pipeline"] - 1)
