"""The README's examples, read from README.md itself and run as written, as a new user would.

- Every command line of every bash block runs as written, in order, in one fresh directory, in
  a new shell's environment: the suite's $XLA_FLAGS are dropped (the block's own `export
  XLA_FLAGS=...` gives the lines after it 8 simulated CPU devices) and no flag is added; the
  small step counts a CPU needs are in the README's lines themselves. Skipped: `pip install`,
  the test command, and the lines whose comment starts with `GPU:` (they want GPUs) or `your
  files:` (a corpus, a downloaded model). Each line must exit 0, show what its comment
  promises, and fit the 2-core, 24 GB machine the README names: its peak resident memory
  (os.wait4 on the child, which covers the grandchildren it waited for, e.g. `launch`'s ranks,
  times the number of ranks) stays below MEMORY_LIMIT. A line that does not fit (the `gpt2`
  line at its preset's batch, 32 x 1024, is killed for memory at 24 GB) fails here.
- The Python block of "Use it from Python" runs twice in a row in one directory, as two runs of
  a script: the second continues the finished run (its comment's promise).

CI time. The main job (`python3 -m gendist train`: 250 steps of `tiny`, 32 x 128 tokens a
step) is most of it: on 2 cores ~145 s alone, ~265 CPU-seconds, so ~2 min of the suite's wall
time on two workers. It runs as written, once: its 250 steps are what the README shows (the
loss reached, the sample), and a bare step is 0.55 s on 2 cores (~42 GFLOP/s), so the default
has no cheaper form that shows the same; the lines after it reuse its run directory as the
README's order implies (`generate` and `export` read runs/default) instead of a run of their
own. The suite's compile flags (no LLVM optimisation) are left out with $XLA_FLAGS: for these
runs they cost CPU time (the main job 2.4x, the short parallel runs 1.2-1.3x), and no line
here compares bits with another program. The persistent compilation cache is kept: it changes
no output, and the two Python runs share it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
MEMORY_LIMIT = 20 * 2**30  # bytes: a 24 GB machine, less the system and the test itself
MARKS = {"GPU", "your files"}  # a comment "GPU: ...", "your files: ..." or "GPU, your files: ..."
TIMEOUT = 1800  # seconds a line may take (the main job: ~145 s alone, more on a busy CI)


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start: end if end >= 0 else None]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def user_env() -> dict[str, str]:
    """A new shell's environment on a CPU machine: the suite's XLA flags dropped."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_measured(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str, int, float]:
    """(exit code, stdout + stderr, peak resident bytes, CPU seconds) of a child and the
    descendants it waited for: os.wait4 returns the child's own rusage."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err, text=True)
        timer = threading.Timer(TIMEOUT, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text = out.read() + err.read()
    return (proc.returncode, text, usage.ru_maxrss * 1024,  # Linux: kilobytes
            usage.ru_utime + usage.ru_stime)


def python_argv(cmd: str) -> list[str]:
    return [sys.executable if a == "python3" else a for a in shlex.split(cmd)]


@pytest.mark.slow
def test_python_example_runs_twice_in_one_directory(tmp_path):
    (code,) = blocks(section("Use it from Python"), "python")
    script = tmp_path / "example.py"
    script.write_text(code)
    work = tmp_path / "work"
    work.mkdir()
    outs = []
    for attempt in (1, 2):
        rc, out, peak, _ = run_measured([sys.executable, str(script)], work, user_env())
        assert rc == 0, f"run {attempt} of the README's Python block:\n{out[-3000:]}"
        assert peak < MEMORY_LIMIT, f"run {attempt}: peak {peak / 2**30:.1f} GiB"
        assert "\nROMEO:" in out, out[-3000:]
        outs.append(out)
    assert "done: 10 steps (0 -> 10)" in outs[0]
    assert (work / "runs" / "python" / "checkpoints" / "10").is_dir()
    assert "done: 10 steps" not in outs[1], "the second run trained again instead of continuing"
    # The first printed line, `val_loss history[-1]["loss"]`: the same run, read back.
    number = r"-?\d+\.\d+(?:e-?\d+)?"
    first = [re.search(rf"^(?:{number}|None) ({number})$", o, flags=re.M).group(1) for o in outs]
    assert float(first[1]) == pytest.approx(float(first[0]), rel=1e-5), first


def commands() -> list[tuple[str, str]]:
    """(command, comment) for every line of every bash block, in order."""
    out = []
    for block in blocks(README.read_text(), "bash"):
        for line in block.splitlines():
            cmd, _, comment = line.partition("   #")
            if not cmd.strip():
                continue
            if "#" in cmd and not comment:  # one space before the comment
                cmd, _, comment = cmd.partition(" #")
            out.append((cmd.strip(), comment.strip()))
    return out


def marks(comment: str) -> set[str]:
    """The marks a comment starts with ("GPU: ..." -> {"GPU"}), empty if none."""
    head, colon, _ = comment.partition(":")
    tags = {t.strip() for t in head.split(",")}
    return tags if colon and tags <= MARKS else set()


def skipped(cmd: str, comment: str) -> bool:
    argv = shlex.split(cmd)
    return (argv[:3] in (["python3", "-m", "pip"], ["python3", "-m", "pytest"])
            or argv[0] in ("pip", "pytest") or bool(marks(comment)))


def option(cmd: str, name: str, default: str) -> str:
    argv = shlex.split(cmd)
    return argv[argv.index(name) + 1] if name in argv else default


# What each command's comment promises, checked on its output (by a word of the command).
def expectation(cmd: str) -> list[str]:
    steps = option(cmd, "--train.steps", "250")
    out_dir = option(cmd, "--train.out-dir", "runs/default")
    trained = [f"done: {steps} steps (0 -> {steps})", "validation loss",
               f"saved: latest checkpoint step {steps} in {out_dir}/checkpoints"]
    table = {
        "launch": ["[0] devices: 4 x cpu in 2 processes", f"[0] done: {steps} steps",
                   f"[0] saved: latest checkpoint step {steps} in {out_dir}"],
        "export": ["exported step 250 (0.89M params) to my-model/: model.safetensors"],
        "gendist eval": ["perplexity: ", "nats/byte", "of the val split of the bundled corpus",
                         "task alphabet: acc", "on 128 examples, 0-shot"],
        "generate": ["checkpoint runs/default step 250", "KING HENRY:"],
        "plan": ["predicted", "compiled", "all-gather over data"],
        "--help": ["--model.num-layers", "--preset NAME", "--no-sample"],
        "--preset gpt2": ["85.15M params", "mesh data 4 x pipeline 1 x expert 1 x tensor 2",
                          "ZeRO stage 1", *trained],
        "--mesh.pipeline 2": ["mesh data 4 x pipeline 2", "schedule 1f1b", *trained],
        "--model.moe-experts 8": ["2.95M params (1.18M active per token)", "8 experts top-2",
                                  "expert 2", *trained],
        "--train.lora-rank": ["tuning: LoRA rank 8, alpha 16 on q,k,v,o", "devices: 8 x cpu",
                              *trained],
        "gendist train": ["model: 0.89M params", "devices: 1 x cpu", *trained, "sample:\nROMEO:"],
    }
    for key, want in table.items():
        if key in cmd:
            return want
    raise AssertionError(f"the README test does not know what to expect of: {cmd}")


@pytest.mark.slow
def test_readme_commands_run_in_order_in_one_directory_as_written(tmp_path):
    env = user_env()
    cmds = commands()
    assert len(cmds) >= 15, cmds
    ran, peaks, cpu = [], {}, {}
    for cmd, comment in cmds:
        assert comment, f"README command without a comment saying what it does: {cmd}"
        if cmd.startswith("export "):
            name, _, value = cmd.removeprefix("export ").partition("=")
            env[name] = value
            continue
        if skipped(cmd, comment):
            continue
        rc, out, peak, cpu[cmd] = run_measured(python_argv(cmd), tmp_path, env)
        assert rc == 0, f"{cmd}\nexit {rc}\n{out[-3000:]}"
        assert "Traceback" not in out, f"{cmd}\n{out[-3000:]}"
        for want in expectation(cmd):
            assert want in out, f"{cmd}: no {want!r} ({comment})\n{out[-3000:]}"
        ranks = int(option(cmd, "--nproc", "1"))
        peaks[cmd] = peak * ranks
        assert peak * ranks < MEMORY_LIMIT, \
            f"{cmd}: peak {peak / 2**30:.1f} GiB x {ranks} does not fit a 24 GB machine"
        if "launch" in cmd:
            assert "[1] done:" not in out and "[1] model:" not in out  # rank 0 alone prints
        ran.append(cmd)
    # The main job and every parallel form run; only installs, the tests and marked lines don't.
    assert ran[0] == "python3 -m gendist train", ran
    for key in ("generate --checkpoint", "--preset gpt2", "--mesh.pipeline 2",
                "--model.moe-experts 8", "--help", "plan", "launch", "export", "eval"):
        assert any(key in c for c in ran), f"no README line with {key!r} ran"
    for c in ran:  # shown with -s: what each line costs
        print(f"{peaks[c] / 2**30:5.2f} GiB peak {cpu[c]:6.1f} CPU-s  {c[:70]}")


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
        for topic in re.findall(r"run_gpu\.sh ([a-z0-9_]+)", text):
            assert topic in topics, f"{page.name}: run_gpu.sh has no topic {topic!r}"
        for name in re.findall(r"\b([\w.-]+\.(?:json|png))\b", text):
            assert (root / "benchmarks" / name).is_file() or "*" in name, \
                f"{page.name} cites {name}, which is not in benchmarks/"
