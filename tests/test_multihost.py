"""Multi-host training with real processes: 2 processes x 4 CPU devices (gloo) on localhost.

Oracles: the same run as 1 process x 8 devices in this pytest process (losses and the final
checkpoint), and the uninterrupted run for resumes. Failures are real SIGKILLed processes.
The 2-process run trains on token files written by `prepare` from the bundled corpus
(memory-mapped shards of 2^20 tokens, so windows straddle shards); the 1-process oracle
trains on the text itself, so equal losses also show that token files equal the text.
"""

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_trees_close as trees_close
from helpers import mesh_of, small_config

from gendist import distributed, launcher
from gendist.data.batches import rows_of_shards
from gendist.data.tokenfiles import prepare
from gendist.training import loop, train
from gendist.training.checkpoint import Checkpointer

WORKER = str(Path(__file__).with_name("multihost_worker.py"))
STEPS, EVERY = 6, 3
RTOL, ATOL = 1e-5, 1e-6  # fp32: gloo and in-process all-reduces may sum in another order
HEARTBEAT = 10  # s: GENDIST_HEARTBEAT_TIMEOUT for the failure tests


def launch(out, *worker_args, nproc=2, devices=4, timeout=240, env=None):
    cmd = [sys.executable, "-m", "gendist", "launch", "--nproc", str(nproc),
           "--devices-per-process", str(devices), "--", sys.executable, WORKER, str(out),
           *worker_args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    return r.returncode, r.stdout + r.stderr


def losses(out):
    rows = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}  # a rerun's rows win


def restore(out, setup, step=None):
    state, _, at = Checkpointer(Path(out) / "checkpoints").restore(setup.abstract_state(), step)
    return state, at


