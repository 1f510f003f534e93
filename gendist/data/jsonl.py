"""JSON Lines files, one object a line, read with errors that name the file, the line and the
fix. The corpus's `.jsonl` text, DPO's preference pairs and the evaluation tasks all read
through `objects`; each checks its own fields."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path


def objects(path: str | Path, where: Callable[[int], str], shape: str,
            error: type[Exception] = ValueError) -> Iterator[tuple[int, str, dict]]:
    """(line number, `where(line)`, the object) for each non-blank line of `path`. A line that
    is not UTF-8, not JSON or not a JSON object raises `error` in one line that starts with
    `where(line)` and shows `shape`, an example object."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            at = where(n)
            try:
                rec = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise error(f"{at} is not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                            f"{e.start + 1}); convert the file to UTF-8 (e.g. iconv -f latin1 "
                            "-t utf-8).") from None
            except json.JSONDecodeError as e:
                raise error(f"{at} is not a JSON record ({e.msg} at column {e.colno}); each "
                            f"line holds one JSON object, e.g. {shape}.") from None
            if not isinstance(rec, dict):
                raise error(f"{at} holds a JSON {type(rec).__name__}, not an object; each line "
                            f"holds one JSON object, e.g. {shape}.")
            yield n, at, rec
