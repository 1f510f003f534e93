"""Stopping on SIGTERM/SIGINT with a checkpoint, resuming exactly, and the run directory:
metrics without duplicates, wall-clock checkpoints, refused runs that change nothing.

Real processes receive real signals: `python -m gendist train` (alone and as two processes
of a `launch`), a loop whose data source blocks (for the second signal). Oracles: the same
config trained without interruption (bitwise equal losses and final state).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import mesh_of, small_config

from gendist import config_yaml
from gendist.cli.main import main
from gendist.data.batches import TextData
from gendist.training import loop, train
from gendist.training.checkpoint import Checkpointer

STEPS, EVERY = 50, 10  # train steps, checkpoint interval of the signalled runs
GENDIST = [sys.executable, "-m", "gendist"]


@pytest.fixture(scope="module")
def data():
    return TextData.from_config(small_config().data)


def records(out) -> list[dict]:
    return [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]


def losses(out) -> dict[int, float]:
    """step -> loss, asserting that metrics.jsonl holds each step once."""
    steps = [r["step"] for r in records(out) if "loss" in r]
    assert len(steps) == len(set(steps)), f"duplicate metrics records: {sorted(steps)}"
    return {r["step"]: r["loss"] for r in records(out) if "loss" in r}


def train_command(tmp_path, out, **train_kw) -> list[str]:
    """`gendist train` of the small test model, through a saved config (as `--config`)."""
    path = tmp_path / f"{Path(out).name}.yaml"
    config_yaml.save(small_config(str(out), **train_kw), path)
    return [*GENDIST, "train", "--config", str(path), "--no-sample"]


def wait_for_step(out, step: int, proc, timeout: float = 120.0) -> None:
    """Until metrics.jsonl shows `step` (the run is mid-way), or fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before step {step}"
        path = Path(out) / "metrics.jsonl"
        if path.is_file() and any(f'"step": {step},' in line for line in open(path)):
            return
        time.sleep(0.02)
    proc.kill()
    pytest.fail(f"no step {step} in {out}/metrics.jsonl after {timeout}s")


