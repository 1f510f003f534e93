"""`bench_train.py` with the Mosaic GPU FlashAttention's default tiles replaced (issue 20): the
1b step with our attention on other grids, without a training-config field for kernel tiles.

    python3 experiments/bench_train_blocks.py persistent=False persistent_dq=False -- \
        --presets 1b --steps 6 --set train.batch_size=24 model.attention=pallas --out $OUT --tag _1b_grid

Each KEY=VALUE before `--` (True/False/None or an int) replaces that `MosaicBlockSizes` field
in the defaults `flash_attention` takes when no block sizes are given.
"""
from __future__ import annotations

import ast
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_train  # noqa: E402

from pallas_kernels.flash_attention_mgpu import MosaicBlockSizes  # noqa: E402


def main():
    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit("usage: bench_train_blocks.py KEY=VALUE ... -- BENCH_TRAIN_ARGS")
    cut = argv.index("--")
    fields = {f.name for f in dataclasses.fields(MosaicBlockSizes)}
    changes = {}
    for pair in argv[:cut]:
        key, _, value = pair.partition("=")
        if key not in fields:
            raise SystemExit(f"{key!r} is not a MosaicBlockSizes field; choose from {sorted(fields)}")
        changes[key] = ast.literal_eval(value)
    defaults = MosaicBlockSizes.for_head_dim.__func__

    def for_head_dim(cls, head_dim):
        return dataclasses.replace(defaults(cls, head_dim), **changes)

    MosaicBlockSizes.for_head_dim = classmethod(for_head_dim)
    print("MosaicBlockSizes defaults replaced:", changes, flush=True)
    sys.argv = [sys.argv[0], *argv[cut + 1:]]
    bench_train.main()


if __name__ == "__main__":
    main()
