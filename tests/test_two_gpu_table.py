"""experiments/two_gpu_table.py on simulated CPU devices: every row runs in its own process
and reports tokens/s, a two-device row its fraction of twice its one-device row, and
`plan`'s predicted communication (ring rows: collective-permutes; expert rows: all-to-alls);
JSON and PNG are written. Three of the eight rows (each row is a process that compiles a
train step, unoptimised as the rest of the suite: ~11 s on a 2-core CPU; the whole tiny table
took ~3 min there with optimised codegen)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_two_gpu_table_runs_tiny_on_cpu(tmp_path):
    cmd = [sys.executable, str(ROOT / "experiments" / "two_gpu_table.py"), "--preset", "tiny", "--moe-preset", "",
           "--cpu", "--steps", "1", "--warmup", "1", "--batch", "4", "--moe-batch", "2",
           "--timeout", "120", "--out", str(tmp_path),
           "--rows", "one_gpu", "tp2_collective", "moe_ep2",
           "--set", "model.num_layers=2", "train.seq_len=32"]
    # --cpu keeps tests/conftest.py's XLA_FLAGS (unoptimised codegen) beside each row's device count
    subprocess.run(cmd, check=True, timeout=600, capture_output=True)
    res = json.loads((tmp_path / "two_gpu_table.json").read_text())
    rows = {r["row"]: r for r in res["rows"]}
    assert len(rows) == 3 and all("tokens_per_s" in r for r in rows.values()), [
        (r["row"], r.get("error", "")[-300:]) for r in rows.values() if "tokens_per_s" not in r]
    assert "vs_2x" not in rows["one_gpu"] and rows["tp2_collective"]["vs_2x"] > 0
    kinds = lambda name: {c["kind"] for c in rows[name]["predicted"]["comm"]}
    assert "collective-permute" in kinds("tp2_collective")
    assert "all-to-all" in kinds("moe_ep2") and not kinds("one_gpu")
    assert rows["tp2_collective"]["overrides"][-1] == "train.batch_size=8"  # 2 x one GPU's
    assert (tmp_path / "two_gpu_table.png").stat().st_size > 0