def final_state_equal(out, result) -> None:
    state, _, step = Checkpointer(Path(out) / "checkpoints").restore(
        result.setup.abstract_state())
    assert step == STEPS
    for x, y in zip(jax.tree.leaves(result.state), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


STOPPED = (r"stopped by {sig} at step (\d+) of {steps}; checkpoint of step \1 saved in "
           r"(\S+); run the same command again to resume\.")


def test_sigterm_checkpoints_the_step_reached_and_resumes_exactly(tmp_path, data):
    straight = loop.run(small_config(str(tmp_path / "straight"), steps=STEPS,
                                     checkpoint_every=EVERY), data=data, log=lambda *a: None)
    out = tmp_path / "run"
    cmd = train_command(tmp_path, out, steps=STEPS, checkpoint_every=EVERY)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(out, EVERY + 2, proc)
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 143, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    m = re.fullmatch(r"python -m gendist train: " + STOPPED.format(sig="SIGTERM", steps=STEPS),
                     last)
    assert m, stderr[-3000:]
    reached, where = int(m[1]), m[2]
    assert EVERY < reached < STEPS and Path(where) == out / "checkpoints"
    assert Checkpointer(out / "checkpoints").latest_step() == reached
    assert max(losses(out)) == reached  # the checkpoint holds the last step that ran

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints'} step {reached}" in again.stdout
    a, b = losses(out), losses(tmp_path / "straight")
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert [a[s] for s in sorted(a)] == [b[s] for s in sorted(b)]  # bitwise equal losses
    final_state_equal(out, straight)


def child_of(parent: int, rank: int) -> int:
    """The pid of process `rank` among the children `launch` (pid `parent`) started."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"\nPPid:\t{parent}\n" in status and f"GENDIST_PROCESS_ID={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no process {rank} under launch (pid {parent})")


def launch_command(cmd: list[str]) -> list[str]:
    return [*GENDIST, "launch", "--nproc", "2", "--devices-per-process", "2", "--", *cmd]


def test_sigterm_to_one_process_stops_the_job_at_one_step(tmp_path):
    """Only process 1 gets SIGTERM: both processes checkpoint the same step and exit 143,
    and so does `launch`; rerunning resumes and ends bitwise equal to an uninterrupted job
    (run alongside)."""
    out, ref = tmp_path / "job", tmp_path / "ref"
    cmd = launch_command(train_command(tmp_path, out, steps=STEPS, checkpoint_every=EVERY))
    whole = launch_command(train_command(tmp_path, ref, steps=STEPS, checkpoint_every=EVERY))
    straight = subprocess.Popen(whole, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_step(out, EVERY + 2, proc)
    os.kill(child_of(proc.pid, 1), signal.SIGTERM)
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143, log[-3000:]
    said = {rank: re.search(rf"\[{rank}\] python -m gendist train: "
                            + STOPPED.format(sig="SIGTERM", steps=STEPS), log)
            for rank in (0, 1)}
    assert said[0] and said[1], log[-3000:]
    reached = int(said[0][1])
    assert int(said[1][1]) == reached and EVERY < reached < STEPS, log[-3000:]
    assert "[1] gendist: SIGTERM: saving a checkpoint" in log
    assert "[0] gendist: SIGTERM" not in log  # process 0 stopped by agreement alone
    assert Checkpointer(out / "checkpoints").latest_step() == reached
    assert max(losses(out)) == reached

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"[0] resumed from {out / 'checkpoints'} step {reached}" in again.stdout
    assert straight.wait(timeout=300) == 0, straight.communicate()[0][-3000:]
    a, b = losses(out), losses(ref)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert [a[s] for s in sorted(a)] == [b[s] for s in sorted(b)]  # bitwise equal losses
    setup = train.build(small_config(), mesh_of(4, data=4))
    got, _, at = Checkpointer(out / "checkpoints").restore(setup.abstract_state())
    want, _, _ = Checkpointer(ref / "checkpoints").restore(setup.abstract_state())
    assert at == STEPS
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_launch_relays_a_signal_and_waits_for_its_processes(tmp_path):
    """SIGTERM to `launch` reaches every process (each in its own session); launch waits
    for them to finish stopping instead of killing them, and exits with their code."""
    code = textwrap.dedent("""
        import os, signal, sys, time
        got = []
        signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
        print("ready", flush=True)
        while not got:
            time.sleep(0.01)
        time.sleep(1.0 + float(os.environ["GENDIST_PROCESS_ID"]))  # saving takes a while
        print("stopped on", got[0], flush=True)
        sys.exit(143)
    """)
    proc = subprocess.Popen([*GENDIST, "launch", "--nproc", "2", "--", sys.executable, "-c",
                             code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    while len([line for line in lines if "ready" in line]) < 2:
        lines.append(proc.stdout.readline())
        assert lines[-1], lines
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 143, rest
    assert "[0] stopped on 15" in rest and "[1] stopped on 15" in rest, rest


SLOW_LOOP = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from helpers import mesh_of, small_config
    from gendist.data.batches import TextData
    from gendist.training import loop, train

    class Slow(TextData):  # step 5's batch takes a minute: no step boundary soon
        def global_batch(self, step, *args, **kw):
            if step == 5:
                print("in step 5", flush=True)
                time.sleep(60)
            return super().global_batch(step, *args, **kw)

    cfg = small_config({out!r}, steps=20, checkpoint_every=2)
    loop.run(cfg, data=Slow.from_config(cfg.data), log=lambda *a: None)
""")


def test_a_second_sigint_stops_at_once(tmp_path):
    out = tmp_path / "run"
    code = SLOW_LOOP.format(tests=str(Path(__file__).parent), out=str(out))
    err = open(tmp_path / "stderr", "w+")  # noqa: SIM115 - read while the process runs
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err,
                            text=True)
    assert proc.stdout.readline() == "in step 5\n"
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 30
    while "saving a checkpoint at the next step boundary" not in Path(err.name).read_text():
        assert time.monotonic() < deadline and proc.poll() is None, Path(err.name).read_text()
        time.sleep(0.02)
    t = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=30)
    said = Path(err.name).read_text()
    assert rc == 130 and time.monotonic() - t < 10, said
    assert (f"gendist: second SIGINT: stopping now without saving; the last complete "
            f"checkpoint is step 4 in {out / 'checkpoints'}.") in said, said
    assert Checkpointer(out / "checkpoints").all_steps() == [2, 4]


