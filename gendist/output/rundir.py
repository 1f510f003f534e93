"""A run directory belongs to one config.

Resuming (the default) continues the checkpoint in `train.out_dir` only when it was written
by the same computation: the same model, data and optimisation. Where and how that
computation runs may change (mesh, ZeRO stage, attention kernel, step count, logging), as
restoring onto another mesh is exact. Anything else is refused before a step runs, with the
fields that differ and the flag that starts fresh; nothing on disk is touched.

A run directory holds metrics.jsonl (one JSON record a line, process 0 appends): a resumed
run first drops the records after its checkpoint (`drop_records_after`). A run refused
before its first step takes back what it made (`Footprint`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from pathlib import Path

from gendist.config import Config
from gendist.presets import config_from_dict

# Fields that may differ between a run and its continuation.
MAY_CHANGE = {
    "mesh": None,  # None: every field of the section
    "generate": None,
    "model": {"attention", "remat", "scan_unroll", "fused_projections"},
    "train": {"steps", "out_dir", "resume", "eval_every", "eval_batches", "log_every",
              "checkpoint_every", "checkpoint_every_minutes", "keep_checkpoints", "tensorboard",
              "progress", "nonfinite", "debug_nan_step", "zero_stage", "grad_accum",
              "pipeline_schedule", "pipeline_microbatches", "tp_comm", "fp8_transpose"},
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
    check_steps(cfg, step, where)


def check_steps(cfg: Config, step: int, where: Path) -> None:
    """Raise RunDirError when train.steps lies below the step the run in `where` reached."""
    if cfg.train.steps < step:
        raise RunDirError(
            f"train.steps={cfg.train.steps} is below step {step}, which the run in {where} "
            f"has reached; pass --train.steps {step} or more to continue it, or start a new "
            f"run with --train.out-dir {fresh_dir(cfg.train.out_dir)}.")


def read_records(path: Path) -> list[dict]:
    """The JSON records of a metrics file (none when it is missing); a line that does not
    parse (the last one, cut short by a kill) is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                out.append(record)
    return out


def drop_records_after(path: Path, step: int) -> None:
    """Rewrite a metrics file without its records of steps after `step` and without a line
    cut short (a new file renamed over the old one: a kill leaves one or the other)."""
    if not path.is_file():
        return
    kept = [r for r in read_records(path) if r["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)


class Footprint:
    """What a run adds to its directory, so that a run refused before its first step can
    take it back: the directories it created (`out_dir` and missing parents), or, in a
    directory that existed, the entries that were not there."""

    def __init__(self, out_dir: Path):
        out_dir = out_dir.absolute()
        self.created = out_dir if not out_dir.exists() else None
        while self.created is not None and not self.created.parent.exists():
            self.created = self.created.parent  # the topmost directory the run will create
        self.out_dir = out_dir
        self.before = set(os.listdir(out_dir)) if out_dir.is_dir() else set()
        self.kept = False

    def keep(self) -> None:
        """The run has started: what it made stays."""
        self.kept = True

    def undo(self) -> None:
        """Remove what the run made, unless it was kept (never what existed before)."""
        if self.kept:
            return
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)
            return
        if not self.out_dir.is_dir():
            return
        for name in set(os.listdir(self.out_dir)) - self.before:
            path = self.out_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
