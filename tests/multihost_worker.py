"""One process of a multi-process test job (started by tests/test_multihost.py).

    python -m gendist launch --nproc 2 --devices-per-process 4 -- \
        python tests/multihost_worker.py OUT_DIR --steps 6 --checkpoint-every 3 [--tokens DIR]

Joins the job (gendist.distributed), checks that per-process batches assemble into the
global batch on a contiguous and an interleaved mesh, then trains the small test model on
a data=4 x tensor=2 mesh through gendist.training.loop.run, on the bundled text or, with --tokens, on
token files from `prepare` (memory-mapped; each process reads only its rows' windows). GENDIST_TEST_DIE_AT=S makes process
GENDIST_TEST_DIE_RANK (default 1) SIGKILL itself when it starts step S (or tick S of
--collectives-only, a model-free loop of all-reduces).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from gendist import distributed  # noqa: E402

distributed.maybe_initialize()  # before anything touches a JAX backend

import jax  # noqa: E402
import numpy as np  # noqa: E402
from helpers import small_config  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from gendist.config import MeshConfig  # noqa: E402
from gendist.data.batches import TextData, process_rows, shard_batch  # noqa: E402
from gendist.sharding import MESH_AXES, make_mesh  # noqa: E402
from gendist.training import loop  # noqa: E402


class DyingData(TextData):
    """TextData whose process `rank` is SIGKILLed when the loop asks for step `at`."""

    die_at: int = -1
    die_rank: int = 1

    def global_batch(self, step, batch_size, seq_len, split="train", rows=None):
        if split == "train" and step == self.die_at and jax.process_index() == self.die_rank:
            print(f"dying at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().global_batch(step, batch_size, seq_len, split, rows)


def interleaved_mesh(data: int, tensor: int) -> Mesh:
    """data x tensor mesh whose data rows alternate between processes (rows 0, 2 on p0)."""
    by_proc = [[d for d in jax.devices() if d.process_index == p]
               for p in range(jax.process_count())]
    per_row = [by_proc[r % len(by_proc)][(r // len(by_proc)) * tensor:
                                         (r // len(by_proc) + 1) * tensor] for r in range(data)]
    arr = np.array(per_row).reshape(data, 1, 1, tensor)
    return Mesh(arr, MESH_AXES)


def check_batches(data: TextData, batch_size: int, seq_len: int) -> dict:
    """Assemble step 7's batch from per-process rows on two meshes; compare to the global one."""
    want = data.global_batch(7, batch_size, seq_len)
    report = {}
    for name, mesh in (("contiguous", make_mesh(MeshConfig(data=4, tensor=2))),
                       ("interleaved", interleaved_mesh(4, 2))):
        rows = process_rows(mesh, batch_size)
        local = data.global_batch(7, batch_size, seq_len, rows=rows)
        arr = shard_batch(local, mesh, batch_size)["inputs"]
        got = multihost_utils.process_allgather(arr, tiled=True)
        report[name] = {
            "rows": np.arange(batch_size)[rows].tolist(),
            "local_rows": int(local["inputs"].shape[0]),
            "equal": bool(np.array_equal(got, want["inputs"])),
        }
    return report


def collectives_only(die_at: int, die_rank: int) -> int:
    """All-reduce a small array every 0.2 s (no model): the cheapest job a peer can leave."""
    mesh = make_mesh(MeshConfig(data=-1))
    n = jax.device_count()
    local = np.ones((n, 1), np.int32)[process_rows(mesh, n)]
    x = shard_batch({"x": local}, mesh, n)["x"]
    total = jax.jit(lambda x: x.sum())
    for tick in range(600):
        if tick == die_at and jax.process_index() == die_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        print(f"tick {tick}: {int(total(x))}", flush=True)
        time.sleep(0.2)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--checkpoint-every", type=int, default=3)
    ap.add_argument("--collectives-only", action="store_true")
    ap.add_argument("--tokens", default="", help="a `prepare` folder to train on")
    args = ap.parse_args()
    die_at = int(os.environ.get("GENDIST_TEST_DIE_AT", "-1"))
    die_rank = int(os.environ.get("GENDIST_TEST_DIE_RANK", "1"))
    if args.collectives_only:
        return collectives_only(die_at, die_rank)
    cfg = small_config(args.out, steps=args.steps, checkpoint_every=args.checkpoint_every)
    data = DyingData.from_token_files(args.tokens) if args.tokens else \
        DyingData.from_config(cfg.data)
    data.die_at, data.die_rank = die_at, die_rank
    pid = jax.process_index()
    print(f"process {pid}/{jax.process_count()}: {jax.local_device_count()} local of "
          f"{jax.device_count()} devices; data: {type(data.train).__name__}", flush=True)
    report = check_batches(data, cfg.train.batch_size, cfg.train.seq_len)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"data_check_{pid}.json").write_text(json.dumps(report))
    mesh = make_mesh(MeshConfig(data=4, tensor=2))
    loop.run(cfg, mesh=mesh, data=data, log=lambda m: print(m, flush=True))
    print(f"process {pid}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
