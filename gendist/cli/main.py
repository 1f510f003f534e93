"""The commands and `main`: a mistake in the input (config, data, checkpoint, run
directory) ends a command with one line on stderr and exit code 2; GENDIST_TRACEBACK=1
shows the traceback instead."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from gendist.cli.args import PRESETS, PROG

TRACEBACK_ENV = "GENDIST_TRACEBACK"

USAGE = f"""usage: {PROG} COMMAND [--preset NAME] [--section.field VALUE ...]

commands:
  train      train a model (default: the `tiny` preset on the bundled Shakespeare corpus,
             all devices data-parallel), checkpoint it, print validation loss and a sample
             (--no-sample skips it)
  generate   sample from a checkpoint: --checkpoint DIR [--prompt TEXT] [--generate.top-k K ...],
             from a Hugging Face Llama directory: --model-dir DIR [--draft-dir DIR], or from
             a preset with random weights (a decode benchmark): --preset NAME
  eval       perplexity (nats/byte, nats/token) and multiple-choice tasks of a checkpoint or
             a Hugging Face directory: eval --checkpoint RUN [--data.corpus F] [--tasks F.jsonl]
  prepare    tokenize a corpus into token files: --out DIR --data.corpus ... --data.tokenizer T
  export     write a checkpoint as a Hugging Face Llama directory: --checkpoint RUN --out DIR
             (a new or empty folder; --overwrite replaces one whole)
  plan       predicted vs compiled per-device memory and communication (and the pipeline
             bubble) for a config: plan [--devices N] [--no-compile] [overrides]
  launch     run N local processes of one multi-process job:
             launch --nproc N [--devices-per-process D] -- {PROG} train ...

--preset NAME starts from a named config ({PRESETS}; default tiny); --config FILE from a
run's saved config.yaml (flags after it override it). `train --init-from DIR` fine-tunes a
Hugging Face Llama directory (or a gendist run).
`{PROG} COMMAND --help` lists every option of a command with its meaning.
A CPU is one device: XLA_FLAGS=--xla_force_host_platform_device_count=8 simulates 8 for the
multi-device examples. Mistakes in the input print one line (exit code 2);
{TRACEBACK_ENV}=1 adds the traceback."""


def _command(name: str):
    """The function of command `name` (its module imported only when it runs)."""
    import importlib
    return getattr(importlib.import_module(f"gendist.cli.{name}"), f"cmd_{name}")


COMMANDS = ("train", "generate", "eval", "prepare", "export", "plan", "launch")


def _user_error_types():
    from gendist.training.checkpoint import CheckpointError
    return (ValueError, FileNotFoundError, NotADirectoryError, CheckpointError)


def _failure_types():
    """Runs that stopped for a reason worth one line, not a traceback (exit code 1)."""
    from gendist.distributed import DistributedError
    from gendist.training.train import NonFiniteLoss
    return (NonFiniteLoss, DistributedError)


_ROOT = Path(__file__).resolve().parents[2]
_OURS = (str(_ROOT / "gendist"), str(_ROOT / "pallas_kernels"))


def _raised_by_gendist(e: BaseException) -> bool:
    """The exception came from a check in gendist's own code, not from inside a library
    (a ValueError deep in jax is a bug to report, with its traceback)."""
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and str(Path(last).resolve()).startswith(_OURS)


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def run_command(command: str, argv: list[str]) -> int:
    """Run one command; input mistakes end it with one line on stderr and exit code 2."""
    try:
        return _command(command)(list(argv))
    except KeyboardInterrupt:
        print(f"{PROG} {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        if isinstance(e, _failure_types()):
            code = 1
        elif isinstance(e, _user_error_types()) and _raised_by_gendist(e):
            code = 2
        else:
            raise
        print(f"{PROG} {command}: error: {one_line(e)}", file=sys.stderr, flush=True)
        return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if not argv:
        print(USAGE, file=sys.stderr)
        print(f"{PROG}: error: give a command ({', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"{PROG}: unknown command {command!r}; choose one of {', '.join(COMMANDS)} "
              f"(`{PROG} --help`)", file=sys.stderr)
        return 2
    return run_command(command, rest)
