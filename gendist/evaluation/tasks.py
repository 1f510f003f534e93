"""Multiple-choice task files, templates and few-shot contexts (plain text, no model).

A task file is JSONL, one example a line: {"context": str, "choices": [str, ...], "gold": int}
(the lm-evaluation-harness convention: `gold` is the 0-based index of the right choice).
`read_task` refuses a file it cannot use in one line naming the file, the line and the field.

The text a model scores comes from a template holding `{context}` and ending in `{choice}`
(default "{context}{choice}"): everything before `{choice}` is the context, the choice is the
continuation. `--num-fewshot k` puts k other examples of the same file before it, each the
whole template filled with its context and its gold choice, joined by the few-shot
delimiter ("\\n\\n", lm-evaluation-harness's default); which k is a function of (seed, line).
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path

import numpy as np

from gendist.data import jsonl

FIELDS = ("context", "choices", "gold")
DEFAULT_TEMPLATE = "{context}{choice}"
BUNDLED = {"alphabet": "alphabet.jsonl"}  # name -> file in gendist/assets/tasks/


class TaskError(ValueError):
    """A task file, template or few-shot count that cannot be used."""


@dataclasses.dataclass(frozen=True)
class Example:
    line: int  # 1-based line of the task file
    context: str
    choices: tuple[str, ...]
    gold: int


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    path: str
    examples: tuple[Example, ...]


def resolve(spec: str) -> tuple[str, Path]:
    """(name, path) of a task given as a JSONL file or a bundled name (`BUNDLED`)."""
    path = Path(spec)
    if path.is_file():
        return path.stem, path
    if spec in BUNDLED:
        with resources.as_file(resources.files("gendist.assets") / "tasks" / BUNDLED[spec]) as p:
            return spec, Path(p)
    raise FileNotFoundError(
        f"--tasks {spec!r} is not a file nor a bundled task ({', '.join(BUNDLED)}); give a "
        'JSONL file of {"context": ..., "choices": [...], "gold": index} lines.')


SHAPE = '{"context": "...", "choices": ["...", "..."], "gold": 0}'


def read_task(spec: str) -> Task:
    """Every example of a task file, each line checked (one TaskError line naming the file,
    the line and the field)."""
    name, path = resolve(spec)
    examples = [_example(rec, n, where) for n, where, rec in
                jsonl.objects(path, lambda n: f"--tasks {path}: line {n}", SHAPE, TaskError)]
    if not examples:
        raise TaskError(f"--tasks {path} holds no examples; give one JSON object a line: "
                        '{"context": "...", "choices": ["...", "..."], "gold": 0}.')
    return Task(name, str(path), tuple(examples))


def _example(rec: dict, n: int, where: str) -> Example:
    shape = SHAPE
    for field in FIELDS:
        if field not in rec:
            raise TaskError(f"{where}: field {field!r} is missing (the line has "
                            f"{sorted(rec)}); each line needs {', '.join(FIELDS)}: {shape}.")
    context, choices, gold = (rec[f] for f in FIELDS)
    if not isinstance(context, str):
        raise TaskError(f"{where}: field 'context' is a {type(context).__name__}, not text.")
    if not isinstance(choices, list) or not choices:
        what = "empty" if isinstance(choices, list) else f"a {type(choices).__name__}"
        raise TaskError(f"{where}: field 'choices' is {what}; give a list of at least one "
                        "choice text.")
    for j, c in enumerate(choices):
        if not isinstance(c, str) or not c:
            what = "empty" if isinstance(c, str) else f"a {type(c).__name__}, not text"
            raise TaskError(f"{where}: field 'choices' item {j} is {what}; every choice is "
                            "a non-empty text (it is scored as the continuation).")
    if not isinstance(gold, int) or isinstance(gold, bool):
        raise TaskError(f"{where}: field 'gold' is {gold!r}, not an integer; give the "
                        f"0-based index of the right choice (0 to {len(choices) - 1}).")
    if not 0 <= gold < len(choices):
        raise TaskError(f"{where}: field 'gold' = {gold} is out of range for "
                        f"{len(choices)} choices; give an index from 0 to {len(choices) - 1}.")
    return Example(n, context, tuple(choices), gold)


def check_template(template: str) -> None:
    """A template holds {context} once and ends with {choice} (held once)."""
    if template.count("{context}") != 1 or template.count("{choice}") != 1 \
            or not template.endswith("{choice}") \
            or template.index("{context}") > template.index("{choice}"):
        raise TaskError(f"--template {template!r} must hold {{context}} once and end with "
                        f"{{choice}}, e.g. {DEFAULT_TEMPLATE!r} or "
                        "'Question: {context}\\nAnswer: {choice}'.")


def fill(template: str, context: str, choice: str = "") -> str:
    """The template with its fields filled (the texts are not read as format strings)."""
    before, after = template[: -len("{choice}")].split("{context}")
    return before + context + after + choice


def check_fewshot(task: Task, k: int) -> None:
    if k > len(task.examples) - 1:
        raise TaskError(f"--num-fewshot {k} needs {k + 1} examples in {task.path}, which "
                        f"holds {len(task.examples)}; pass --num-fewshot "
                        f"{len(task.examples) - 1} or less.")


def fewshot_indices(n: int, i: int, k: int, seed: int) -> list[int]:
    """k distinct indices of [0, n) other than i: a function of (seed, i) alone."""
    if k == 0:
        return []
    others = np.delete(np.arange(n), i)
    rng = np.random.default_rng([seed, i])
    return [int(j) for j in rng.choice(others, size=k, replace=False)]


def contexts(task: Task, template: str = DEFAULT_TEMPLATE, k: int = 0, seed: int = 1234,
             delimiter: str = "\n\n", limit: int = 0) -> list[str]:
    """The context text of the first `limit` examples (0: all): k demonstrations drawn from
    the whole file (whole templates, gold choice filled in, each followed by `delimiter`),
    then the template before {choice}."""
    check_template(template)
    check_fewshot(task, k)
    ex = task.examples
    out = []
    for i, e in enumerate(ex[: limit or len(ex)]):
        demos = [fill(template, ex[j].context, ex[j].choices[ex[j].gold])
                 for j in fewshot_indices(len(ex), i, k, seed)]
        out.append("".join(d + delimiter for d in demos) + fill(template, e.context))
    return out