assert_trees_close = functools.partial(trees_close, rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """The bundled corpus as token files: 5 train shards of 2^20 bytes-as-uint16."""
    out = tmp_path_factory.mktemp("mh") / "tokens"
    meta = prepare((), "bytes", out, shard_tokens=1 << 20, progress=False)
    assert len(meta["train"]) == 5
    return out


@pytest.fixture(scope="module")
def two_process(tmp_path_factory, tokens):
    """2 processes x 4 devices, mesh data=4 x tensor=2, checkpoints at steps 3 and 6, on
    token files."""
    out = tmp_path_factory.mktemp("mh") / "two"
    rc, log = launch(out, "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
                     "--tokens", str(tokens))
    assert rc == 0, log[-4000:]
    return out, log


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The oracle: the same run as 1 process x 8 devices on the same mesh."""
    out = tmp_path_factory.mktemp("mh") / "one"
    cfg = small_config(str(out), steps=STEPS, checkpoint_every=EVERY)
    return out, loop.run(cfg, mesh=mesh_of(8, data=4, tensor=2), log=lambda *a: None)


def test_two_processes_equal_one_process(two_process, one_process):
    (two, log), (one, r1) = two_process, one_process
    assert "[0] process 0/2: 4 local of 8 devices; data: TokenStream" in log
    assert "[1] process 1/2: 4 local of 8 devices; data: TokenStream" in log
    a, b = losses(two), losses(one)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([a[s] for s in sorted(a)], [b[s] for s in sorted(b)],
                               rtol=RTOL)
    state, at = restore(two, r1.setup)
    assert at == STEPS
    assert_trees_close(state, r1.state)


def test_each_process_loads_only_its_rows(two_process):
    """Per-process rows assemble into the 1-process global batch, contiguous or interleaved."""
    two, _ = two_process
    reports = [json.loads((two / f"data_check_{p}.json").read_text()) for p in (0, 1)]
    for mesh in ("contiguous", "interleaved"):
        rows = [r[mesh]["rows"] for r in reports]
        assert all(r[mesh]["equal"] and r[mesh]["local_rows"] == 4 for r in reports), reports
        assert sorted(rows[0] + rows[1]) == list(range(8))
    assert reports[0]["interleaved"]["rows"] == [0, 1, 4, 5]  # data rows 0 and 2 of 4


def test_rows_of_shards_orders_spans():
    assert rows_of_shards([slice(4, 6), slice(0, 2), slice(0, 2)], 8).tolist() == [0, 1, 4, 5]
    assert rows_of_shards([slice(2, 4), slice(0, 2)], 8) == slice(0, 4)
    assert rows_of_shards([slice(None, None)], 8) == slice(0, 8)


def test_two_process_checkpoint_continues_on_one_process_other_mesh(two_process, one_process,
                                                                    tmp_path):
    (two, _), (one, r1) = two_process, one_process
    cont = tmp_path / "cont"
    shutil.copytree(two / "checkpoints", cont / "checkpoints")
    shutil.rmtree(cont / "checkpoints" / str(STEPS))  # as if stopped after step 3
    cfg = small_config(str(cont), steps=STEPS, checkpoint_every=EVERY)
    mesh = mesh_of(4, data=2, tensor=2)
    setup = train.build(cfg, mesh)
    got, at = restore(cont, setup)
    want, _ = restore(one, r1.setup, EVERY)
    assert at == EVERY and got["params"]["embed"].sharding.mesh.shape["data"] == 2
    assert_trees_close(got, want)
    r = loop.run(cfg, mesh=mesh, log=lambda *a: None)
    a, b = losses(cont), losses(one)
    assert sorted(a) == list(range(EVERY + 1, STEPS + 1))
    np.testing.assert_allclose([a[s] for s in sorted(a)], [b[s] for s in sorted(a)], rtol=RTOL)
    assert_trees_close(r.state, r1.state)


def start_pair(out, worker_args, env):
    """Two processes started by hand (not `launch`, which would stop the survivor itself)."""
    coord = f"127.0.0.1:{launcher.free_port()}"
    procs = []
    for rank in (0, 1):
        e = launcher.child_env(rank, 2, coord, 4, None)
        e.update(env, GENDIST_HEARTBEAT_TIMEOUT=str(HEARTBEAT), GENDIST_SHUTDOWN_TIMEOUT="10")
        procs.append(subprocess.Popen([sys.executable, WORKER, str(out), *worker_args], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def survivor_outcome(victim, survivor, limit):
    """(exit code, seconds it lived after the victim died, its output)."""
    try:
        victim.wait(timeout=240)
        died = time.monotonic()
        rc = survivor.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        for p in (victim, survivor):
            p.kill()
        pytest.fail(f"survivor still running {limit}s after its peer died:\n"
                    + survivor.communicate()[0][-3000:])
    return rc, time.monotonic() - died, survivor.communicate()[0]


def test_killed_process_ends_the_other_and_rerun_resumes(tmp_path, two_process, tokens):
    """Process 1 is SIGKILLed as it starts step 5 (after checkpoint 4): process 0 exits
    non-zero within the heartbeat timeout naming task 1; a rerun resumes from step 4 and
    continues exactly (token files: memory-mapped batches are a function of the step)."""
    out = tmp_path / "killed"
    args = ["--steps", str(STEPS), "--checkpoint-every", "2", "--tokens", str(tokens)]
    p0, p1 = start_pair(out, args, {"GENDIST_TEST_DIE_AT": "4", "GENDIST_TEST_DIE_RANK": "1"})
    rc, after, log = survivor_outcome(p1, p0, HEARTBEAT + 30)
    assert p1.returncode == -9
    assert rc != 0 and after < HEARTBEAT + 30, (rc, after)
    # XLA names the lost task "1" or "/job:jax_worker/replica:0/task:1", by version.
    assert re.search(r"[Tt]ask[ :]1\b[^\n]*heartbeat|stopped sending heartbeats\):\s*\S*1\b",
                     log), log[-3000:]
    # Which ends the survivor is a race: its collective with the dead peer fails (gendist's
    # handler names the last checkpoint), or it waits on a peer that never joins until the
    # coordination service's heartbeat check ends the process from C++ (no Python runs).
    ours = "a collective with the other processes failed" in log
    assert ours or "JAX distributed service detected fatal errors" in log, log[-3000:]
    assert not ours or "last complete checkpoint is step 4" in log, log[-3000:]
    assert Checkpointer(out / "checkpoints").latest_step() == 4
    rc, log = launch(out, *args)
    assert rc == 0, log[-4000:]
    assert re.search(r"\[0\] resumed from .* step 4", log), log[-3000:]
    a, b = losses(out), losses(two_process[0])
    assert sorted(a) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([a[s] for s in sorted(a)], [b[s] for s in sorted(b)], rtol=RTOL)
    setup = train.build(small_config(str(out)), mesh_of(8, data=4, tensor=2))
    assert_trees_close(restore(out, setup)[0], restore(two_process[0], setup)[0])


def test_killed_coordinator_ends_the_other(tmp_path):
    """Process 0 (the coordination service) dies: process 1 exits non-zero at once."""
    p0, p1 = start_pair(tmp_path, ["--collectives-only"],
                        {"GENDIST_TEST_DIE_AT": "5", "GENDIST_TEST_DIE_RANK": "0"})
    rc, after, log = survivor_outcome(p0, p1, HEARTBEAT + 30)
    assert p0.returncode == -9 and "tick 4: 8" in log
    assert rc != 0 and after < HEARTBEAT + 30, (rc, after)
    assert re.search(r"leader task|Failed to send RPC to coordination service", log), log[-3000:]


@pytest.mark.parametrize("rank", [0, 1])
def test_unreachable_coordinator_fails_within_init_timeout(rank):
    """Alone in a 2-process job: initialisation fails after GENDIST_INIT_TIMEOUT, naming
    the coordinator and the fix."""
    coord = f"127.0.0.1:{launcher.free_port()}"
    env = launcher.child_env(rank, 2, coord, 1, None)
    env.update(GENDIST_INIT_TIMEOUT="3")
    code = "from gendist import distributed; distributed.maybe_initialize()"
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and time.monotonic() - t < 40
    assert "DistributedError: could not join the multi-process job through coordinator " \
           f"{coord} as process {rank} of 2 within initialization_timeout=3s" in r.stderr, \
        r.stderr[-3000:]
    why = "not all 2 processes connected" if rank == 0 else f"nothing answers at {coord}"
    assert why in r.stderr, r.stderr[-3000:]


def test_launcher_prefixes_output_and_stops_the_rest_on_failure():
    code = ("import os, sys, time; r = int(os.environ['GENDIST_PROCESS_ID']); "
            "print('hi', r, os.environ['GENDIST_NUM_PROCESSES'], os.environ['XLA_FLAGS'], "
            "flush=True); time.sleep(0.5); sys.exit(3) if r == 1 else time.sleep(120)")
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "gendist", "launch", "--nproc", "2",
                        "--devices-per-process", "3", "--", sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and time.monotonic() - t < 30, r
    lines = r.stdout.splitlines()
    for rank in (0, 1):  # the launcher replaces the device count and keeps the other flags
        head = f"[{rank}] hi {rank} 2 "
        flags = next((line[len(head):].split() for line in lines if line.startswith(head)), None)
        assert flags is not None, lines
        assert flags[-1] == "--xla_force_host_platform_device_count=3", flags
        assert sum(f.startswith("--xla_force_host_platform_device_count") for f in flags) == 1
        assert set(os.environ["XLA_FLAGS"].split()) - set(flags) <= {
            f for f in os.environ["XLA_FLAGS"].split() if "device_count" in f}, flags
    assert "[launch] process 1 exited with code 3; stopping the other 1" in lines


def test_launcher_returns_zero_and_rejects_bad_options():
    ok = subprocess.run([sys.executable, "-m", "gendist", "launch", "--nproc", "2", "--",
                         sys.executable, "-c", "print('ok')"], capture_output=True, text=True,
                        timeout=60)
    assert ok.returncode == 0 and sorted(ok.stdout.split("\n")[:2]) == ["[0] ok", "[1] ok"]
    bad = subprocess.run([sys.executable, "-m", "gendist", "launch", "--nproc", "two", "--",
                          "true"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--nproc" in bad.stderr and "'two'" in bad.stderr


def test_watchdog_ends_a_stuck_process():
    code = ("import time; from gendist.supervise import Watchdog\n"
            "with Watchdog(1.0) as w:\n    w.beat('step 3')\n    time.sleep(30)")
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 3 and time.monotonic() - t < 20
    assert "no progress for" in r.stderr and "after step 3" in r.stderr


def test_config_and_detection():
    cfg = distributed.DistributedConfig.from_env({
        "GENDIST_COORDINATOR": "h:1", "GENDIST_NUM_PROCESSES": "4", "GENDIST_PROCESS_ID": "3",
        "GENDIST_LOCAL_DEVICE_IDS": "0,1", "GENDIST_HEARTBEAT_TIMEOUT": "7"})
    assert (cfg.num_processes, cfg.process_id, cfg.local_device_ids, cfg.heartbeat_timeout) \
        == (4, 3, (0, 1), 7)
    with pytest.raises(ValueError, match="process_id=4 must lie in"):
        distributed.DistributedConfig("h:1", 4, 4)
    with pytest.raises(ValueError, match="together"):
        distributed.DistributedConfig(coordinator_address="h:1")
    with pytest.raises(ValueError, match="needs a port"):
        distributed.DistributedConfig("h", 2, 0)
    with pytest.raises(ValueError, match="GENDIST_NUM_PROCESSES='x' must be an integer"):
        distributed.DistributedConfig.from_env({"GENDIST_NUM_PROCESSES": "x"})
    slurm = {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0"}
    assert distributed.detect({**slurm, "SLURM_NTASKS": "16"}) == "slurm"
    assert distributed.detect({**slurm, "SLURM_NTASKS": "1"}) is None
    assert distributed.detect({"OMPI_COMM_WORLD_SIZE": "2"}) == "ompi"
    assert distributed.detect({"GENDIST_PROCESS_ID": "0"}) == "gendist"
    assert distributed.detect({}) is None
    env = launcher.child_env(1, 2, "h:1", None, 4, base={})
    assert env["GENDIST_LOCAL_DEVICE_IDS"] == "4,5,6,7" and "XLA_FLAGS" not in env
    assert not distributed.maybe_initialize(environ={})  # a plain single-process run
