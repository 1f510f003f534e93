"""The batch-1 decode megakernel: every layer of a decode step in one persistent Mosaic GPU
kernel (Hopper, sm90).

    call.py       its entry point (`chain_mgpu`): options, the kept state, the results
    kernel.py     the kernel itself
    resolve.py    a call's inputs checked and its options resolved for the shape, and the
                  shared memory it takes
    xla.py        its math in XLA (`reference`) and the RMSNorm gains folded into the
                  weights it reads (`fold_norms`)
    attention.py  its attention phase: one block a head, between q|k|v and the output product
    plan.py       the decomposition, the word layout and the input wiring (plain Python)
    words.py      the inline-PTX movers of the low-latency words between phases

`gendist.inference.megakernel` decodes through it.
"""

from pallas_kernels.chain.call import chain_mgpu
from pallas_kernels.chain.xla import fold_norms, reference

__all__ = ["chain_mgpu", "fold_norms", "reference"]
