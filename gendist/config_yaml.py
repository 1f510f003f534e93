"""A run's Config as YAML: saved beside its checkpoints, accepted back with `--config FILE`.

The file has the five sections of `Config` (model, mesh, data, train, generate); a file may
give only some sections or fields, the rest take their defaults. Unknown sections or
fields, and values outside a field's choices, are refused naming the field.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from gendist.config import Config

YAML_NAME = "config.yaml"


def _plain(x):
    if isinstance(x, tuple | list):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def to_yaml(cfg: Config) -> str:
    import yaml
    return yaml.safe_dump(_plain(dataclasses.asdict(cfg)), sort_keys=False)


def save(cfg: Config, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(cfg))
    return path


def _coerce(section: str, f: dataclasses.Field, value, hint):
    name = f"{section}.{f.name}"
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            raise ValueError(f"{name}={value!r} in the config file; choose one of "
                             f"{list(typing.get_args(hint))}.")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            value = [value]
        item = typing.get_args(hint)[0]
        return tuple(_coerce(section, f, v, item) for v in value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} in the config file must be true or false.")
        return value
    if hint is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as text
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} in the config file must be a number.") from None
    if hint is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(f"{name}={value!r} in the config file must be a number.")
        return float(value)
    if hint in (int, str) and not (isinstance(value, hint) and not isinstance(value, bool)):
        what = "an integer" if hint is int else "a string (quote it)"
        raise ValueError(f"{name}={value!r} in the config file must be {what}.")
    return value


def from_dict(d: dict, base: Config | None = None) -> Config:
    """A Config from nested dicts (as YAML gives them), over `base` (default: defaults)."""
    base = Config() if base is None else base
    sections = {f.name: f for f in dataclasses.fields(Config)}
    out = {}
    for sec, values in (d or {}).items():
        if sec not in sections:
            raise ValueError(f"unknown config section {sec!r}; sections are {sorted(sections)}.")
        if values is not None and not isinstance(values, dict):
            raise ValueError(f"config section {sec!r} holds {values!r}, not fields; give "
                             f"them under it, e.g. `{sec}: {{field: value}}`.")
        cur = getattr(base, sec)
        cls = type(cur)
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kw = {}
        for k, v in (values or {}).items():
            key = str(k).replace("-", "_")
            if key not in fields:
                raise ValueError(f"unknown config field {sec}.{k}; {sec} has "
                                 f"{sorted(fields)}.")
            kw[key] = _coerce(sec, fields[key], v, hints[key])
        out[sec] = dataclasses.replace(cur, **kw)
    return dataclasses.replace(base, **out)


def load(path: str | Path, base: Config | None = None) -> Config:
    """The Config a YAML file gives (over `base`); a file that is not YAML, or not of
    sections of fields, is refused in one line naming the file and the line."""
    import yaml
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config {str(path)!r} is not a file; give a run's saved "
                                f"{YAML_NAME} (e.g. runs/default/{YAML_NAME}).")
    try:
        d = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"--config {str(path)!r} is not UTF-8 text (byte {e.start}); give "
                         f"a YAML file such as a run's saved {YAML_NAME}.") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        what = getattr(e, "problem", None) or type(e).__name__
        raise ValueError(f"--config {str(path)!r} is not valid YAML: {what} at {where}; fix "
                         f"that line (a run's saved {YAML_NAME} shows the layout).") from None
    if d is not None and not isinstance(d, dict):
        raise ValueError(f"--config {str(path)!r}: expected sections (model:, train:, ...).")
    return from_dict(d, base)
