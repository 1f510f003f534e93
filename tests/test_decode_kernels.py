"""The fused decode kernels: RoPE + KV-cache write + attention in one kernel, and
RMSNorm (optionally after the residual add) in one kernel, against their unfused math; and
greedy decoding through them equal to the reference path token for token. On a CPU the
kernels run in Pallas interpret mode; the same tests run compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gendist.config import ModelConfig
from gendist.inference import decoder
from gendist.inference import generate as G
from gendist.inference.cache import ContiguousKVCache
from gendist.inference.layer_cache import LayerKVCache
from gendist.inference.sampling import SamplingParams
from gendist.models import layers, transformer
from pallas_kernels import head as head_kernel
from pallas_kernels.decode_attention import decode_attention, decode_attention_reference
from pallas_kernels.rms_norm import rms_norm


def _case(B, N, K, H, S, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    qkv = jax.random.normal(ks[0], (B, N + 2 * K, H), jnp.float32).astype(dtype)
    k_cache = jax.random.normal(ks[1], (K, B, S, H), jnp.float32).astype(dtype)
    v_cache = jax.random.normal(ks[2], (K, B, S, H), jnp.float32).astype(dtype)
    return qkv, k_cache, v_cache


@pytest.mark.parametrize("N,K,dtype,splits", [(4, 4, jnp.float32, 1), (8, 2, jnp.float32, 3),
                                              (4, 2, jnp.bfloat16, 1), (4, 4, jnp.bfloat16, 3)])
def test_decode_attention_matches_unfused_math(N, K, dtype, splits):
    """Output, the written k (rotated) and v rows, and every other cache slot untouched;
    positions 0 (nothing cached), mid-block and the last slot, in one program per sequence
    and head or split over the context (3 splits of 16 slots: some splits empty). Slots
    past each position hold NaN: the kernel must never read them (nor the slot it writes)."""
    B, H, S = 3, 32, 40
    qkv, k_cache, v_cache = _case(B, N, K, H, S, dtype)
    pos = jnp.array([0, 17, S - 1], jnp.int32)
    stale = jnp.arange(S)[None, None, :, None] >= pos[None, :, None, None]
    k_cache = jnp.where(stale, jnp.nan, k_cache).astype(dtype)
    v_cache = jnp.where(stale, jnp.nan, v_cache).astype(dtype)
    cos, sin = layers.rope_angles(pos[:, None], H, 10000.0)
    args = (qkv, k_cache, v_cache, pos, cos[:, 0], sin[:, 0])
    o, k_new, v_new = decode_attention(*args, num_heads=N, block_k=16, num_splits=splits)
    o_ref, k_ref, v_ref = decode_attention_reference(*args, num_heads=N)
    assert not np.isnan(np.asarray(o, np.float32)).any()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32), **tol)
    np.testing.assert_array_equal(np.asarray(k_new, np.float32), np.asarray(k_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(v_new, np.float32), np.asarray(v_ref, np.float32))


def test_cache_attend_qkv_kernel_equals_the_interface_default():
    """LayerKVCache's one-kernel attend_qkv and KVCache's default (split, rotate, attend) on
    a contiguous cache agree: output and the written cache rows."""
    B, N, K, H, S = 2, 4, 2, 32, 24
    qkv = jax.random.normal(jax.random.key(4), (B, 1, N + 2 * K, H), jnp.float32)
    prior = jax.random.normal(jax.random.key(5), (2, K, B, S, H), jnp.float32)
    pos = jnp.array([[5], [11]], jnp.int32)
    cos, sin = layers.rope_angles(pos, H, 10000.0)
    scale = H ** -0.5
    layer = LayerKVCache.create(1, B, S, K, H, backend="pallas", page_size=8)
    o, (k_new, v_new) = layer.attend_qkv((prior[0], prior[1]), qkv, N, pos, cos, sin, scale)
    contig = ContiguousKVCache.create(1, B, S, K, H)  # [B, S, K, H] rows
    state = (jnp.moveaxis(prior[0], 0, 2), jnp.moveaxis(prior[1], 0, 2))
    with jax.default_matmul_precision("highest"):  # a GPU would use TF32 for fp32 einsums
        o_ref, (k_ref, v_ref) = contig.attend_qkv(state, qkv, N, pos, cos, sin, scale)
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k_new, jnp.moveaxis(k_ref, 2, 0), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(v_new, jnp.moveaxis(v_ref, 2, 0))


def test_decode_attention_rejects_bad_shapes():
    qkv, k_cache, v_cache = _case(1, 4, 2, 16, 8, jnp.float32)
    z = jnp.zeros((1, 8), jnp.float32)
    with pytest.raises(ValueError, match="head_dim=16"):
        decode_attention(qkv, k_cache, v_cache, jnp.zeros((1,), jnp.int32), z, z, num_heads=4)
    qkv, k_cache, v_cache = _case(1, 4, 2, 32, 8, jnp.float32)
    z = jnp.zeros((1, 16), jnp.float32)
    with pytest.raises(ValueError, match="num_heads"):
        decode_attention(qkv, k_cache, v_cache, jnp.zeros((1,), jnp.int32), z, z, num_heads=2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_kernel_matches_layers(dtype):
    x = jax.random.normal(jax.random.key(1), (2, 3, 64), jnp.float32).astype(dtype)
    d = jax.random.normal(jax.random.key(2), (2, 3, 64), jnp.float32).astype(dtype)
    g = jax.random.normal(jax.random.key(3), (64,), jnp.float32)
    np.testing.assert_allclose(np.asarray(rms_norm(x, g, eps=1e-6), np.float32),
                               np.asarray(layers.rms_norm(x, g, 1e-6), np.float32),
                               rtol=1e-6, atol=1e-6)
    s, h = rms_norm(x, g, d, eps=1e-6)
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(x + d, np.float32))
    np.testing.assert_allclose(np.asarray(h, np.float32),
                               np.asarray(layers.rms_norm(x + d, g, 1e-6), np.float32),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="power of two"):
        rms_norm(x[..., :48], g[:48], eps=1e-6)


@pytest.mark.parametrize("rows,tied", [(1, True), (5, False)])
def test_head_kernel_matches_the_output_layer(rows, tied):
    """The final norm and the logits in one kernel against XLA's (`decode_block.head_logits`):
    equal but for the normed row's rounding to bf16, where the two sums of squares differ in
    their last bits and move an entry across a rounding boundary (one bf16 step, 0.4%, of
    that entry; the logits move ~0.1% of their largest). Same greedy token."""
    from gendist.inference import decode_block
    V, D = 1008, 512  # a vocabulary of 63 tiles of 16 rows; 2 column chunks of 256
    cfg = ModelConfig(d_model=D, num_layers=1, num_heads=4, num_kv_heads=4, head_dim=128,
                      d_ff=256, vocab_size=V, tie_embeddings=tied, dtype="bfloat16")
    ks = jax.random.split(jax.random.key(rows), 3)
    table = (0.05 * jax.random.normal(ks[0], (V, D))).astype(jnp.bfloat16)
    params = {"final_norm": 1 + 0.1 * jax.random.normal(ks[1], (D,)),
              "embed" if tied else "head_VD": table}
    if not tied:
        params["embed"] = jnp.zeros((V, D), jnp.bfloat16)
    x = (2 * jax.random.normal(ks[2], (1, rows, D))).astype(jnp.bfloat16)
    want = np.asarray(decode_block.head_logits(params, x, cfg))
    got = np.asarray(decode_block.head_logits(params, x, cfg, kernel=True))
    assert got.shape == (1, rows, V) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-3 * np.abs(want).max())
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_head_kernel_says_what_it_takes():
    assert head_kernel.supports(1, 128256, 2048) and head_kernel.supports(16, 256, 64)
    assert not head_kernel.supports(17, 256, 64)  # 17 rows: XLA's output layer
    assert not head_kernel.supports(1, 1000, 64)  # no tile of 16 or more divides 1000
    with pytest.raises(ValueError, match="1-16 rows"):
        head_kernel.head_logits(jnp.zeros((17, 64)), jnp.ones((64,)), jnp.zeros((256, 64)),
                                eps=1e-5)


@pytest.mark.parametrize("heads,tiling", [((4, 2), ""), ((2, 2), "bk16_sp2_w2")],
                         ids=["gqa", "mha-split"])
def test_fused_decode_greedy_equals_reference(heads, tiling):
    """generate_tokens on the fused path (ragged prompts of 3 sequences, 9 new tokens) gives
    the reference path's tokens, and its decode step does run the two kernels (with the
    default tiling, and with the context split in two)."""
    cfg = ModelConfig(d_model=64, num_layers=2, num_heads=heads[0], num_kv_heads=heads[1],
                      head_dim=32, d_ff=128, max_seq_len=64)
    params = jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x,
                          transformer.init_params(cfg, 1))  # peaky logits
    pb, lb = G.pad_prompts([np.array([1, 2, 3, 4, 5]), np.array([7, 8]),
                            np.array([9, 10, 11, 12, 13, 14])])
    greedy = SamplingParams(temperature=0.0)
    args = (cfg, params, jnp.asarray(pb), jnp.asarray(lb), jax.random.key(0))
    ref, _ = G.generate_tokens(*args, max_new_tokens=9, sp=greedy, path="reference")
    plan = decoder.plan(cfg, params, 3, pb.shape[1] + 9, "fast", backend="pallas", tiling=tiling)
    cache = plan.make_cache()
    assert cache.decode_kernels(3, 1) == (True, True)
    unfused = decoder.plan(cfg, params, 3, 8, "fast", backend="pallas", fused=False)
    assert unfused.make_cache().decode_kernels(3, 1) == (False, False)
    run = lambda c: G.generate(plan, *args[2:], max_new_tokens=9, sp=greedy, cache=c)  # noqa: E731
    jaxpr = str(jax.make_jaxpr(run)(cache))
    assert ("decode_attention_bk16_splits2" if tiling else "decode_attention_bk") in jaxpr
    assert "add_rms_norm" in jaxpr
    with pytest.raises(ValueError, match="tiling 'split2'"):
        decoder.plan(cfg, params, 3, 8, "fast", backend="pallas", tiling="split2").make_cache()
    out, _ = run(cache)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_fast_path_with_the_head_kernel_decodes_the_reference_tokens():
    """plan(..., head="kernel"): each decode step's output layer is the kernel (in the step's
    program) and greedy tokens are the reference path's; a head that is neither is refused."""
    cfg = ModelConfig(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      d_ff=128, max_seq_len=64)
    params = jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x,
                          transformer.init_params(cfg, 1))  # peaky logits
    pb, lb = G.pad_prompts([np.array([1, 2, 3, 4, 5]), np.array([7, 8])])
    greedy = SamplingParams(temperature=0.0)
    args = (jnp.asarray(pb), jnp.asarray(lb), jax.random.key(0))
    ref, _ = G.generate_tokens(cfg, params, *args, max_new_tokens=6, sp=greedy, path="reference")
    plan = decoder.plan(cfg, params, 2, pb.shape[1] + 6, "fast", head="kernel")
    cache = plan.make_cache()
    assert "head_logits" in str(jax.make_jaxpr(plan.step)(jnp.zeros((2,), jnp.int32), cache))
    out, _ = G.generate(plan, *args, max_new_tokens=6, sp=greedy, cache=cache)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    with pytest.raises(ValueError, match="head='pallas'"):
        decoder.plan(cfg, params, 2, 8, "fast", head="pallas")
