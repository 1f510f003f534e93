"""Paged decoding equals the contiguous cache and the full forward; continuous batching."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gendist.config import ModelConfig
from gendist.inference import generate as G
from gendist.inference import page_allocator as pa
from gendist.inference.engine import Engine, EngineConfig, Request
from gendist.inference.paged_cache import PagedKVCache
from gendist.inference.sampling import SamplingParams
from gendist.models import transformer

CFG = ModelConfig(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, d_ff=64,
                  max_seq_len=64)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def params():
    p = transformer.init_params(CFG, 1)
    return jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x, p)


def full_forward_greedy(params, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(jnp.argmax(transformer.forward(CFG, params, jnp.asarray([seq]))[0, -1])))
    return seq[len(prompt):]


PROMPTS = [np.array([1, 2, 3, 4, 5]), np.array([7, 8]), np.array([9, 10, 11, 12, 13, 14, 15])]


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_paged_equals_contiguous_and_full_forward(params, backend):
    pb, lb = G.pad_prompts(PROMPTS)
    n = 9
    ref, _ = G.generate_tokens(CFG, params, jnp.asarray(pb), jnp.asarray(lb), jax.random.key(0),
                               max_new_tokens=n, sp=GREEDY)
    cache = PagedKVCache.create(2, 3, pb.shape[1] + n, 2, 16, num_pages=16, page_size=4,
                                backend=backend)
    out, _ = G.generate_tokens(CFG, params, jnp.asarray(pb), jnp.asarray(lb), jax.random.key(0),
                               max_new_tokens=n, sp=GREEDY, cache=cache)
    np.testing.assert_array_equal(out, ref)
    for i, p in enumerate(PROMPTS):
        assert list(np.asarray(out[i])) == full_forward_greedy(params, p, n)


def test_paged_logits_equal_contiguous(params):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 11)), jnp.int32)
    full = transformer.forward(CFG, params, tokens)
    cache = PagedKVCache.create(2, 2, 16, 2, 16, num_pages=8, page_size=4)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    a, cache = transformer.forward(CFG, params, tokens[:, :6], pos, cache)
    cache = cache.advance(jnp.full((2,), 6))
    b, cache = transformer.forward(CFG, params, tokens[:, 6:], pos[:, :5] + 6, cache)
    np.testing.assert_allclose(jnp.concatenate([a, b], 1), full, rtol=1e-5, atol=1e-5)
    assert int(cache.alloc.num_free) == 8 - 2 * 3  # 11 tokens = 3 pages of 4 per sequence


def test_continuous_batching_join_leave_and_preemption(params):
    rng = np.random.default_rng(3)
    reqs = [Request(rng.integers(0, 256, size=int(rng.integers(2, 9))).astype(np.int32),
                    int(rng.integers(3, 14))) for _ in range(6)]
    expected = [full_forward_greedy(params, r.prompt, r.max_new_tokens) for r in reqs]
    roomy = Engine(CFG, params, EngineConfig(max_slots=3, max_prompt_len=8, max_len=24,
                                             num_pages=32, page_size=4))
    before = _traces()
    done = roomy.run([Request(r.prompt, r.max_new_tokens) for r in reqs])
    assert [d.output for d in done] == expected
    assert roomy.stats["prefills"] > 1  # requests joined while others were running
    assert np.subtract(_traces(), before).tolist() == [1, 1]  # one compile each for prefill and step, for every request mix
    tight = Engine(CFG, params, EngineConfig(max_slots=3, max_prompt_len=8, max_len=24,
                                             num_pages=6, page_size=4))
    done = tight.run([Request(r.prompt, r.max_new_tokens) for r in reqs])
    assert [d.output for d in done] == expected
    assert tight.stats["preemptions"] > 0


def _traces():
    from gendist.inference import engine
    return engine._prefill._cache_size(), engine._step._cache_size()


def test_exhausted_pool_refused_with_clear_error(params):
    eng = Engine(CFG, params, EngineConfig(max_slots=2, max_prompt_len=8, max_len=24,
                                           num_pages=7, page_size=4, preempt=False))
    reqs = [Request(np.arange(1, 9, dtype=np.int32), 14), Request(np.arange(2, 10, dtype=np.int32), 14)]
    with pytest.raises(pa.PagePoolExhausted, match="raise EngineConfig.num_pages"):
        eng.run(reqs)


def test_request_past_max_length_refused(params):
    eng = Engine(CFG, params, EngineConfig(max_slots=2, max_prompt_len=8, max_len=24,
                                           num_pages=16, page_size=4))
    with pytest.raises(ValueError, match="exceeds EngineConfig.max_prompt_len=8 or max_len=24"):
        eng.run([Request(np.arange(1, 6, dtype=np.int32), 30)])
    with pytest.raises(ValueError, match="EngineConfig.max_len=100 exceeds model.max_seq_len=64"):
        Engine(CFG, params, EngineConfig(max_len=100))
