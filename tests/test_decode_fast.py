"""The decode fast path (decode weight layout, per-layer caches, paged-kernel attention over a
contiguous cache) gives the reference path's greedy tokens, in plain, continuous-batching and
speculative decoding; adaptive γ stays exact; the serving benchmark runs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import experiment

from gendist.config import ModelConfig
from gendist.inference import decode_block, decode_layout, decoder
from gendist.inference import generate as G
from gendist.inference.engine import Engine, EngineConfig, Request
from gendist.inference.layer_cache import LayerKVCache, write_rows
from gendist.inference.lm import transformer_lm
from gendist.inference.sampling import SamplingParams
from gendist.inference.speculative import SpecConfig, speculative_generate
from gendist.models import transformer

CFG = ModelConfig(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, d_ff=64,
                  max_seq_len=64)
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [np.array([1, 2, 3, 4, 5]), np.array([7, 8]), np.array([9, 10, 11, 12, 13, 14])]


@pytest.fixture(scope="module")
def params():
    p = transformer.init_params(CFG, 1)
    return jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x, p)  # peaky logits


@pytest.fixture(scope="module")
def reference(params):
    pb, lb = G.pad_prompts(PROMPTS)
    out, _ = G.generate_tokens(CFG, params, jnp.asarray(pb), jnp.asarray(lb), jax.random.key(0),
                               max_new_tokens=9, sp=GREEDY, path="reference")
    return np.asarray(out)


def test_decode_layout_logits_equal_the_model(params):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)
    dp = decode_layout.decode_params(CFG, params)
    assert isinstance(dp["blocks"], tuple) and len(dp["blocks"]) == CFG.num_layers
    assert dp["blocks"][0]["wqkv_CHD"].shape == (4 + 2 * 2, 16, 32)
    assert decode_layout.decode_params(CFG, dp) is dp  # already in the layout
    np.testing.assert_allclose(decode_block.forward(CFG, dp, tokens),
                               transformer.forward(CFG, params, tokens), rtol=1e-5, atol=1e-5)
    gelu = dataclasses.replace(CFG, mlp="gelu", tie_embeddings=False)  # the other layouts
    gp = transformer.init_params(gelu, 3)
    gdp = decode_layout.decode_params(gelu, gp)
    assert "head_VD" in gdp and "w_up_FD" in gdp["blocks"][1]
    np.testing.assert_allclose(decode_block.forward(gelu, gdp, tokens),
                               transformer.forward(gelu, gp, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_fast_greedy_equals_reference(params, reference, backend):
    pb, lb = G.pad_prompts(PROMPTS)
    plan = decoder.plan(CFG, params, 3, pb.shape[1] + 9, "fast", backend=backend)
    cache = plan.make_cache()
    assert isinstance(cache, LayerKVCache) and cache.backend == backend
    out, count = G.generate(plan, jnp.asarray(pb), jnp.asarray(lb), jax.random.key(0),
                            max_new_tokens=9, sp=GREEDY, cache=cache)
    np.testing.assert_array_equal(np.asarray(out), reference)
    assert list(np.asarray(count)) == [9] * 3


def test_cpu_default_is_the_reference_path(params):
    plan = decoder.plan(CFG, params, 3, 16, device=("cpu", "cpu"))
    assert plan.path == "reference" and not isinstance(plan.params["blocks"], tuple)
    assert plan.line == "decode: reference — cpu (the fast path and the megakernel need a GPU)"
    with pytest.raises(ValueError, match="generate.path='reference' reads the model's stacked"):
        decoder.plan(CFG, plan.with_params(params).params | {"blocks": (params["blocks"],)},
                     3, 16, "reference")


@pytest.mark.parametrize("B,T", [(1, 1), (1, 4), (2, 3)])
def test_write_rows_writes_consecutive_rows_per_sequence(B, T):
    """One sequence's T rows as one slice write, several sequences as a scatter: both put
    row t of sequence b at its own position and leave every other slot untouched."""
    rng = np.random.default_rng(B * 10 + T)
    buf = jnp.asarray(rng.normal(size=(2, B, 12, 4)), jnp.float32)  # [K, B, S, H]
    rows = jnp.asarray(rng.normal(size=(2, B, T, 4)), jnp.float32)
    start_B = rng.integers(0, 12 - T + 1, size=B)
    pos_BT = jnp.asarray(start_B[:, None] + np.arange(T)[None, :], jnp.int32)
    out = np.asarray(jax.jit(write_rows, static_argnums=3)(buf, rows, pos_BT, 1))
    want = np.array(buf)
    for b in range(B):
        want[:, b, start_B[b]:start_B[b] + T] = np.asarray(rows)[:, b]
    np.testing.assert_array_equal(out, want)


def test_layer_cache_serves_a_scanned_model(params):
    """A per-layer cache under stacked (scanned) weights: stacked, then split back."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 9)), jnp.int32)
    full = transformer.forward(CFG, params, tokens)
    cache = LayerKVCache.create(CFG.num_layers, 2, 16, CFG.num_kv_heads, CFG.head_dim)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    a, cache = transformer.forward(CFG, params, tokens[:, :5], pos, cache)
    b, cache = transformer.forward(CFG, params, tokens[:, 5:], pos[:, :4] + 5,
                                   cache.advance(jnp.full((2,), 5)))
    assert isinstance(cache.k, tuple) and len(cache.k) == CFG.num_layers
    np.testing.assert_allclose(jnp.concatenate([a, b], 1), full, rtol=1e-5, atol=1e-5)


ENGINE = dict(max_slots=3, max_prompt_len=8, max_len=24, num_pages=6, page_size=4)


