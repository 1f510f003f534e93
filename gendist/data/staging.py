"""Folders written whole or not at all: `prepare`'s token files and `export`'s checkpoint are
written into a staging folder beside their destination and moved into place at the end; an
error or an interrupt on the way removes the stage and the parent folders the call made."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def staged(out: Path, tag: str) -> Iterator[Path]:
    """A new temporary folder `.{out.name}.{tag}-*` beside `out` to write into (the caller
    moves it into place inside the block). On any exception, KeyboardInterrupt included,
    the stage is deleted with the parent folders of `out` that this call created."""
    created = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.{tag}-", dir=out.parent))
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for d in created:  # deepest first; only the folders this call made
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
