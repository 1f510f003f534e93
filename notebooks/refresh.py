"""Execute the notebooks on this machine and save them with their outputs, each code cell
stamped with a hash of its source (`metadata.source_hash`), so that a reader sees the plots and
numbers the committed code makes; tests/test_notebooks.py fails when a code cell's source no
longer matches its stamp (edited since its outputs were made) or a cell has no outputs.

    python notebooks/refresh.py              # every notebook
    python notebooks/refresh.py 04 07        # those whose name starts with 04 or 07

Run it after changing a notebook, or the code it shows, and commit the notebooks it wrote.
Each notebook runs top to bottom in a fresh kernel in this folder (where 03 and 05 find
benchmarks/), on a CPU, without the caller's $XLA_FLAGS: each notebook sets its own device
count, as on a reader's machine. Timing metadata is not recorded (no noise in the diff).
`pytest --nbmake notebooks` executes them too, without writing them back.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def source_hash(source: str | list[str]) -> str:
    """The stamp of a code cell's source (nbformat stores it as a string or a list of lines)."""
    text = source if isinstance(source, str) else "".join(source)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def refresh(path: Path, timeout: int = 1200) -> None:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            coalesce_streams=True,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.metadata["source_hash"] = source_hash(cell.source)
    nbformat.write(nb, path)


def main(prefixes: list[str]) -> None:
    os.environ.pop("XLA_FLAGS", None)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    paths = sorted(p for p in HERE.glob("*.ipynb")
                   if not prefixes or any(p.name.startswith(x) for x in prefixes))
    if not paths:
        sys.exit(f"no notebook in {HERE} starts with {' or '.join(prefixes)}")
    for path in paths:
        t0 = time.perf_counter()
        refresh(path)
        print(f"{path.name}: executed in {time.perf_counter() - t0:.0f} s, "
              f"{path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main(sys.argv[1:])