def test_engine_fast_path_equals_reference_engine(params):
    rng = np.random.default_rng(3)
    reqs = [Request(rng.integers(0, 256, size=int(rng.integers(2, 9))).astype(np.int32),
                    int(rng.integers(3, 14))) for _ in range(6)]
    ref = Engine(CFG, params, EngineConfig(**ENGINE, path="reference"))
    fast = Engine(CFG, params, EngineConfig(**ENGINE, path="fast"))
    assert fast.plan.path == "fast" and ref.plan.path == "reference"
    assert fast.cache.per_layer and not ref.cache.per_layer
    done_ref = ref.run([Request(r.prompt, r.max_new_tokens) for r in reqs])
    done = fast.run([Request(r.prompt, r.max_new_tokens) for r in reqs])
    assert [d.output for d in done] == [d.output for d in done_ref]
    assert fast.stats["preemptions"] > 0  # the tight pool preempted and recomputed
    assert all(len(d.token_times) == len(d.output) for d in done)


CFG_D = ModelConfig(d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                    d_ff=32, max_seq_len=64)


def test_speculative_fast_path_with_adaptive_gamma_equals_plain_greedy(params, reference):
    """Target and draft on the fast path, γ chosen from the running acceptance rate: the
    tokens are still plain greedy's (fixed γ on both paths: tests/test_speculative.py)."""
    dp = transformer.init_params(CFG_D, 2)
    pb, lb = G.pad_prompts(PROMPTS)
    target = transformer_lm(decoder.plan(CFG, params, 3, 64, "fast", step_tokens=5), "target-fast")
    draft = transformer_lm(decoder.plan(CFG_D, dp, 3, 64, "fast"), "draft-fast")
    spec = SpecConfig(gamma=4, adaptive=True, cost_ratio=0.3)
    out, count, stats = speculative_generate(target, params, draft, dp, jnp.asarray(pb),
                                             jnp.asarray(lb), jax.random.key(0),
                                             max_new_tokens=9, sp=GREEDY, spec=spec)
    np.testing.assert_array_equal(np.asarray(out), reference)
    assert 1 <= int(stats["final_gamma"]) < 4  # a random draft is poor: γ falls


def test_serving_benchmark_runs_tiny(tmp_path):
    mod = experiment("serve_trace")
    trace = mod.make_trace(5, 500.0, 8, 24, CFG.vocab_size, seed=0)
    assert all(a.arrival < b.arrival for a, b in zip(trace, trace[1:], strict=False))
    params = transformer.init_params(CFG, 0)
    eng = Engine(CFG, params, EngineConfig(**ENGINE))  # the shapes compiled above
    reqs = mod.fresh(trace)
    eng.run(reqs, realtime=True)
    static = mod.fresh(trace)
    mod.run_static(decoder.plan(CFG, params, 2, 24), static, 8, mod.Progress(0, "static"))
    for r, s in zip(reqs, static, strict=True):  # same greedy tokens either way
        assert r.output == s.output and len(r.output) == r.max_new_tokens
        assert r.token_times[0] >= r.arrival
    row = mod.summarize(reqs, 1, dict(mean_kv_tokens_reserved=1.0, mean_kv_tokens_used=1.0))
    assert row["output_tokens"] == sum(r.max_new_tokens for r in trace)
    assert row["ttft_ms_p50"] <= row["ttft_ms_p99"]


LOOP_HLO = """
%body (c: (s32[], bf16[4,8,64,64])) -> (s32[], bf16[4,8,64,64]) {
  %c = (s32[], bf16[4,8,64,64]) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %q = bf16[4,8,64,64]{3,2,1,0} get-tuple-element(%c), index=1
  %attn = (f32[1,4,8,64]{3,2,1,0}) custom-call(%q), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(generate_tokens)/while/body/jit(paged_attention)/jit(paged_attention_mgpu)/kernel/mpmd_map"}
  %mm = bf16[4,8,64,64]{3,2,1,0} custom-call(%q), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/my_matmul/kernel"}
  ROOT %t = (s32[], bf16[4,8,64,64]) tuple(%i, %q)
}

%cond (c: (s32[], bf16[4,8,64,64])) -> pred[] {
  %c = (s32[], bf16[4,8,64,64]) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: (s32[], bf16[4,8,64,64])) -> (s32[], bf16[4,8,64,64]) {
  %x = (s32[], bf16[4,8,64,64]) parameter(0)
  ROOT %w = (s32[], bf16[4,8,64,64]) while(%x), condition=%cond, body=%body
}
"""


def test_loop_body_kinds_and_mosaic_kernels_named_by_their_caller():
    from gendist import profiling
    assert profiling.loop_body_kinds(LOOP_HLO) == {"attention": 1, "matmul": 1}
    # a loop before the decode loop (a prompt's scan over layers) that launches more: the last counts
    mm2 = '  %mm2 = bf16[4,8,64,64]{3,2,1,0} custom-call(%q), custom_call_target="mosaic_gpu_v2"\n'
    prompt_body = LOOP_HLO.split("%cond ")[0].replace("%body ", "%prompt_body ").replace("  ROOT %t", mm2 + "  ROOT %t")
    two = prompt_body + LOOP_HLO.replace("while(%x), condition=%cond, body=%body", "while(%p), condition=%cond, body=%body") \
        .replace("  ROOT %w", "  %p = (s32[], bf16[4,8,64,64]) while(%x), condition=%cond, body=%prompt_body\n  ROOT %w")
    assert sum(profiling.loop_body_kinds(prompt_body + LOOP_HLO.replace("body=%body", "body=%prompt_body")).values()) == 3
    assert profiling.loop_body_kinds(two) == {"attention": 1, "matmul": 1}
    assert profiling.loop_body_kinds("ENTRY %main () -> f32[] {\n}\n") == {}
