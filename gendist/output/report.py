"""The lines a training run prints first and last: what it runs on, where things go.

    header: model, devices, mesh, ZeRO stage, batch per device, steps, output paths
    footer: steps done, time and tokens/s, final losses, where the checkpoint, metrics and
            TensorBoard logs are
"""

from __future__ import annotations

import math
from pathlib import Path

import jax

from gendist.config import Config
from gendist.models.attention import resolve_backend
from gendist.training.checks import pipeline_microbatches


def loss_text(loss: float, vocab_size: int) -> str:
    """'2.0512 nats/byte (uniform 5.545)': the loss beside that of a uniform guess."""
    unit = "byte" if vocab_size == 256 else "token"
    return f"{loss:.4f} nats/{unit} (uniform {math.log(vocab_size):.3f})"


def val_text(cfg: Config, loss: float) -> str:
    """A validation loss as the objective reads it: nats per byte/token, or DPO's loss."""
    if cfg.train.objective == "dpo":
        return f"{loss:.4f} DPO loss (log 2 = 0.693 at the reference)"
    return loss_text(loss, cfg.model.vocab_size)


def _tuning_text(cfg: Config) -> str | None:
    """The LoRA / DPO line of the header, or None for plain training."""
    t, m = cfg.train, cfg.model
    parts = []
    if t.lora_rank:
        from gendist.training import lora
        n = sum(math.prod(s.shape) for s in jax.tree.leaves(lora.shapes(m, t)))
        parts.append(f"LoRA rank {t.lora_rank}, alpha {t.lora_alpha:g} on {t.lora_targets}: "
                     f"{n / 1e6:.3g}M trainable ({100 * n / m.num_params:.2g}% of the model), "
                     f"base frozen in {t.lora_base_dtype}")
    if t.objective == "dpo":
        parts.append(f"DPO, beta {t.dpo_beta:g}, on {cfg.data.preferences} against the "
                     "initial model")
    return "tuning: " + "; ".join(parts) if parts else None


def _mesh_text(mesh) -> str:
    return " x ".join(f"{k} {v}" for k, v in mesh.shape.items())


def batch_per_device(cfg: Config, mesh) -> str:
    """Sequences each device processes per step (and per microbatch)."""
    t = cfg.train
    shards = mesh.shape["data"] * mesh.shape["expert"]
    rows = t.batch_size * (2 if t.objective == "dpo" else 1) // shards  # DPO: 2 a pair
    if mesh.shape["pipeline"] > 1:
        m = pipeline_microbatches(cfg, mesh)
        return f"{rows} sequences per data shard in {m} microbatches of {rows // m}"
    if t.grad_accum > 1:
        return f"{rows} sequences per device in {t.grad_accum} microbatches of " \
               f"{rows // t.grad_accum}"
    return f"{rows} sequence{'s' if rows != 1 else ''} per device"


def header(cfg: Config, mesh, start: int, end: int, out_dir: Path) -> list[str]:
    m, t = cfg.model, cfg.train
    dev = jax.devices()[0]
    procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    moe = f", {m.moe_experts} experts top-{m.moe_top_k}" if m.moe_experts else ""
    sched = (f", schedule {t.pipeline_schedule}" if mesh.shape["pipeline"] > 1 else "")
    run = (f"steps {start} -> {end} (resumed at step {start})" if start
           else f"steps 0 -> {end}")
    ckpt = (f"every {t.checkpoint_every} steps and at the end" if t.checkpoint_every
            else "at the end")
    if t.checkpoint_every_minutes:
        ckpt = f"every {t.checkpoint_every_minutes:g} min, " + ckpt
    lines = [
        f"model: {m.params_text()}; {m.num_layers} layers, d_model {m.d_model}{moe}; "
        f"{m.dtype}, attention {resolve_backend(m.attention)}",
        f"devices: {jax.device_count()} x {dev.device_kind}{procs}; mesh {_mesh_text(mesh)}"
        f"{sched}; ZeRO stage {t.zero_stage}",
        f"batch: {t.batch_size}{' preference pairs' if t.objective == 'dpo' else ''} x "
        f"{t.seq_len} tokens per step, "
        f"{batch_per_device(cfg, mesh)}; {run}",
        f"checkpoints: {out_dir / 'checkpoints'} ({ckpt}, keep {t.keep_checkpoints})",
        f"metrics: {out_dir / 'metrics.jsonl'}"
        + (f"; TensorBoard: tensorboard --logdir {out_dir / 'tb'}" if t.tensorboard else ""),
    ]
    tuning = _tuning_text(cfg)
    return lines if tuning is None else [lines[0], tuning, *lines[1:]]


def footer(cfg: Config, start: int, end: int, seconds: float, history: list[dict],
           val_loss: float | None, saved_step: int | None, out_dir: Path) -> list[str]:
    t = cfg.train
    steps = end - start
    tokens = steps * t.batch_size * t.seq_len
    speed = f", {tokens / max(seconds, 1e-9):,.0f} tokens/s" if steps else ""
    train_loss = f"train loss {history[-1]['loss']:.4f}, " if history else ""
    val = (f"validation loss {val_text(cfg, val_loss)}"
           if val_loss is not None else "no validation loss")
    where = (f"latest checkpoint step {saved_step} in {out_dir / 'checkpoints'}"
             if saved_step is not None else "no checkpoint")
    return [
        f"done: {steps} steps ({start} -> {end}) in {seconds:.1f} s{speed}; {train_loss}{val}",
        f"saved: {where}; metrics {out_dir / 'metrics.jsonl'}"
        + (f"; TensorBoard {out_dir / 'tb'}" if t.tensorboard else ""),
    ]
