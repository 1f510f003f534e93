"""FlashAttention (Pallas) against the pure-jnp reference: outputs and dq, dk, dv.

Triton kernels: interpret mode on CPU, compiled when a GPU is present (same cases). Mosaic
GPU kernels (`flash_attention_mgpu`): a few small cases through Mosaic GPU's interpreter on
CPU (it simulates every warpgroup, so it is slow), the whole shape suite in bf16 and fp16
compiled on an sm90 GPU. Each case is one compile of forward + backward; on CPU the program
is compiled at XLA optimisation level 0, which only shortens the compile.
"""
import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._mgpu import detecting_races, on_sm90
from pallas_kernels.flash_attention import (
    BlockSizes,
    SegmentIds,
    flash_attention,
    mha_reference,
    pick_implementation,
)
from pallas_kernels.flash_attention_mgpu import MosaicBlockSizes, flash_attention_mgpu
from pallas_kernels.flash_attention_mgpu_bwd import backward_dkv, backward_dq, backward_dq_from_ds
from pallas_kernels.flash_attention_mgpu_common import MosaicConfig, producer_regs

ON_GPU = jax.default_backend() == "gpu"


def interpreter_races_found() -> bool:
    """Whether the last kernel that Mosaic GPU's interpreter ran with race detection found a
    race (its state lives in jax's private interpreter module)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    return bool(interpret_pallas_call.get_races().races_found)
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
SMALL = BlockSizes(16, 16, 16, 16, 16, 16)  # many tiles per sequence: every loop runs
MIXED = BlockSizes(32, 16, 16, 32, 32, 16)
MIXED_T = BlockSizes(16, 32, 32, 16, 16, 32)
# Long cases: big tiles keep interpret mode fast on CPU; on a GPU the tuned defaults apply.
LONG = None if ON_GPU else BlockSizes(128, 128, 128, 128, 128, 128)
LONG_KV = None if ON_GPU else BlockSizes(16, 128, 16, 128, 16, 128)


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / (denom if denom > 0 else 1.0))


def normal(rng, shape, dtype):
    # Host-side random numbers: no per-shape device compile, which dominates on CPU.
    return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)


def make_segments(kind, rng, b, t, s):
    if kind is None:
        return None
    if kind == "random":  # sorted ids in [0, 3): some query segments may have no keys at all
        return SegmentIds(jnp.asarray(np.sort(rng.integers(0, 3, (b, t)), axis=1)),
                          jnp.asarray(np.sort(rng.integers(0, 3, (b, s)), axis=1)))
    if kind == "padding":  # batch row r has its last 7 * (r + 1) tokens as padding (id 0)
        ids = jnp.asarray(np.arange(t)[None] < t - 7 * (np.arange(b)[:, None] + 1), jnp.int32)
        return SegmentIds(ids, ids)
    if kind == "orphan":  # query segment 5 exists in no key: those rows must give exactly 0
        q = np.where(np.arange(t) % 4 == 0, 5, 1)[None].repeat(b, 0)
        return SegmentIds(jnp.asarray(q, jnp.int32), jnp.ones((b, s), jnp.int32))
    raise ValueError(kind)


# (batch, q_len, kv_len, q_heads, kv_heads, head_dim, causal, dtype, q_offset, segments, blocks)
CASES = [
    (1, 1, 1, 2, 2, 32, False, F32, 0, None, None),
    (1, 1, 1, 2, 1, 64, True, F32, 0, None, None),
    (1, 17, 17, 2, 2, 64, False, F32, 0, None, None),
    (1, 17, 17, 4, 2, 64, True, F32, 0, None, None),
    (1, 17, 17, 2, 2, 128, True, BF16, 0, None, None),
    (1, 127, 127, 2, 2, 64, True, F32, 0, None, None),
    (2, 127, 127, 2, 1, 64, False, BF16, 0, None, None),
    (1, 129, 129, 2, 1, 64, False, F32, 0, None, None),
    (1, 129, 129, 4, 1, 64, True, BF16, 0, None, None),
    (1, 129, 127, 4, 2, 32, True, F32, 0, None, MIXED_T),
    (2, 64, 64, 4, 4, 128, False, F32, 0, None, None),
    (2, 64, 64, 4, 2, 128, True, BF16, 0, None, None),
    (1, 32, 32, 2, 1, 256, True, F32, 0, None, BlockSizes(16, 16, 16, 16, 16, 16)),
    (1, 48, 48, 2, 2, 256, False, BF16, 0, None, BlockSizes(16, 32, 16, 32, 16, 32)),
    (1, 100, 100, 2, 1, 64, True, F32, 0, None, SMALL),
    (1, 100, 130, 2, 2, 64, False, BF16, 0, None, MIXED),
    # q_len != kv_len: chunks of queries against a longer cache (decoding), cross attention.
    (1, 16, 128, 4, 4, 64, True, F32, 112, None, None),
    (1, 1, 129, 4, 1, 64, True, F32, 128, None, None),
    (1, 1, 77, 2, 2, 64, True, BF16, 50, None, None),
    (1, 17, 45, 4, 2, 32, True, F32, 28, None, SMALL),
    (1, 64, 256, 2, 2, 64, True, BF16, 192, None, None),
    (2, 33, 80, 4, 2, 64, False, F32, 0, None, None),
    (1, 80, 33, 2, 1, 64, False, BF16, 0, None, None),
    (1, 80, 33, 2, 2, 64, True, F32, 0, None, MIXED),
    (1, 17, 1000, 2, 1, 64, True, F32, 983, None, LONG_KV),
    (1, 1000, 1000, 1, 1, 64, True, BF16, 0, None, LONG),
    # Segment ids: packed sequences, padding, and rows that see no key at all.
    (1, 64, 64, 2, 2, 64, False, F32, 0, "random", None),
    (1, 64, 64, 4, 2, 64, True, BF16, 0, "random", SMALL),
    (1, 40, 70, 2, 1, 64, True, F32, 30, "random", None),
    (2, 100, 100, 2, 2, 64, True, F32, 0, "padding", MIXED),
    (1, 24, 40, 2, 2, 32, False, F32, 0, "orphan", None),
]


def case_id(case):
    b, t, s, n, k, h, causal, dtype, off, seg, blocks = case
    parts = [f"b{b}t{t}s{s}n{n}k{k}h{h}", "causal" if causal else "full", jnp.dtype(dtype).name]
    parts += [f"off{off}"] if off else []
    parts += [seg] if seg else []
    parts += [f"blk{blocks.block_q}x{blocks.block_k}"] if blocks else []
    return "-".join(parts)


def compile_and_run(fn, *args):
    lowered = jax.jit(fn).lower(*args)
    options = None if ON_GPU else {"xla_backend_optimization_level": 0}
    return lowered.compile(compiler_options=options)(*args)


def check_case(case, attention):
    """Output and the three gradients of `attention(q, k, v, blocks, **kw)` vs the reference."""
    b, t, s, n, kh, h, causal, dtype, q_offset, seg, blocks = case
    rng = np.random.default_rng(t * 1009 + s * 13 + n + h)
    q = normal(rng, (b, t, n, h), dtype)
    k = normal(rng, (b, s, kh, h), dtype)
    v = normal(rng, (b, s, kh, h), dtype)
    do = normal(rng, (b, t, n, h), dtype)
    segment_ids = make_segments(seg, rng, b, t, s)
    kw = dict(causal=causal, q_offset=q_offset, segment_ids=segment_ids)

    def ours(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, blocks, **kw), q, k, v)
        return (out, *vjp(do))

    def reference(q, k, v, do):  # fp32 math on the same (already rounded) inputs
        up = lambda x: x.astype(jnp.float32)
        out, vjp = jax.vjp(lambda q, k, v: mha_reference(q, k, v, **kw), up(q), up(k), up(v))
        return (out, *vjp(up(do)))

    got = compile_and_run(ours, q, k, v, do)
    want = compile_and_run(reference, q, k, v, do)
    for name, x, ref, like in zip(("out", "dq", "dk", "dv"), got, want, (q, q, k, v), strict=True):
        assert x.shape == like.shape and x.dtype == dtype, name
        assert np.all(np.isfinite(np.asarray(x, np.float32))), name
        err = rel_err(x, ref)
        assert err < TOL[dtype], f"{name}: relative error {err:.2e}"
    if seg == "orphan":  # rows with no visible key: exactly zero output and dq
        rows = np.asarray(segment_ids.q[0] == 5)
        assert np.all(np.asarray(got[0])[:, rows] == 0) and np.all(np.asarray(got[1])[:, rows] == 0)


class TestFlashAttention:
    INTERPRET = not ON_GPU

    @pytest.mark.parametrize("case", CASES, ids=case_id)
    def test_forward_and_gradients_match_reference(self, case):
        check_case(case, lambda q, k, v, blocks, **kw: flash_attention(
            q, k, v, block_sizes=blocks, interpret=self.INTERPRET, implementation="triton", **kw))

    def test_traced_q_offset_compiles_once(self):
        # A decode loop passes its position as a traced scalar; no recompile per position.
        b, t, s, n, h = 1, 8, 64, 2, 64
        rng = np.random.default_rng(3)
        q = normal(rng, (b, t, n, h), F32)
        k = normal(rng, (b, s, n, h), F32)
        v = normal(rng, (b, s, n, h), F32)
        # The first interpreted Pallas call imports jax modules that register one more config
        # option, which changes jit's trace context once (a retrace that is jax's, not the
        # kernel's; the suite hid it when an earlier test had made that call): make it here.
        flash_attention(q, k, v, causal=True, q_offset=0, interpret=self.INTERPRET)

        @jax.jit
        @chex.assert_max_traces(n=1)
        def attend(q, k, v, offset):
            return flash_attention(q, k, v, causal=True, q_offset=offset,
                                   interpret=self.INTERPRET)

        for offset in (40, 56):
            out = attend(q, k, v, jnp.int32(offset))
            ref = mha_reference(q, k, v, causal=True, q_offset=offset)
            assert rel_err(out, ref) < TOL[F32]

    def test_custom_sm_scale(self):
        rng = np.random.default_rng(4)
        q, k, v = (normal(rng, (1, 20, 2, 32), F32) for _ in range(3))
        out = flash_attention(q, k, v, sm_scale=0.3, interpret=self.INTERPRET)
        assert rel_err(out, mha_reference(q, k, v, sm_scale=0.3)) < TOL[F32]
        # And the scale matters: the default 1/sqrt(32) gives a different answer.
        assert rel_err(out, mha_reference(q, k, v)) > 1e-2


# Mosaic GPU kernels. On CPU, three small cases in the interpreter (P and dS staged through
# shared memory, the one path it runs): ragged lengths with the length mask, GQA with the
# in-kernel dK/dV group sum, causal with an offset, segment ids, both head dims and dtypes.
MOSAIC_INTERPRET = [
    (1, 100, 130, 4, 2, 64, False, BF16, 0, None, None),
    (1, 40, 170, 2, 1, 128, True, F16, 130, None, None),
    (1, 64, 64, 4, 2, 64, True, BF16, 0, "random", None),
]


def _mosaic_gpu_cases():
    """On the GPU: every suite case with head dim 64/128 in bf16 (fp32 cases as bf16 and
    fp16 in turn), the kernels' default tiles, plus the interpreter's cases."""
    cases = []
    for i, (b, t, s, n, kh, h, causal, dtype, off, seg, _) in enumerate(CASES):
        if h in (64, 128):
            dtype = dtype if dtype != F32 else (BF16, F16)[i % 2]
            cases.append((b, t, s, n, kh, h, causal, dtype, off, seg, None))
    orphan = (1, 24, 40, 2, 2, 64, False, BF16, 0, "orphan", None)  # rows that see no key
    return cases + MOSAIC_INTERPRET + [orphan]


def _assert_backward_forms_bitwise_equal(seed: int, batch: int, q_len: int, kv_len: int,
                                         forms: list[dict], **kw):
    """The two-kernel backward in each form of `forms` (MosaicBlockSizes fields over the head
    dim 64 defaults) gives bitwise the same dQ, dK, dV on one draw (2 query heads on 1 kv
    head), and the last form matches the reference."""
    rng = np.random.default_rng(seed)
    q, k, v = (normal(rng, (batch, q_len, 2, 64), BF16), normal(rng, (batch, kv_len, 1, 64), BF16),
               normal(rng, (batch, kv_len, 1, 64), BF16))
    do = normal(rng, (batch, q_len, 2, 64), BF16)
    grads = []
    for form in forms:
        bb = dataclasses.replace(MosaicBlockSizes.for_head_dim(64), fused_bwd=False, **form)
        _, vjp = jax.vjp(lambda q, k, v, bb=bb: flash_attention_mgpu(
            q, k, v, interpret=not ON_GPU, block_sizes=bb, **kw), q, k, v)
        grads.append(vjp(do))
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(a, np.float32))
    ref = jax.vjp(lambda q, k, v: mha_reference(q, k, v, **kw),
                  *(x.astype(F32) for x in (q, k, v)))[1](do.astype(F32))
    for got, want in zip(grads[-1], ref, strict=True):
        assert rel_err(got, want) < TOL[BF16]


class TestMosaicFlashAttention:
    """`flash_attention(..., implementation="mosaic")`: the Hopper kernels."""

    pytestmark = pytest.mark.skipif(ON_GPU and not on_sm90(),
                                    reason="Mosaic GPU kernels need an sm90 GPU (or the CPU interpreter)")

    @pytest.mark.parametrize("case", _mosaic_gpu_cases() if ON_GPU else MOSAIC_INTERPRET, ids=case_id)
    def test_forward_and_gradients_match_reference(self, case):
        check_case(case, lambda q, k, v, blocks, **kw: flash_attention(
            q, k, v, block_sizes=blocks, interpret=not ON_GPU, implementation="mosaic", **kw))

    @pytest.mark.parametrize("case", _mosaic_gpu_cases() if ON_GPU else MOSAIC_INTERPRET[:2], ids=case_id)
    def test_fused_backward_matches_reference(self, case):
        """fused_bwd=True: dQ, dK, dV from one kernel (dQ by TMA reduce-add on the GPU), on
        every GPU case when compiled; on CPU head dims 64 (the consumers take turns on dQ)
        and 128 (each computes half of dQ's columns)."""
        blocks = dataclasses.replace(MosaicBlockSizes.for_head_dim(case[5]), fused_bwd=True)
        check_case(case[:-1] + (blocks,), lambda q, k, v, blocks, **kw: flash_attention(
            q, k, v, block_sizes=blocks, interpret=not ON_GPU, implementation="mosaic", **kw))

    @pytest.mark.parametrize("case", _mosaic_gpu_cases() if ON_GPU else MOSAIC_INTERPRET[:1], ids=case_id)
    def test_fused_backward_heads_major_dq_matches_reference(self, case):
        """dq_heads_major=True: the fused backward sums dQ in fp32 as [B, heads, T, D] (each
        (query tile, head) one contiguous block) and transposes it back."""
        blocks = dataclasses.replace(MosaicBlockSizes.for_head_dim(case[5]), fused_bwd=True,
                                     dq_heads_major=True)
        check_case(case[:-1] + (blocks,), lambda q, k, v, blocks, **kw: flash_attention(
            q, k, v, block_sizes=blocks, interpret=not ON_GPU, implementation="mosaic", **kw))

    def test_backward_register_split(self):
        """The fused backward's consumers get 240 registers, the two kernels' 232; the producer
        what the launch's 168 x 384 leave (asking for more than that hangs the block)."""
        assert MosaicBlockSizes(fused_bwd=True).consumer_regs_bwd == 240
        assert MosaicBlockSizes(fused_bwd=False).consumer_regs_bwd == 232
        assert MosaicBlockSizes(fused_bwd=True, regs_bwd=232).consumer_regs_bwd == 232
        assert (producer_regs(232), producer_regs(240)) == (40, 24)
        for regs in (240, 232):
            assert 2 * 128 * regs + 128 * producer_regs(regs) <= 168 * 384
        for bad in (248, 236, 224):
            with pytest.raises(ValueError, match="regs_bwd"):
                MosaicBlockSizes(regs_bwd=bad)

    @pytest.mark.skipif(not ON_GPU, reason="the interpreter runs this path in the test above")
    @pytest.mark.parametrize("case", MOSAIC_INTERPRET, ids=case_id)
    def test_shared_memory_path_on_gpu(self, case):
        """regs=False (P and dS through shared memory), the path the CPU tests run, compiled."""
        def attention(q, k, v, blocks, *, segment_ids=None, **kw):
            seg = (None, None) if segment_ids is None else segment_ids
            return flash_attention_mgpu(q, k, v, q_segment_ids=seg[0], kv_segment_ids=seg[1],
                                        regs=False, **kw)
        check_case(case, attention)

    @pytest.mark.skipif(not ON_GPU, reason="small tiles: many steps, too slow to interpret")
    def test_small_tiles_and_three_stages(self):
        blocks = MosaicBlockSizes(64, 64, 3, 64, 64, 64, 64, 3)
        check_case((2, 300, 300, 4, 1, 128, True, BF16, 0, None, blocks),
                   lambda q, k, v, blocks, **kw: flash_attention(
                       q, k, v, block_sizes=blocks, implementation="mosaic", **kw))

    @pytest.mark.parametrize("causal,q_len,kv_len", [(False, 300, 200), (True, 300, 200),
                                                      (True, 512, 512)],
                             ids=["full", "causal", "causal_paired"])
    def test_persistent_forward_equals_one_block_per_tile(self, causal, q_len, kv_len):
        """The persistent grid (each block several tiles, the K/V ring, barriers and the next
        tile's Q carried over) gives bitwise the output of one block per tile. On CPU the
        persistent grid has 2 blocks for 3 x 2 x 2 = 12 tiles (ragged query tiles, GQA); at
        512 causal rows (4 query tiles a head) each block runs 4 pairs of one head's tiles
        (3 and 0, 2 and 1: the causal schedule), every tile once."""
        rng = np.random.default_rng(7)
        q, k, v = (normal(rng, (2, q_len, 2, 64), BF16), normal(rng, (2, kv_len, 1, 64), BF16),
                   normal(rng, (2, kv_len, 1, 64), BF16))
        outs = [flash_attention_mgpu(q, k, v, causal=causal, interpret=not ON_GPU, block_sizes=dataclasses.replace(
                    MosaicBlockSizes.for_head_dim(64), persistent=p)) for p in (False, True)]
        np.testing.assert_array_equal(np.asarray(outs[1], np.float32), np.asarray(outs[0], np.float32))
        ref = mha_reference(*(x.astype(F32) for x in (q, k, v)), causal=causal)
        assert rel_err(outs[1], ref) < TOL[BF16]

    @pytest.mark.parametrize("causal,q_len,kv_len", [(False, 300, 200), (True, 300, 200),
                                                      (True, 512, 512)],
                             ids=["full", "causal", "causal_paired"])
    def test_persistent_backward_equals_one_block_per_tile(self, causal, q_len, kv_len):
        """The dQ kernel (over query tiles) and, in turn, the dK/dV kernel (over key blocks)
        on the persistent schedule (the ring carried over, the next tile's own rows loaded
        under this tile's epilogue, the result out through tiles of its own) each give
        bitwise the gradients of one block per tile (2 blocks on CPU; ragged tiles, GQA,
        causal pairs): one draw, the one-block-per-tile form run once for both."""
        forms = [{"persistent_dq": False, "persistent_dkv": False},
                 {"persistent_dq": True, "persistent_dkv": False},
                 {"persistent_dq": False, "persistent_dkv": True}]
        _assert_backward_forms_bitwise_equal(9, 2, q_len, kv_len, forms, causal=causal)

    def test_own_causal_steps_equal_every_step_of_the_block(self):
        """Under a causal mask each consumer of the two backward kernels computes only the
        steps its own rows see (`own_causal_steps`, the default) and passes the rest of its
        block's ring: the gradients are bitwise those of every consumer computing every step
        (a passed step adds exact zeros); GQA, ragged keys, a q offset, the dQ kernel on its
        persistent grid (its ring carried across tiles) and the dK/dV kernel one block a tile."""
        forms = [dict(own_causal_steps=own, persistent_dq=True, persistent_dkv=False)
                 for own in (False, True)]
        _assert_backward_forms_bitwise_equal(11, 1, 256, 300, forms, causal=True, q_offset=44)

    @pytest.mark.parametrize("persistent", [False, True], ids=["grid", "persistent"])
    def test_dq_kernel_computes_delta(self, persistent):
        """`delta_in_dq` (the two-kernel backward's default): the dQ kernel loads O's rows
        beside dO's and its delta rows, handed to the dK/dV kernel, are rowsum(dO * O) in
        fp32 (the XLA pass they replace), a tile after the first (persistent) included."""
        rng = np.random.default_rng(12)
        q, o, do = (normal(rng, (1, 256, 2, 64), BF16) for _ in range(3))
        k, v = normal(rng, (1, 256, 1, 64), BF16), normal(rng, (1, 256, 1, 64), BF16)
        cfg = MosaicConfig(causal=True, sm_scale=0.125, blocks=MosaicBlockSizes.for_head_dim(64),
                           q_len=256, kv_len=256, groups=2, segments=False, regs=False,
                           interpret=not ON_GPU, persistent_dq=persistent,
                           sms=2 if persistent else 132)
        assert cfg.delta_in_dq  # the default of the two-kernel backward
        lse = jnp.zeros((1, 2, 256), F32)
        _, delta = backward_dq(cfg, q, k, v, jnp.zeros((1,), jnp.int32), None, None, lse, do, None, o=o)
        want = jnp.einsum("btnh,btnh->bnt", o.astype(F32), do.astype(F32))
        np.testing.assert_allclose(np.asarray(delta), np.asarray(want), rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("causal,q_offset,seg,dtype", [(True, 44, "random", BF16),
                                                           (False, 0, None, jnp.float16)],
                             ids=["causal", "full"])
    def test_ds_in_hbm_matches_reference(self, causal, q_offset, seg, dtype):
        """`ds_in_hbm`: the dK/dV kernel stores every dS^T tile it computes and a second
        kernel reads them for dQ = dS K (no recomputation). Output and gradients against the
        reference: a q offset, ragged keys and query tiles, GQA, segment ids (causal); fp16
        without a mask."""
        blocks = dataclasses.replace(MosaicBlockSizes.for_head_dim(64), ds_in_hbm=True)
        check_case((1, 200 if not causal else 256, 300, 4, 2, 64, causal, dtype, q_offset, seg, blocks),
                   lambda q, k, v, blocks, **kw: flash_attention(
                       q, k, v, block_sizes=blocks, interpret=not ON_GPU, implementation="mosaic", **kw))

    @pytest.mark.skipif(ON_GPU, reason="the interpreter's race detector")
    def test_ds_in_hbm_kernels_have_no_shared_memory_race(self):
        """The dK/dV kernel's dS^T stores (a tile by step parity, reused once its last store
        has read it) and the dQ-from-dS kernel's ring, each checked alone (the race state is
        the last kernel's); the detector reports a race when the stores' wait is taken out."""
        rng = np.random.default_rng(13)
        q, do = normal(rng, (1, 256, 2, 64), BF16), normal(rng, (1, 256, 2, 64), BF16)
        k, v = normal(rng, (1, 256, 1, 64), BF16), normal(rng, (1, 256, 1, 64), BF16)
        blocks = dataclasses.replace(MosaicBlockSizes.for_head_dim(64), ds_in_hbm=True)
        cfg = MosaicConfig(causal=True, sm_scale=0.125, blocks=blocks, q_len=256, kv_len=256,
                           groups=2, segments=False, regs=False, interpret=True)
        qoff, lse, delta = jnp.zeros((1,), jnp.int32), jnp.zeros((1, 2, 256), F32), jnp.zeros((1, 2, 256), F32)
        with detecting_races():
            _, _, ds_t = jax.block_until_ready(
                backward_dkv(cfg, q, k, v, qoff, None, None, lse, do, delta, ds_out=True))
            assert not interpreter_races_found(), "dK/dV kernel storing dS^T"
            jax.block_until_ready(backward_dq_from_ds(cfg, k, ds_t, qoff, q.shape, q.dtype))
            assert not interpreter_races_found(), "dQ from dS"

    def test_causal_pairs_with_offset_and_segments_match_reference(self):
        """The persistent forward and dQ kernel over causal pairs (2 query tiles a head; the
        defaults at head dim 128) with a q offset, ragged keys, segment ids and GQA, against
        the reference: the pairs' key steps, masks and rings together."""
        blocks = dataclasses.replace(MosaicBlockSizes.for_head_dim(64), persistent=True,
                                     persistent_dq=True)  # the defaults at head dim 128
        check_case((1, 256, 300, 4, 2, 64, True, BF16, 44, "random", blocks),
                   lambda q, k, v, blocks, **kw: flash_attention(
                       q, k, v, block_sizes=blocks, interpret=not ON_GPU, implementation="mosaic", **kw))

    @pytest.mark.skipif(ON_GPU, reason="the interpreter's race detector")
    @pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
    def test_kernels_have_no_shared_memory_race(self, causal):
        """The kernels set their own barriers (`launch(manual_barriers=True)`): the
        interpreter's race detector finds none in the forward (persistent or not) nor in the
        dQ and dK/dV kernels (it finds the race when the forward's wait for the last tile's O
        copy is taken out)."""
        rng = np.random.default_rng(8)
        for persistent, heads in ((True, 2), (False, 1)):  # shapes no other test traces
            q = normal(rng, (1, 256, heads, 64), BF16)
            k, v = normal(rng, (1, 256, 1, 64), BF16), normal(rng, (1, 256, 1, 64), BF16)
            blocks = dataclasses.replace(MosaicBlockSizes.for_head_dim(64), persistent=persistent)
            with detecting_races():
                out = flash_attention_mgpu(q, k, v, causal=causal, interpret=True, block_sizes=blocks)
                jax.block_until_ready(out)
                assert not interpreter_races_found(), f"forward, persistent={persistent}"
                # The backward kernels: fused, then the two-kernel form, both kernels
                # persistent (the race state is the last kernel's: dK/dV's there).
                for fused in (True, False) if persistent else ():
                    bb = dataclasses.replace(blocks, fused_bwd=fused, persistent_dq=not fused,
                                             persistent_dkv=not fused)
                    _, vjp = jax.vjp(lambda q, k, v, bb=bb: flash_attention_mgpu(
                        q, k, v, causal=causal, interpret=True, block_sizes=bb), q, k, v)
                    jax.block_until_ready(vjp(out))
                    assert not interpreter_races_found(), f"backward, fused={fused}"
                if persistent:  # the persistent dQ kernel alone (above, dK/dV's state is read),
                    # computing delta from the O rows it loads (its default)
                    cfg = MosaicConfig(causal=causal, sm_scale=0.125, blocks=blocks, q_len=256,
                                       kv_len=256, groups=heads, segments=False, regs=False,
                                       interpret=True, persistent_dq=True, sms=2)
                    lse = jnp.zeros((1, heads, 256), F32)
                    dq = backward_dq(cfg, q, k, v, jnp.zeros((1,), jnp.int32), None, None, lse, q, None,
                                     o=out)
                    jax.block_until_ready(dq)
                    assert not interpreter_races_found(), "persistent dQ"

    def test_persistent_grids_are_the_default_only_where_they_measured_faster(self):
        blocks = MosaicBlockSizes.for_head_dim(128)
        # the forward: without a mask, and causal when its 128-row tiles pair up
        assert blocks.resolve_persistent(128, True, False, 4096)
        assert blocks.resolve_persistent(128, True, True, 2048)
        assert not blocks.resolve_persistent(128, True, True, 1920)  # 15 tiles: no pairs
        assert not blocks.resolve_persistent(64, True, True, 2048)  # causal pairs timed at D 128
        assert not blocks.resolve_persistent_dq(64, True, True, 2048, 2048)
        # the dQ kernel: up to 2k keys (faster at 2k causal, not at 4k)
        assert blocks.resolve_persistent_dq(128, True, True, 2048, 2048)
        assert not blocks.resolve_persistent_dq(128, True, True, 4096, 4096)
        assert not blocks.resolve_persistent_dq(128, True, False, 4096, 4096)
        assert not blocks.resolve_persistent_dq(128, True, True, 1920, 1920)
        assert MosaicBlockSizes(persistent_dq=True).resolve_persistent_dq(128, True, True, 1920, 8192)
        # the dK/dV kernel: one block per key block (persistent measured slower), unless asked
        assert not blocks.resolve_persistent_dkv(128, True)
        assert MosaicBlockSizes(persistent_dkv=True).resolve_persistent_dkv(128, True)
        assert not MosaicBlockSizes(persistent_dkv=True, fused_bwd=True).resolve_persistent_dkv(128, True)
        assert not MosaicBlockSizes(persistent=False).resolve_persistent(128, True, False, 4096)

    def test_fused_backward_is_the_default_only_where_it_measured_faster(self):
        blocks = MosaicBlockSizes.for_head_dim(128)
        assert blocks.resolve_fused_bwd(128, 16384) and blocks.resolve_fused_bwd(128, 8192)
        assert not blocks.resolve_fused_bwd(128, 4096) and not blocks.resolve_fused_bwd(64, 16384)
        assert MosaicBlockSizes(fused_bwd=True).resolve_fused_bwd(64, 100)
        assert not MosaicBlockSizes(fused_bwd=False).resolve_fused_bwd(128, 16384)
        # three stages do not fit the fused kernel's shared memory: the two kernels, no error
        assert not MosaicBlockSizes(stages_bwd=3).resolve_fused_bwd(128, 16384)
        with pytest.raises(ValueError, match="fused_bwd"):
            MosaicBlockSizes(fused_bwd="yes")

    def test_ds_in_hbm_is_the_default_only_where_its_buffer_fits(self):
        """Compiling at head dim 128, the backward goes through dS in global memory when its
        dS^T buffer (batch x heads x kv_pad x q_pad x 2 bytes) is at most 4 GiB: the 1b step's
        2k x 24 x 16 heads (3.2 GB) and the 4k cases, not 16k (8.6 GB a sequence); never in
        the interpreter (regs=False), at head dim 64 (untimed) or with fused_bwd asked for."""
        blocks = MosaicBlockSizes.for_head_dim(128)
        assert blocks.resolve_ds_in_hbm(128, True, 24 * 16, 2048, 2048)
        assert blocks.resolve_ds_in_hbm(128, True, 4 * 32, 4096, 4096)  # 4 GiB exactly
        assert not blocks.resolve_ds_in_hbm(128, True, 4 * 32 + 1, 4096, 4096)
        assert not blocks.resolve_ds_in_hbm(128, True, 16, 16384, 16384)
        assert not blocks.resolve_ds_in_hbm(128, False, 24 * 16, 2048, 2048)
        assert not blocks.resolve_ds_in_hbm(64, True, 16, 2048, 2048)
        assert not MosaicBlockSizes(fused_bwd=True).resolve_ds_in_hbm(128, True, 16, 2048, 2048)
        assert MosaicBlockSizes(ds_in_hbm=True).resolve_ds_in_hbm(64, False, 1 << 20, 16384, 16384)
        # where it runs the fused backward does not (whose rule is 8k keys and up)
        assert not dataclasses.replace(blocks, ds_in_hbm=True).resolve_fused_bwd(128, 8192)
        # its dQ kernel's tiles are 2 x block_q_dkv query rows: the padding covers them
        assert MosaicBlockSizes(block_q_dkv=128, ds_in_hbm=True).pads(100, 100)[0] == 256
        assert MosaicBlockSizes(block_q_dkv=128, ds_in_hbm=False).pads(100, 100)[0] == 128
        with pytest.raises(ValueError, match="two forms"):
            MosaicBlockSizes(fused_bwd=True, ds_in_hbm=True)
        with pytest.raises(ValueError, match="ds_in_hbm"):
            MosaicBlockSizes(ds_in_hbm="yes")

    def test_auto_picks_mosaic_only_on_sm90(self):
        want = "mosaic" if ON_GPU and on_sm90() else "triton"
        assert pick_implementation(None, BF16, 128, None, interpret=not ON_GPU) == want
        assert pick_implementation(None, F32, 128, None, interpret=False) == "triton"
        assert pick_implementation(None, BF16, 32, None, interpret=False) == "triton"
        with pytest.raises(ValueError, match="implementation='triton'"):
            pick_implementation("mosaic", F32, 128, None, interpret=False)


def _largest_intermediate(jaxpr) -> int:
    """Largest array (elements) anywhere in a jaxpr, kernel bodies included."""
    biggest = 0
    for var in [*jaxpr.invars, *jaxpr.outvars, *(v for e in jaxpr.eqns for v in e.outvars)]:
        shape = getattr(getattr(var, "aval", None), "shape", None)
        if shape is not None:
            biggest = max(biggest, math.prod(shape))
    for eqn in jaxpr.eqns:
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    biggest = max(biggest, _largest_intermediate(inner))
    return biggest


class TestMemoryIsLinear:
    """No seq x seq array exists in forward + backward (the residuals are O(seq))."""

    @staticmethod
    def grad_fn(attention):
        def loss(q, k, v):
            return jnp.sum(attention(q, k, v).astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2))

    def test_no_seq_by_seq_intermediate_in_traced_fwd_bwd(self):
        t = s = 512
        q = k = v = jax.ShapeDtypeStruct((1, t, 1, 32), jnp.float32)
        ours = self.grad_fn(lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=True))
        ref = self.grad_fn(lambda q, k, v: mha_reference(q, k, v, causal=True))
        assert _largest_intermediate(jax.make_jaxpr(ref)(q, k, v).jaxpr) >= t * s  # the check bites
        assert _largest_intermediate(jax.make_jaxpr(ours)(q, k, v).jaxpr) < t * s // 8

    @pytest.mark.skipif(not ON_GPU, reason="compiled temp memory is only meaningful for the compiled "
                        "(Triton or Mosaic GPU) kernels; on CPU the traced-jaxpr check above stands in")
    def test_compiled_temp_memory_grows_linearly_on_gpu(self):
        def temp_bytes(attention, seq):
            x = jax.ShapeDtypeStruct((1, seq, 8, 128), jnp.bfloat16)
            compiled = jax.jit(self.grad_fn(attention)).lower(x, x, x).compile()
            return compiled.memory_analysis().temp_size_in_bytes

        ours = lambda q, k, v: flash_attention(q, k, v, causal=True)
        naive = lambda q, k, v: mha_reference(q, k, v, causal=True)
        small, big = 1024, 4096  # 4x longer: linear memory grows ~4x, quadratic ~16x
        assert temp_bytes(naive, big) / temp_bytes(naive, small) > 8  # the check bites
        assert temp_bytes(ours, big) / temp_bytes(ours, small) < 6


class TestBadInput:
    def test_errors_name_the_field(self):
        q = jnp.ones((1, 8, 4, 64), jnp.float32)
        kv = jnp.ones((1, 8, 2, 64), jnp.float32)
        with pytest.raises(ValueError, match="head_dim=48"):
            x = jnp.ones((1, 8, 4, 48))
            flash_attention(x, x, x)
        with pytest.raises(ValueError, match="kv heads"):
            x = jnp.ones((1, 8, 3, 64))
            flash_attention(q, x, x)
        with pytest.raises(ValueError, match="dtypes differ"):
            flash_attention(q, kv.astype(jnp.bfloat16), kv)
        with pytest.raises(ValueError, match="segment_ids"):
            flash_attention(q, kv, kv, segment_ids=SegmentIds(jnp.ones((1, 9)), jnp.ones((1, 8))))
        with pytest.raises(ValueError, match="q_offset"):
            flash_attention(q, kv, kv, q_offset=-1)
        with pytest.raises(ValueError, match="block_k_dq"):
            BlockSizes(block_k_dq=8)
        with pytest.raises(ValueError, match="k.shape"):
            flash_attention(q, kv, jnp.ones((1, 9, 2, 64)))
