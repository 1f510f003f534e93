"""Paged decoding equals the contiguous cache and the full forward; continuous batching."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_forward_greedy as greedy_oracle

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
    return greedy_oracle(CFG, params, prompt, n)


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


@pytest.fixture(scope="module")
def mix(params):
    """Six requests (prompt, max_new_tokens) and their full-forward greedy outputs."""
    rng = np.random.default_rng(3)
    base = [(rng.integers(0, 256, size=int(rng.integers(2, 9))).astype(np.int32),
             int(rng.integers(3, 14))) for _ in range(6)]
    return base, [full_forward_greedy(params, p, n) for p, n in base]


def test_continuous_batching_join_leave_and_preemption(params, mix):
    reqs = [Request(p, n) for p, n in mix[0]]
    expected = mix[1]
    roomy = Engine(CFG, params, EngineConfig(max_slots=3, max_prompt_len=8, max_len=24,
                                             num_pages=32, page_size=4))
    before = _traces()
    done = roomy.run([Request(r.prompt, r.max_new_tokens) for r in reqs])
    assert [d.output for d in done] == expected
    assert roomy.stats["prefills"] > 1  # requests joined while others were running
    prefills, steps = np.subtract(_traces(), before).tolist()
    # One step and a few prefill shapes (rows a power of two), for every request mix.
    assert steps == 1 and 1 <= prefills <= len(roomy.prefill_shapes())
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


def test_one_token_requests(params):
    """A request done at its prefill frees its slot at once, in both loops."""
    prompts = [np.arange(1, 9, dtype=np.int32), np.arange(3, 6, dtype=np.int32)]
    for overlap in (True, False):
        eng = Engine(CFG, params, EngineConfig(max_slots=2, max_prompt_len=8, max_len=24,
                                               num_pages=7, page_size=4, overlap=overlap))
        done = eng.run([Request(p, 1) for p in prompts] + [Request(prompts[1], 4)])
        assert [d.output for d in done] == [full_forward_greedy(params, p, n) for p, n in
                                             ((prompts[0], 1), (prompts[1], 1), (prompts[1], 4))]
        assert int(eng.cache.alloc.num_free) == 7


def test_request_past_max_length_refused(params):
    eng = Engine(CFG, params, EngineConfig(max_slots=2, max_prompt_len=8, max_len=24,
                                           num_pages=16, page_size=4))
    with pytest.raises(ValueError, match="exceeds EngineConfig.max_prompt_len=8 or max_len=24"):
        eng.run([Request(np.arange(1, 6, dtype=np.int32), 30)])
    with pytest.raises(ValueError, match="EngineConfig.max_len=100 exceeds model.max_seq_len=64"):
        Engine(CFG, params, EngineConfig(max_len=100))


def _kv_of(cache, slot, n):
    """K and V of a slot's first n tokens, read through its block table: [L, K, n, H] each."""
    table = np.asarray(cache.alloc.block_tables)[slot]
    pos = np.arange(n)
    page, off = table[pos // cache.page_size], pos % cache.page_size
    return [np.asarray(x)[:, :, page, off] for x in (cache.k_LKPZH, cache.v_LKPZH)]


def test_prefill_of_the_joiners_only_equals_a_full_batch_prefill(params):
    """The engine prefills only the joining rows into their slots; the cache and first tokens
    equal a prefill over every slot (non-joining rows padding, as the engine did before),
    and the tokens equal the full forward's. A step the pool cannot hold changes nothing."""
    from gendist.inference import decoder, engine
    S, T, pages = 3, 8, 6
    plan = decoder.plan(CFG, params, S, 24, "reference", paged=True)
    seqs = {2: np.arange(20, 28), 0: np.arange(40, 47)}  # slots 2 and 0 join: 2 + 2 pages

    def prefill(cache, rows):
        job = np.zeros((len(rows), 2 + T), np.int32)
        job[:, 0] = S  # padding
        for r, s in enumerate(rows):
            if s in seqs:
                job[r, :2] = s, len(seqs[s])
                job[r, 2: 2 + len(seqs[s])] = seqs[s]
        cache, nxt, _ = engine._prefill(plan, cache, jnp.zeros(S + 1, jnp.int32),
                                        jnp.zeros(S, bool), job, jax.random.key(0), sp=GREEDY)
        return cache, np.asarray(nxt)

    def empty():
        return plan.paged_cache(num_pages=pages, page_size=4, active=False, share_pages=False)

    sub, tok_sub = prefill(empty(), [2, 0])  # two rows: only the joiners
    full, tok_full = prefill(empty(), [0, 1, 2])  # every slot, slot 1 not joining
    assert tok_sub[S] == tok_full[S] == pa.OK
    for s, seq in seqs.items():
        assert tok_sub[s] == tok_full[s] == int(jnp.argmax(
            transformer.forward(CFG, params, jnp.asarray(seq)[None])[0, -1]))
        for a, b in zip(_kv_of(sub, s, len(seq)), _kv_of(full, s, len(seq)), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for c in (sub, full):
        assert np.asarray(c.lengths).tolist() == [7, 0, 8]
        assert np.asarray(c.alloc.active).tolist() == [True, False, True]
        assert int(c.alloc.num_free) == pages - 4

    # Slot 1 joins (the pool is then full); the next step needs two more pages and fails.
    seqs = {1: np.arange(60, 68)}
    cache, nxt = prefill(sub, [1])
    before = jax.tree.map(np.asarray, cache)
    after, nxt2, _ = engine._step(plan, cache, jnp.asarray(nxt), jnp.zeros(S, bool),
                                  jax.random.key(1), sp=GREEDY)
    assert int(nxt2[S]) == pa.NO_PAGES
    np.testing.assert_array_equal(np.asarray(nxt2[:S]), nxt[:S])  # the tokens wait
    after = jax.tree.map(np.asarray, after)
    for x, y in zip(jax.tree.leaves(before)[:-1], jax.tree.leaves(after)[:-1], strict=True):
        np.testing.assert_array_equal(x, y)  # pools, allocator, lengths (not the status)


def test_overlapped_loop_gives_the_synchronous_tokens_with_eos_and_preemption(params, mix):
    """Dispatching step t+1 before reading step t (EOS seen a step late, its extra token
    dropped; preemption decided from the host's page count) gives the synchronous loop's
    tokens, and those of the full forward cut at the EOS. A warm engine compiles nothing."""
    base, full = mix
    eos = min(full, key=len)[1]  # the shortest request stops a token early; the pool stays tight
    expected = [out[: out.index(eos) + 1] if eos in out else out for out in full]
    assert sum(len(e) < len(f) for e, f in zip(expected, full, strict=True)) >= 1
    runs = {}
    for overlap in (True, False):
        eng = Engine(CFG, params, EngineConfig(max_slots=3, max_prompt_len=8, max_len=24,
                                               num_pages=6, page_size=4, overlap=overlap))
        if overlap:
            eng.warmup()
            before = _traces()
        # Host data reaches the device only as each prefill's job and a mask of finished
        # slots, both explicit: no implicit transfer (an eager jnp op on host data) per step.
        with jax.transfer_guard_host_to_device("disallow"):
            done = eng.run([Request(p, n, eos_id=eos) for p, n in base])
        if overlap:
            assert _traces() == before  # every shape was compiled by warmup
        runs[overlap] = [d.output for d in done]
        assert eng.stats["preemptions"] > 0
        assert (eng.stats["overlapped_reads"] > 0) == overlap
        assert all(len(d.token_times) == len(d.output) for d in done)
        assert int(eng.cache.alloc.num_free) == 6 and not np.asarray(eng.cache.alloc.active).any()
    assert runs[True] == runs[False] == expected
