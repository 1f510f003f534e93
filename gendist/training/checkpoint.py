"""Orbax checkpoints: atomic saves, keep-K, resume from the latest, restore onto any mesh.

Orbax writes each step into a temporary directory and renames it when complete, so a
crash mid-save leaves the previous checkpoint as the latest. Restoring takes the target
shardings, so a checkpoint written on one mesh (or process count) loads onto another.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
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

    def read_meta(self, step: int | None = None) -> dict:
        """The JSON metadata saved with a step (val_loss, config), without the arrays."""
        step = self.latest_step() if step is None else step
        try:
            return self.manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds; name the fix
            raise CheckpointError(self._unreadable(step, e)) from e

    def restore(self, target_state, step: int | None = None):
        """Restore onto the shardings of `target_state` (arrays or ShapeDtypeStructs)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target_state)
        _quiet_orbax_leftovers()  # before: a failing read reports while the others still run
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds; name the fix
            raise CheckpointError(self._unreadable(step, e)) from e
        return out["state"], out["meta"], step

    def _unreadable(self, step: int, e: Exception) -> str:
        earlier = [s for s in self.all_steps() if s < step]
        back = (f"move {self.directory / str(step)} out of {self.directory} to resume from "
                f"step {max(earlier)}, or " if earlier else "")
        return (f"checkpoint step {step} in {self.directory} cannot be read, it looks partial "
                f"or damaged ({damage(e)}); {back}start fresh with another --train.out-dir.")

    def close(self):
        self.manager.close()


def damage(e: BaseException) -> str:
    """What a failed read says about a checkpoint, in a few words (orbax's and TensorStore's
    own messages run to hundreds of characters)."""
    import re
    text = " ".join(str(e).split())
    shapes = re.search(r"Requested shape: (\(.*?\)) is not compatible with the stored "
                       r"shape: (\(.*?\))", text)
    if shapes:
        return (f"arrays stored with shape {shapes[2]} where its saved config gives "
                f"{shapes[1]}")
    if type(e).__name__ == "JSONDecodeError":
        return "its metadata is not valid JSON"
    if any(w in text for w in ("TensorStore", "reading array", "DATA_LOSS", "OCDBT", "zarr")):
        return "its array files cannot be read"
    return f"{type(e).__name__}: {text.split(' See full TensorStore')[0][:120]}"


_quieted = False


def _is_leftover(value, tb, obj=None) -> bool:
    """An error of orbax's abandoned reads: raised in orbax, an "Event loop is closed" from a
    read finishing after orbax closed its loop, or TensorStore's own error (it names its
    spec) set on a future by TensorStore's threads, whose traceback holds no orbax frame."""
    text = str(value)
    closed = isinstance(value, RuntimeError) and "Event loop is closed" in text
    return (closed or "tensorstore_spec" in text or "orbax" in repr(obj)
            or _from_orbax(tb))


def _from_orbax(tb) -> bool:
    while tb is not None:
        if "orbax" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


class _DropOrbaxLeftovers(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and _is_leftover(*record.exc_info[1:]))


def _quiet_orbax_leftovers() -> None:
    """When one read of a restore fails, orbax closes its event loop while the other reads
    still run; each of them then reports ("Event loop is closed" from tensorstore's threads,
    "Exception ignored in" when collected, "exception was never retrieved", "coroutine ...
    was never awaited" at exit): dozens of
    tracebacks around the one real message. Drop exactly those, for the rest of the
    process (installed before a restore); anything else still prints."""
    global _quieted
    if _quieted:
        return
    _quieted = True
    unraisable, thread_hook = sys.unraisablehook, threading.excepthook

    def on_unraisable(u):
        if not _is_leftover(u.exc_value, u.exc_traceback, u.object):
            unraisable(u)

    def on_thread_error(args):
        if not _is_leftover(args.exc_value, args.exc_traceback):
            thread_hook(args)

    sys.unraisablehook, threading.excepthook = on_unraisable, on_thread_error
    logging.getLogger("asyncio").addFilter(_DropOrbaxLeftovers())
    # A read orbax never started is a coroutine collected unawaited, reported at exit as
    # "sys:1: RuntimeWarning: coroutine '...' was never awaited". gendist itself runs no
    # coroutines: every such warning after a restore is orbax's.
    warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited",
                            category=RuntimeWarning)
