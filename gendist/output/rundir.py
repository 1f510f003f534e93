"""A run directory belongs to one config.

Resuming (the default) continues the checkpoint in `train.out_dir` only when it was written
by the same computation: the same model, data and optimisation. Where and how that
computation runs may change (mesh, ZeRO stage, attention kernel, step count, logging), as
restoring onto another mesh is exact. Anything else is refused before a step runs, with the
fields that differ and the flag that starts fresh; nothing on disk is touched.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gendist.config import Config
from gendist.presets import config_from_dict

# Fields that may differ between a run and its continuation.
MAY_CHANGE = {
    "mesh": None,  # None: every field of the section
    "generate": None,
    "model": {"attention", "remat", "scan_unroll", "fused_projections"},
    "train": {"steps", "out_dir", "resume", "eval_every", "eval_batches", "log_every",
              "checkpoint_every", "keep_checkpoints", "tensorboard", "progress", "nonfinite",
              "debug_nan_step", "zero_stage", "grad_accum", "pipeline_schedule",
              "pipeline_microbatches", "tp_comm"},
}


class RunDirError(ValueError):
    """train.out_dir holds a run this config must not continue or overwrite."""


def config_diff(saved: Config, cfg: Config) -> list[tuple[str, object, object]]:
    """(section.field, saved value, new value) for every field that may not change."""
    out = []
    for section in dataclasses.fields(Config):
        free = MAY_CHANGE.get(section.name, set())
        if free is None:
            continue
        a, b = getattr(saved, section.name), getattr(cfg, section.name)
        for f in dataclasses.fields(a):
            if f.name not in free and getattr(a, f.name) != getattr(b, f.name):
                out.append((f"{section.name}.{f.name}", getattr(a, f.name), getattr(b, f.name)))
    return out


def fresh_dir(out_dir: str) -> str:
    """`out_dir` with the first suffix -2, -3, ... that does not exist yet."""
    base = out_dir.rstrip("/") or "run"
    k = 2
    while Path(f"{base}-{k}").exists():
        k += 1
    return f"{base}-{k}"


def check_resume(cfg: Config, saved_config: dict | None, step: int, where: Path) -> None:
    """Raise RunDirError unless `cfg` may continue the run checkpointed at `step` in `where`."""
    t = cfg.train
    fresh = f"--train.out-dir {fresh_dir(t.out_dir)}"
    if not t.resume:
        raise RunDirError(
            f"train.resume=False but {where} already holds a run (latest step {step}); start "
            f"fresh in a new directory with {fresh}, or drop --train.no-resume to continue it.")
    if saved_config is None:
        return  # written before configs were saved: nothing to compare
    try:
        saved = config_from_dict(saved_config)
    except (TypeError, ValueError) as e:
        raise RunDirError(f"the config saved with step {step} in {where} cannot be read "
                          f"({e}); start fresh with {fresh}.") from e
    diff = config_diff(saved, cfg)
    if diff:
        shown = ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in diff[:6])
        more = f" and {len(diff) - 6} more" if len(diff) > 6 else ""
        raise RunDirError(
            f"{where} holds a run of another config ({shown}{more}); to train this config "
            f"start fresh with {fresh}, or drop those flags to continue that run from step "
            f"{step}.")
