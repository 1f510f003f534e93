"""Which decode path does `python -m gendist generate` take by default, and how fast is each?

Runs the command line as a user would, once per preset and decode path (random weights,
`--preset NAME`, greedy, batch 1), and records the path line the front door prints
(`gendist.inference.decoder`), the decode speed the command reports (tokens/s, compile time
apart) and how many generated characters agree with the `auto` path's (greedy; bf16 paths
can part after a near-tie):

    python3 experiments/decode_paths.py --out benchmarks                 # a GPU machine
    python3 experiments/decode_paths.py --presets tiny --tokens 16       # CPU: the code path

On an H200, `auto` should read "decode: megakernel (batch 1, ...)" for the dense presets.
Writes decode_paths_<device>.json to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

SPEED = re.compile(r"decode: (\d+) tokens in ([\d.]+) s, ([\d.]+) tokens/s .*compiled in ([\d.]+) s")


def run(preset: str, path: str, tokens: int, prompt: str) -> dict:
    cmd = [sys.executable, "-m", "gendist", "generate", "--preset", preset, "--prompt", prompt,
           "--generate.path", path, "--generate.max-new-tokens", str(tokens),
           "--generate.temperature", "0"]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    row = {"preset": preset, "path": path, "command": " ".join(["python3"] + cmd[1:]),
           "exit": r.returncode, "wall_s": round(time.perf_counter() - t, 1)}
    lines = (r.stdout + r.stderr).splitlines()
    row["path_line"] = next((ln for ln in lines if ln.startswith("decode: ") and "tokens/s" not in ln), "")
    m = next((SPEED.search(ln) for ln in lines if SPEED.search(ln)), None)
    if m:
        row.update(tokens=int(m[1]), seconds=float(m[2]), tokens_per_s=float(m[3]),
                   compile_s=float(m[4]))
    row["text"] = r.stdout.split(prompt, 1)[-1] if prompt in r.stdout else ""
    if r.returncode:
        row["error"] = "\n".join(lines[-5:])
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["350m", "1b"])
    ap.add_argument("--paths", nargs="+", default=["auto", "megakernel", "fast", "reference"])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt", default="KING HENRY:")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import jax

    from gendist.timing import result_path

    rows = []
    for preset in args.presets:
        for path in args.paths:
            row = run(preset, path, args.tokens, args.prompt)
            rows.append(row)
            print(f"{preset:>6} {path:>10}: {row.get('tokens_per_s', float('nan')):8.1f} tokens/s "
                  f"| {row['path_line'] or row.get('error', '')}", flush=True)
    for preset in args.presets:
        ref = next((r["text"] for r in rows if r["preset"] == preset and r["path"] == "auto"), "")
        for r in rows:
            if r["preset"] == preset and ref:
                n = next((i for i, (a, b) in enumerate(zip(r["text"], ref, strict=False)) if a != b),
                         min(len(r["text"]), len(ref)))
                r["chars_equal_to_auto_before_first_difference"] = n
    out = result_path(args.out, "decode_paths")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                               "tokens": args.tokens, "rows": rows}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
