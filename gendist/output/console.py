"""What a run prints, and where: process 0 only, above the progress bar, no bar in a log.

- `say(line)` prints on process 0 only (under `launch` the other ranks stay quiet); while a
  bar is shown the line goes above it (`tqdm.write`) instead of into the bar's line.
- `Progress(steps, enabled)` shows a tqdm bar on a terminal and one widget in a notebook
  (when ipywidgets is installed). When stdout or stderr is a file or a pipe there is no bar (no
  `\\r` frames in the log); `step_lines` then tells the loop to print a plain line every
  `train.log_every` steps instead. A notebook without widgets gets neither.
- `route_logging()` sends the `gendist` logger (e.g. the attention fallback) through `say`.
"""

from __future__ import annotations

import logging
import sys

import jax

_active_bar = None  # the bar on screen, if any: `say` writes above it


def is_main_process() -> bool:
    return jax.process_index() == 0


def say(line: str) -> None:
    """Print one line on process 0, above the progress bar when one is shown."""
    if not is_main_process():
        return
    if _active_bar is not None:
        _active_bar.write(line)
    else:
        print(line, flush=True)


def in_notebook() -> bool:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def bar_kind(enabled: bool) -> str | None:
    """"terminal", "notebook" or None (no bar) for this process and its output."""
    if not enabled or not is_main_process():
        return None
    if in_notebook():
        try:
            import ipywidgets  # noqa: F401 - tqdm.notebook needs it
        except ImportError:
            return None
        return "notebook"
    return "terminal" if sys.stdout.isatty() and sys.stderr.isatty() else None


class Progress:
    """Iterate over training steps, with a bar where one can be drawn."""

    def __init__(self, steps: range, enabled: bool, desc: str = "train"):
        global _active_bar
        self.steps = steps
        kind = bar_kind(enabled)
        self.bar = None
        if kind == "terminal":
            from tqdm import tqdm
            self.bar = tqdm(steps, desc=desc, dynamic_ncols=True)
        elif kind == "notebook":
            from tqdm.notebook import tqdm
            self.bar = tqdm(steps, desc=desc)
        if self.bar is not None:
            _active_bar = self.bar
        self.step_lines = (enabled and self.bar is None and not in_notebook()
                           and is_main_process())

    def __iter__(self):
        return iter(self.bar if self.bar is not None else self.steps)

    def set_postfix(self, **kw) -> None:
        if self.bar is not None:
            self.bar.set_postfix(refresh=False, **kw)

    def close(self) -> None:
        global _active_bar
        if self.bar is not None:
            self.bar.close()
            _active_bar = None


class _SayHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        say(self.format(record))


def route_logging() -> None:
    """Send the `gendist` logger's warnings through `say` (the CLI does this)."""
    log = logging.getLogger("gendist")
    if not any(isinstance(h, _SayHandler) for h in log.handlers):
        log.addHandler(_SayHandler())
        log.propagate = False