def test_resume_drops_metrics_records_after_the_checkpoint(tmp_path, data):
    """Killed after step 8 with the last checkpoint at 5 (and a record cut short): the
    rerun resumes at 5 and metrics.jsonl holds each step once, in order."""
    cfg = small_config(str(tmp_path), steps=12, checkpoint_every=5)
    loop.run(cfg, data=data, stop_after=8, log=lambda *a: None)
    shutil.rmtree(tmp_path / "checkpoints" / "8")  # as if killed before checkpointing 8
    before = [r for r in records(tmp_path) if r["step"] <= 5]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "lo')
    loop.run(cfg, data=data, log=lambda *a: None)
    after = records(tmp_path)
    assert [r["step"] for r in after if "loss" in r] == list(range(1, 13))
    assert after[:len(before)] == before  # the records up to the checkpoint kept as they were
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_wall_clock_interval_checkpoints_between_step_intervals(tmp_path, data):
    cfg = small_config(str(tmp_path), steps=10, checkpoint_every=4, keep_checkpoints=100,
                       checkpoint_every_minutes=0.001)  # 0.06 s
    loop.run(cfg, data=data, log=lambda *a: None)
    steps = Checkpointer(tmp_path / "checkpoints").all_steps()
    timed = [s for s in steps if s % 4 and s != 10]
    assert timed, steps  # saved on the clock, not on the step interval


@pytest.mark.parametrize("minutes", [-1.0, float("nan")])
def test_wall_clock_interval_is_checked(minutes):
    with pytest.raises(ValueError, match=r"^train\.checkpoint_every_minutes=(-1\.0|nan) must "
                                         r"be .*>= 0.*; pass --train\.checkpoint-every-minutes"):
        small_config(checkpoint_every_minutes=minutes)


def snapshot(directory: Path) -> dict:
    """Every path under `directory` with its bytes (files) and modification time."""
    return {p.relative_to(directory): (p.read_bytes() if p.is_file() else None,
                                       p.stat().st_mtime_ns) for p in directory.rglob("*")}


def test_steps_below_the_step_reached_are_refused(tmp_path, data, capsys):
    out = tmp_path / "run"
    loop.run(small_config(str(out), steps=6), data=data, log=lambda *a: None)
    before = snapshot(out)
    capsys.readouterr()
    assert main(train_command(tmp_path, out, steps=4)[3:]) == 2  # `gendist train ...`
    assert capsys.readouterr().err.splitlines() == [
        f"python -m gendist train: error: train.steps=4 is below step 6, which the run in {out} "
        f"has reached; pass --train.steps 6 or more to continue it, or start a new run with "
        f"--train.out-dir {out}-2."]
    assert snapshot(out) == before


def test_run_twice_returns_the_history_both_times(tmp_path, data):
    cfg = small_config(str(tmp_path), steps=6, eval_every=3, log_every=2)
    first = loop.run(cfg, data=data, log=lambda *a: None)
    said = []
    second = loop.run(cfg, data=data, log=said.append)
    assert any("nothing to train" in line for line in said), said
    logged = [h for h in first.history if (h["step"] + 1) % 2 == 0]
    assert [h["step"] for h in second.history] == [h["step"] for h in logged] == [1, 3, 5]
    assert [h["loss"] for h in second.history] == [h["loss"] for h in logged]
    assert second.val_loss == first.val_loss is not None
    assert second.history[-1]["loss"] == first.history[-1]["loss"]


class EmptyData(TextData):
    """Data that fails when the first batch is drawn (after the run directory exists)."""

    def global_batch(self, step, *args, **kw):
        raise ValueError("data.corpus holds no training text; point it at a file with text.")


def test_a_refused_run_takes_back_what_it_made(tmp_path, data):
    empty = EmptyData.from_config(small_config().data)
    new = tmp_path / "runs" / "new"
    with pytest.raises(ValueError, match="no training text"):
        loop.run(small_config(str(new), steps=3), data=empty, log=lambda *a: None)
    assert not (tmp_path / "runs").exists()  # and the parent it created
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="no training text"):
        loop.run(small_config(str(mine), steps=3), data=empty, log=lambda *a: None)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert (mine / "notes.txt").read_text() == "mine"
