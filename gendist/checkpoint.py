"""Orbax checkpoints: atomic saves, keep-K, resume from the latest, restore onto any mesh.

Orbax writes each step into a temporary directory and renames it when complete, so a
crash mid-save leaves the previous checkpoint as the latest. Restoring takes the target
shardings, so a checkpoint written on one mesh (or process count) loads onto another.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be read back."""


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        self.manager.wait_until_finished()

    def restore(self, target_state, step: int | None = None):
        """Restore onto the shardings of `target_state` (arrays or ShapeDtypeStructs)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target_state)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds; name the fix
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} is partial or corrupt "
                f"({type(e).__name__}: {str(e)[:300]}). Delete {self.directory / str(step)} to "
                "fall back to the previous checkpoint, or start fresh with --train.resume "
                "False or another --train.out-dir.") from e
        return out["state"], out["meta"], step

    def close(self):
        self.manager.close()
