"""The notebooks are committed with their outputs, and the outputs are those of their code.

`notebooks/refresh.py` executes every notebook top to bottom and stamps each code cell with a
hash of its source. Here, without executing anything: every code cell has run (in order, in
one run), its stamp matches its source as committed (a cell edited since fails: run
refresh.py), no cell ended in an error, a cell that draws has its picture (PNG), and no
notebook carries giant outputs. Whether the notebooks still run against the current code is
`pytest --nbmake notebooks` (CI), which executes them without writing them back.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).parents[1] / "notebooks"
MAX_BYTES = 600_000  # a notebook with its outputs and plots (the largest: ~350 KB)
MAX_TEXT = 20_000  # characters of one text output
DRAWS = re.compile(r"\bplt\.|\bSS\.plot\(|display\(Image\(")

_spec = importlib.util.spec_from_file_location("refresh", NOTEBOOKS / "refresh.py")
refresh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refresh)


def text(value) -> str:
    return value if isinstance(value, str) else "".join(value)


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_notebook_is_committed_with_the_outputs_of_its_code(path):
    assert path.stat().st_size < MAX_BYTES, f"{path.name}: {path.stat().st_size} bytes"
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c.get("id") for c in nb["cells"]), f"{path.name}: cells without ids"
    fix = f"run `python notebooks/refresh.py {path.name[:2]}` and commit {path.name}"
    for n, cell in enumerate(code, 1):
        src = text(cell["source"])
        where = f"{path.name}, code cell {n} ({src.strip().splitlines()[0][:50]!r})"
        stamp = cell["metadata"].get("source_hash")
        assert stamp is not None, f"{where}: its outputs were not made by refresh.py: {fix}"
        assert stamp == refresh.source_hash(src), \
            f"{where}: its source changed since its outputs were made: {fix}"
        assert cell.get("execution_count") == n, \
            f"{where}: not executed in one run from the top (count {cell.get('execution_count')}): {fix}"
        outputs = cell.get("outputs", [])
        assert not [o for o in outputs if o["output_type"] == "error"], f"{where}: an error"
        for o in outputs:
            body = text(o.get("text", "")) + text(o.get("data", {}).get("text/plain", ""))
            assert len(body) < MAX_TEXT, f"{where}: {len(body)} characters of output"
        if DRAWS.search(src):
            assert any("image/png" in o.get("data", {}) for o in outputs), \
                f"{where}: draws, but no picture is saved: {fix}"
    assert any(c.get("outputs") for c in code), f"{path.name}: no outputs at all: {fix}"
