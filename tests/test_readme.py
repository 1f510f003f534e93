"""The README's examples, read from README.md itself and run as a new user would.

- The Python block of "Use it from Python" runs as written.
- The command blocks of "Set up and run" run in order in one fresh directory on CPU (the
  block's own `export XLA_FLAGS=...` gives 8 simulated devices), with small step counts
  appended (and `--no-sample` where the comment promises no sample); each must exit 0 and
  show what its comment promises.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
SKIP = ("-m pip ", "-m pytest ")  # installing, and the test suite itself
TRAIN_SMALL = ["--train.steps", "2", "--train.eval-every", "2", "--train.eval-batches", "1",
               "--train.batch-size", "16", "--train.seq-len", "16",
               "--generate.max-new-tokens", "16"]


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start: end if end >= 0 else None]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_python_example_runs(tmp_path, monkeypatch, capsys):
    (code,) = blocks(section("Use it from Python"), "python")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    assert "done: 10 steps (0 -> 10)" in out
    assert (tmp_path / "runs" / "python" / "checkpoints" / "10").is_dir()
    assert "\nROMEO:" in out


def commands() -> list[tuple[str, str]]:
    """(command, comment) for every line of the "Set up and run" bash blocks, in order."""
    out = []
    for block in blocks(section("Set up and run"), "bash"):
        for line in block.splitlines():
            cmd, _, comment = line.partition("   #")
            if not cmd.strip():
                continue
            if "#" in cmd and not comment:  # one space before the comment
                cmd, _, comment = cmd.partition(" #")
            out.append((cmd.strip(), comment.strip()))
    return out


# What each command's comment promises, checked on its output (by a word of the command).
EXPECT = {
    "gendist train": ["model: 0.89M params", "validation loss", "sample:\nROMEO:"],
    "generate": ["KING HENRY:"],
    "--preset gpt2": ["85.15M params", "mesh data 4 x pipeline 1 x expert 1 x tensor 2",
                      "ZeRO stage 1", "runs/gpt2-tp/checkpoints"],
    "--mesh.pipeline 2": ["mesh data 4 x pipeline 2", "schedule 1f1b", "validation loss"],
    "--model.moe-experts 8": ["2.95M params (1.18M active per token)", "8 experts top-2",
                              "expert 2"],
    "--help": ["--model.num-layers", "--preset NAME", "--no-sample"],
    "plan": ["predicted", "compiled", "all-gather over data"],
    "launch": ["[0] devices: 4 x cpu in 2 processes", "[0] done: 2 steps",
               "[0] saved: latest checkpoint step 2 in runs/launch"],
}


def expectation(cmd: str) -> list[str]:
    for key in ("launch", "generate", "plan", "--help", "--preset gpt2", "--mesh.pipeline 2",
                "--model.moe-experts 8", "gendist train"):
        if key in cmd:
            return EXPECT[key]
    raise AssertionError(f"the README test does not know what to expect of: {cmd}")


@pytest.mark.slow
def test_readme_commands_run_in_order_in_one_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # as a new shell
    env["JAX_PLATFORMS"] = "cpu"
    # ... but compiled as the rest of the suite is (tests/conftest.py), device count aside
    speed = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    cmds = commands()
    assert len(cmds) >= 9, cmds
    ran = 0
    for cmd, comment in cmds:
        assert comment, f"README command without a comment saying what it does: {cmd}"
        if cmd.startswith("export "):
            name, _, value = cmd.removeprefix("export ").partition("=")
            env[name] = value
            continue
        if any(s in cmd for s in SKIP):
            continue
        argv = [sys.executable if a == "python3" else a for a in shlex.split(cmd)]
        if "train" in argv and "--help" not in argv:
            argv += TRAIN_SMALL + ([] if "sample" in comment else ["--no-sample"])
        elif "generate" in argv:
            argv += ["--generate.max-new-tokens", "16"]
        flags = " ".join(speed + env.get("XLA_FLAGS", "").split())
        r = subprocess.run(argv, cwd=tmp_path, env={**env, "XLA_FLAGS": flags},
                           capture_output=True, text=True, timeout=600)
        out = r.stdout + r.stderr
        assert r.returncode == 0, f"{cmd}\n{out[-3000:]}"
        assert "Traceback" not in out, f"{cmd}\n{out[-3000:]}"
        for want in expectation(cmd):
            assert want in out, f"{cmd}: no {want!r} ({comment})\n{out[-3000:]}"
        ran += 1
    assert ran == len(cmds) - 3  # all but export, pip install and pytest
    if "launch" in cmds[-1][0]:
        assert "[1] done:" not in out and "[1] model:" not in out  # rank 0 alone prints


def layout() -> dict[str, list[str]]:
    """The Layout section's block: folder -> the module names it lists (text in
    parentheses is a description)."""
    (block,) = blocks(section("Layout"), "")
    groups: dict[str, list[str]] = {}
    folder = None
    for line in block.splitlines():
        if line and not line[0].isspace():
            folder, _, line = line.partition(" ")
            groups[folder] = []
        groups[folder].append(line)
    out = {}
    for folder, parts in groups.items():
        text = re.sub(r"\([^()]*\)", "", " ".join(parts))
        out[folder] = [n.strip() for n in text.split(",") if n.strip()]
    return out


def test_layout_section_matches_the_tree():
    root = README.parent
    listed = layout()
    packages = sorted(str(p.parent.relative_to(root)) + "/" for pkg in ("gendist", "pallas_kernels")
                      for p in (root / pkg).rglob("__init__.py"))
    assert sorted(listed) == packages, "README's Layout lists other folders than the tree has"
    for folder, names in listed.items():
        for n in names:
            assert re.fullmatch(r"_*[a-z][a-z0-9_]*", n), f"{folder}: {n!r} is not a module name"
        assert len(names) == len(set(names)), f"{folder}: a module named twice"
        modules = sorted(p.stem for p in (root / folder).glob("*.py") if p.stem != "__init__")
        assert sorted(names) == modules, f"{folder}: README lists {sorted(names)}, tree has {modules}"
    assert len(README.read_text().splitlines()) <= 150, "README is to be read in five minutes"


def test_experiments_are_indexed_and_benchmark_pages_name_real_commands():
    root = README.parent
    index = (root / "experiments" / "README.md").read_text()
    scripts = sorted(p.name for p in (root / "experiments").iterdir()
                     if p.is_file() and p.name != "README.md")
    assert [s for s in scripts if s not in index] == [], "experiments/README.md misses these"
    topics = set(re.findall(r"^(\w+)\)", (root / "experiments" / "run_gpu.sh").read_text(),
                            flags=re.M))
    pages = sorted((root / "benchmarks").glob("*.md"))
    assert len(pages) >= 8
    for page in pages:
        text = page.read_text()
        for script in re.findall(r"experiments/(\w+\.(?:py|sh))", text):
            assert (root / "experiments" / script).is_file(), f"{page.name}: {script}"
        for topic in re.findall(r"run_gpu\.sh ([a-z_]+)", text):
            assert topic in topics, f"{page.name}: run_gpu.sh has no topic {topic!r}"
        for name in re.findall(r"\b([\w.-]+\.(?:json|png))\b", text):
            assert (root / "benchmarks" / name).is_file() or "*" in name, \
                f"{page.name} cites {name}, which is not in benchmarks/"
