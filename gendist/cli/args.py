"""The one way a command line is parsed: each command's options are a frozen dataclass
(field comments are the help), read by tyro through `parse`, which turns a rejected line
into one `UsageError` line instead of tyro's box. A command that takes a whole `Config`
(train, plan) nests it without a prefix (`--model.num-layers 4`) and starts it from
`--preset NAME` or `--config FILE`, read first because they set every other default."""

from __future__ import annotations

import contextlib
import dataclasses
import io
from typing import Annotated

import tyro

from gendist.config import Config
from gendist.presets import PRESETS as _PRESETS

PROG = "python -m gendist"
PRESETS = ", ".join(_PRESETS)


class UsageError(ValueError):
    """A command line that cannot run (a missing or malformed option)."""


def pop_option(argv: list[str], name: str, default: str | None = None) -> str | None:
    """Remove `name VALUE` or `name=VALUE` from argv and return VALUE."""
    for i, a in enumerate(argv):
        if a == name:
            if i + 1 >= len(argv):
                raise UsageError(f"{name} needs a value")
            value = argv[i + 1]
            del argv[i: i + 2]
            return value
        if a.startswith(name + "="):
            del argv[i]
            return a.split("=", 1)[1]
    return default


def _box_text(text: str) -> str:
    """The message inside tyro's error box, as one line (its help footer dropped)."""
    lines = []
    for raw in text.splitlines():
        line = raw.strip().strip("│").strip()
        if raw.strip().startswith(("╭", "╰")):
            continue
        if line and set(line) <= {"─"}:
            break  # below the rule: argument help and "For full helptext, ..."
        if line:
            lines.append(line)
    return " ".join(lines) or " ".join(text.split())


def parse(cls, argv: list[str], command: str, **kw):
    """`tyro.cli(cls)` over argv, a rejected command line raised as one UsageError line;
    then every config in it checked (`check()`: ranges and choices, one ValueError line
    naming the flag; tyro would wrap a ValueError raised while it builds them in its box)."""
    from gendist.config import deferred_checks
    prog = f"{PROG} {command}"
    err = io.StringIO()
    try:
        with deferred_checks(), contextlib.redirect_stderr(err):
            args = tyro.cli(cls, args=argv, prog=prog, **kw)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        raise UsageError(f"{_box_text(err.getvalue())} (`{prog} --help` lists every flag)"
                         ) from None
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if dataclasses.is_dataclass(value) and hasattr(value, "check"):
            value.check()
    return args


def base_config(argv: list[str], default_preset: str = "tiny") -> tuple[Config, str]:
    """(the config flags override, its description), `--config FILE` or `--preset NAME`
    taken out of argv."""
    from gendist import config_yaml
    from gendist.presets import preset
    path = pop_option(argv, "--config")
    name = pop_option(argv, "--preset")
    if path is not None:
        if name is not None:
            raise ValueError("give --config FILE or --preset NAME, not both: a config file "
                             "is a whole config (start it from a preset's saved config.yaml).")
        return config_yaml.load(path), f"config file {path!r}"
    name = name or default_preset
    return preset(name), f"preset {name!r}"


def parse_with_config(cls, argv: list[str], command: str, about: str, **fields):
    """A `cls` whose `config` field is a whole Config: its defaults from `--preset NAME`
    (or `--config FILE`), then every flag; the Config checked once parsed (`parse`).
    `fields`: defaults of cls's other fields."""
    from gendist.config import deferred_checks
    argv = list(argv)
    with deferred_checks():
        base, what = base_config(argv)
        description = (f"{about} --preset NAME picks the starting config ({PRESETS}), "
                       f"--config FILE a saved one; here {what}. Every field below can be set.")
        args = parse(cls, argv, command, default=cls(config=base, **fields),
                     description=description)
    return args


@dataclasses.dataclass(frozen=True)
class ConfigArgs:
    config: Annotated[Config, tyro.conf.arg(name="")]


def parse_config(argv: list[str], command: str = "train") -> Config:
    """A Config alone from a command line (`--preset` / `--config`, then field flags)."""
    return parse_with_config(ConfigArgs, argv, command, f"gendist {command}.").config
