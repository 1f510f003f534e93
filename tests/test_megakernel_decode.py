"""Decoding through the chain megakernel (`decoder.plan(..., path="megakernel")`): on a CPU
its step runs with `chain_reference` (the kernel's math in XLA from the kernel's own inputs),
so the wiring around it (stacked, norm-folded weights, the cache layout and its update,
positions, RoPE angles, the output layer) is checked against the model's own decoding token
for token; on an sm90 GPU the kernel itself."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import LLAMA3, hf_llama_logits, llama_config, random_weights, write_llama

from gendist import hf
from gendist.config import ModelConfig
from gendist.inference import decoder
from gendist.inference import generate as G
from gendist.inference import megakernel as mk
from gendist.inference.sampling import SamplingParams
from gendist.models import transformer
from gendist.presets import preset
from pallas_kernels._mgpu import on_sm90

CFG = ModelConfig(d_model=128, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=64, d_ff=192,
                  max_seq_len=256, dtype="bfloat16")
# grouped-query attention: 2 query heads a kv head (one attention block serves both)
GQA = dataclasses.replace(CFG, d_model=256, num_heads=4, num_kv_heads=2)
GREEDY = SamplingParams(temperature=0.0)
ON_SM90 = jax.default_backend() == "gpu" and on_sm90()
KERNEL = None if ON_SM90 else mk.chain_reference  # None: the plan's own, the Mosaic GPU kernel


def init(cfg):
    p = transformer.init_params(cfg, 1)
    leaves, tree = jax.tree_util.tree_flatten_with_path(p)
    keys = jax.random.split(jax.random.key(7), len(leaves))

    def perturb(path, x, k):  # peaky logits; norm gains away from 1, different for every norm
        if "norm" in jax.tree_util.keystr(path):
            return x * (1 + 0.5 * jax.random.normal(k, x.shape))
        return x * 4 if x.ndim > 1 else x

    return jax.tree.unflatten(tree, [perturb(path, x, k) for (path, x), k in zip(leaves, keys, strict=True)])


@pytest.fixture(scope="module")
def params():
    return init(CFG)


@pytest.fixture(scope="module")
def gqa_params():
    return init(GQA)


def _generate(params, prompt, new, **kw):
    pb = jnp.asarray(prompt)[None]
    return G.generate_tokens(CFG, params, pb, jnp.array([prompt.size], jnp.int32), jax.random.key(0),
                             max_new_tokens=new, sp=GREEDY, **kw)


def _plan(params, max_len, kernel=KERNEL, cfg=CFG, head="xla", kernel_state=False):
    return decoder.plan(cfg, params, 1, max_len, "megakernel", kernel, head=head, kernel_state=kernel_state)


@pytest.mark.parametrize("prompt_len,gqa", [(5, False), (70, False), (70, True)])
def test_chain_steps_give_the_models_logits(params, gqa_params, prompt_len, gqa):
    """Teacher-forced: the prompt, then 10 given tokens one step at a time through the chain;
    each step's logits within twice the model's own bf16 error of the model's fp32 forward
    (same bf16-rounded weights). Both round differently (the chain keeps the residual in
    fp32, the model in bf16; ~1% each here); a wiring fault is far larger (the two norms'
    gains swapped: ~90%). Also with grouped-query attention (2 query heads a kv head)."""
    cfg, params = (GQA, gqa_params) if gqa else (CFG, params)
    got, model = _teacher_forced(cfg, params, prompt_len)
    assert got.max() <= 2 * model.max(), (got, model)


@pytest.mark.parametrize("head", ["kernel", "fused"])
def test_chain_steps_with_the_head_kernel_give_the_models_logits(params, head):
    """The same with the final norm and the output layer in their kernel (`head="kernel"`)
    or inside the megakernel (`head="fused"`: its table with the norm's gain folded in, the
    norm's factor applied to the kernel's pieces after it)."""
    got, model = _teacher_forced(CFG, params, 5, head=head)
    assert got.max() <= 2 * model.max(), (got, model)


def test_greedy_steps_skip_the_output_layers_factor(params):
    """order_only=True (what greedy `generate` asks for): with the output layer inside the
    kernel a step's logits come without the final norm's positive factor, the same ones
    scaled, so the same argmax; with XLA's output layer they are the logits."""
    prompt = jnp.arange(1, 9, dtype=jnp.int32)[None]
    for head in ("fused", "xla"):
        plan = _plan(params, 16, head=head)
        _, cache = plan.prefill(prompt, jnp.array([8], jnp.int32), plan.make_cache())
        full, _ = plan.step(jnp.array([3], jnp.int32), cache)
        order, _ = plan.step(jnp.array([3], jnp.int32), cache, order_only=True)
        ratio = np.asarray(full, np.float64) / np.asarray(order, np.float64)
        np.testing.assert_allclose(ratio, ratio.flat[0], rtol=1e-5)
        assert (ratio.flat[0] != 1.0) == (head == "fused") and ratio.flat[0] > 0
        assert int(jnp.argmax(full)) == int(jnp.argmax(order))


def test_the_head_choice_follows_the_path(params):
    """head="auto" (the default) puts the output layer inside the megakernel where it runs
    and the vocabulary is large (its folded table laid out once) or greedy steps a call
    bring it (`megakernel.GREEDY_STEPS`), XLA's elsewhere; "fused"
    off the megakernel path is refused. Plans for a CPU (the kernel's XLA reference), on any
    machine."""
    cpu, ref = ("cpu", "cpu"), mk.chain_reference
    big = dataclasses.replace(CFG, vocab_size=mk.FUSED_HEAD_MIN_VOCAB)
    big_params = init(big)
    mega = decoder.plan(big, big_params, 1, 16, "megakernel", ref, device=cpu)
    assert mega.head == "fused" and mega.params["chain_head"].shape == (big.vocab_size, big.d_model)
    assert decoder.plan(CFG, params, 1, 16, "megakernel", ref, device=cpu, greedy_steps=1).head == "xla"  # 256 rows
    if mk.GREEDY_STEPS > 1:  # greedy decoding's steps a call take the output layer inside at any vocabulary
        assert decoder.plan(CFG, params, 1, 16, "megakernel", ref, device=cpu).head == "fused"
    assert decoder.plan(big, big_params, 1, 16, "reference", device=cpu).head == "xla"
    with pytest.raises(ValueError, match="head='fused' runs the output layer inside the megakernel"):
        decoder.plan(CFG, params, 1, 16, "reference", head="fused", device=cpu)


def _teacher_forced(cfg, params, prompt_len, kernel=KERNEL, head="xla", kernel_state=False):
    """The relative errors [10] of 10 teacher-forced steps' logits through the chain, and of
    the model's own bf16 forward, against the model's fp32 forward (same bf16-rounded weights)."""
    rng = np.random.default_rng(prompt_len)
    tokens = jnp.asarray(rng.integers(0, 256, (1, prompt_len + 10)), jnp.int32)
    plan = _plan(params, prompt_len + 10, kernel, cfg=cfg, head=head, kernel_state=kernel_state)
    logits, cache = plan.prefill(tokens[:, :prompt_len], jnp.array([prompt_len], jnp.int32),
                                 plan.make_cache())
    assert isinstance(cache, mk.ChainCache)
    got = []
    for i in range(prompt_len, prompt_len + 10):
        step_logits, cache = plan.step(tokens[:, i], cache)
        got.append(step_logits[0])
    f32 = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32) if x.ndim > 1 else x  # noqa: E731
    exact = transformer.forward(dataclasses.replace(cfg, dtype="float32"), jax.tree.map(f32, params), tokens)
    model = transformer.forward(cfg, params, tokens)
    as64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    got, exact, model = as64(jnp.stack(got)), as64(exact[0, prompt_len:]), as64(model[0, prompt_len:])
    err = lambda a: np.linalg.norm(a - exact, axis=1) / np.linalg.norm(exact, axis=1)  # noqa: E731
    return err(got), err(model)


@pytest.mark.skipif(not ON_SM90, reason="the Mosaic GPU kernel at Llama-3.2-1B's widths: an sm90 GPU only")
@pytest.mark.parametrize("head,kernel_state", [("xla", False), ("kernel", False), ("fused", False),
                                               ("fused", True)])
def test_llama_widths_step_through_the_kernel_on_the_gpu(head, kernel_state):
    """Llama-3.2-1B's widths (32 query / 8 kv heads of 64, d_ff 8192, vocabulary 128256,
    llama3 RoPE scaling), 2 of its 16 layers, random weights: teacher-forced steps through
    the Mosaic GPU kernel give logits within twice the model's own bf16 error (with XLA's
    output layer, with the head kernel and with the output layer inside the megakernel;
    also with the kernel's words kept between steps)."""
    cfg = dataclasses.replace(preset("llama3.2-1b").model, num_layers=2, attention="xla")
    got, model = _teacher_forced(cfg, transformer.init_params(cfg, 1), 100, None, head, kernel_state)
    assert got.max() <= 2 * model.max(), (got, model)


def test_chain_decoding_runs_in_generate_tokens(params):
    """generate_tokens on path="megakernel": prefill, then steps through the chain in the loop;
    its first greedy tokens are the model's (later ones may part on a rounding tie)."""
    prompt = np.arange(3, 40, dtype=np.int32)
    want, _ = _generate(params, prompt, 12, path="reference")
    got, count = _generate(params, prompt, 12, path="megakernel", kernel=KERNEL)
    assert int(count[0]) == 12
    np.testing.assert_array_equal(np.asarray(got)[:, :4], np.asarray(want)[:, :4])


def test_chain_cache_holds_what_the_model_wrote(params):
    """After the prompt and a few steps the cache rows equal a contiguous cache's (the
    per-step update writes every layer's new k and v at its position)."""
    prompt = jnp.arange(1, 9, dtype=jnp.int32)[None]
    plan = _plan(params, 16, mk.chain_reference)
    logits, cache = plan.prefill(prompt, jnp.array([8], jnp.int32), plan.make_cache())
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    _, cache = plan.step(tok, cache)
    assert int(cache.lengths[0]) == 9 and cache.kv.shape == (2, 2, 2, 64, 64)
    # the model's own k and v at every position, from the same tokens as one prompt
    _, ref_cache = plan.prefill(jnp.concatenate([prompt, tok[:, None]], 1),
                                jnp.array([9], jnp.int32), plan.make_cache())
    got, want = np.asarray(cache.kv[:, :, :, :9], np.float32), np.asarray(ref_cache.kv[:, :, :, :9], np.float32)
    np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max())
    assert not np.asarray(cache.kv[:, :, :, 9:]).any()  # nothing written past the length


@pytest.mark.parametrize("kernel_state", [False, True])
def test_a_cache_asks_the_kernel_for_its_attention_splits(params, kernel_state):
    """decoder.plan(att_splits=N) (N attention blocks a query group, each over a split of the
    positions): its cache holds N and every kernel call of its steps (and the kept state's
    sizing) gets att_splits=N (none by default, `att_splits_for`), and the tokens are the
    unsplit plan's (the reference's math is one)."""
    seen = []

    def spy(*a, **kw):
        seen.append(kw.get("att_splits"))
        return mk.chain_reference(*a, **kw)

    prompt = jnp.arange(3, 20, dtype=jnp.int32)[None]
    outs = []
    for splits in (None, 4):
        plan = decoder.plan(CFG, params, 1, 64, "megakernel", spy, head="xla", kernel_state=kernel_state,
                            att_splits=splits)
        cache = plan.make_cache()
        assert cache.att_splits == (splits or mk.att_splits_for(64))
        logits, cache = plan.prefill(prompt, jnp.array([17], jnp.int32), cache)
        tok, got = jnp.argmax(logits, -1).astype(jnp.int32), []
        for _ in range(3):
            logits, cache = plan.step(tok, cache)
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
            got.append(int(tok[0]))
        outs.append(got)
    assert outs[0] == outs[1]
    assert set(seen) == {None, 4} and seen[-1] == 4 and mk.att_splits_for(64) == 1


def test_long_caches_split_the_attention_and_their_plans_keep_one_launch_a_step(params):
    """From `megakernel.SPLIT_CONTEXT` positions a cache splits each query group's positions
    over as many blocks as the grid holds (350m 8, Llama-3.2-1B's 32 query groups 4: 8 would
    need 256 blocks); a plan fixes its max_len's splits for every cache it makes, and a split
    plan takes one step a launch (greedy steps read their new k and v where they wrote them)."""
    m350, llama = preset("350m").model, preset("llama3.2-1b").model
    assert [mk.att_splits_for(n, m350, 132) for n in (64, mk.SPLIT_CONTEXT - 64, mk.SPLIT_CONTEXT, 4096)] == [1, 1, 8, 8]
    assert mk.att_splits_for(mk.SPLIT_CONTEXT, llama, 132) == 4 and mk.att_splits_for(4096, llama) == 4
    assert mk.att_splits_for(mk.SPLIT_CONTEXT, m350, 100) == 4 and mk.att_splits_for(4096) == 1  # no cfg: one
    long_ = decoder.plan(CFG, params, 1, mk.SPLIT_CONTEXT, "megakernel", KERNEL)
    assert (long_.att_splits, long_.greedy_steps) == (mk.att_splits_for(mk.SPLIT_CONTEXT, CFG), 1) != (1, 1)
    assert "split over" in long_.line and long_.make_cache(1, 64).att_splits == long_.att_splits
    short = decoder.plan(CFG, params, 1, mk.SPLIT_CONTEXT - 64, "megakernel", KERNEL)
    assert (short.att_splits, short.greedy_steps) == (1, mk.GREEDY_STEPS)
    assert short.make_cache(1, mk.SPLIT_CONTEXT + 64).att_splits == 1  # greedy steps' extra rows: the plan's
    wide = dataclasses.replace(CFG, head_dim=128)  # no megakernel: no splits, and its plans take none
    assert mk.supported(wide, 1) and mk.att_splits_for(4096, wide) == 1
    assert decoder.plan(wide, init(wide), 1, 2 * mk.SPLIT_CONTEXT, "reference").att_splits is None


def test_a_kept_kernel_state_decodes_the_same_tokens(params):
    """kernel_state=True: the cache carries the kernel's words from step to step and the
    kernel writes the new k and v (the reference writes them as the step would), and the
    plan says so; greedy tokens are those of fresh words each step, also after a rollback
    (on an sm90 GPU through the kernel itself, where x_0's square sums are summed in another
    order than XLA's: logits and cache rows within 1e-5 and a bf16 step). Off the megakernel
    path it is refused."""
    prompt = jnp.arange(3, 20, dtype=jnp.int32)[None]
    plans = [_plan(params, 64, kernel_state=k) for k in (False, True)]
    assert plans[1].line.endswith("its state kept between steps")
    assert plans[0].kernel_state is False and _plan(params, 64, kernel_state=None).kernel_state is mk.KEEP_STATE
    cache = plans[1].make_cache()
    assert cache.state is not None and cache.state.dtype == jnp.int32 and not cache.state.any()
    outs = [G.generate(p, prompt, jnp.array([17], jnp.int32), jax.random.key(0), max_new_tokens=16,
                       sp=GREEDY)[0] for p in plans]
    np.testing.assert_array_equal(np.asarray(outs[1]), np.asarray(outs[0]))
    caches = []
    for p in plans:  # three rejected drafts, a rollback, then three tokens
        _, c = p.prefill(prompt, jnp.array([17], jnp.int32), p.make_cache())
        for t in (200, 201, 202):
            _, c = p.step(jnp.array([t], jnp.int32), c)
        c = c.rollback(jnp.array([17], jnp.int32))
        got = []
        for t in (5, 6, 7):
            logits, c = p.step(jnp.array([t], jnp.int32), c)
            got.append(np.asarray(logits))
        caches.append((got, np.asarray(c.kv[:, :, :, :20], np.float32)))
    for a, b in zip(caches[1][0], caches[0][0], strict=True):
        if ON_SM90:
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
        else:
            np.testing.assert_array_equal(a, b)
    if ON_SM90:  # a bf16 rounding step at most
        np.testing.assert_allclose(caches[1][1], caches[0][1], rtol=2 ** -7, atol=1e-6)
    else:
        np.testing.assert_array_equal(caches[1][1], caches[0][1])
    with pytest.raises(ValueError, match="kernel_state=True keeps the megakernel's state"):
        decoder.plan(CFG, params, 1, 16, "reference", kernel_state=True, device=("cpu", "cpu"))


@pytest.mark.parametrize("steps", [4, 5])
def test_greedy_steps_a_call_decode_the_same_tokens(params, steps, monkeypatch):
    """greedy_steps=N: N tokens a megakernel call, each chosen inside the kernel (on a CPU by
    the reference's argmax), give one-step calls' greedy tokens, with an eos (tokens past it
    eos, the counts the same); where N does not divide the 15 tokens after the prompt's, the
    first call takes the rest (3, then 4 a call), so no call decodes past them; sampling
    still takes a call a token. A measured default (GREEDY_STEPS)
    brings the output layer inside and the kept state with it, unless either is declined;
    plans that cannot are refused."""
    prompt = jnp.arange(3, 20, dtype=jnp.int32)[None]
    one, many = (decoder.plan(CFG, params, 1, 64, "megakernel", KERNEL, head="fused", kernel_state=True,
                              greedy_steps=n) for n in (1, steps))
    assert many.greedy_steps == steps and many.line.endswith(f"{steps} greedy steps a call")
    assert one.greedy_steps == 1 and _plan(params, 64).greedy_steps == 1

    def run(p, new=16, **kw):
        out, count = G.generate(p, prompt, jnp.array([17], jnp.int32), jax.random.key(0), max_new_tokens=new,
                                **{"sp": GREEDY, **kw})
        return np.asarray(out), np.asarray(count)

    want, _ = run(one)
    traced = []

    def kernel(*args, steps=1, **kw):  # the plan's kernel, its decoding calls' steps recorded as traced
        if kw.get("advance"):
            traced.append(steps)
        return many.kernel(*args, steps=steps, **kw)

    got, count = run(dataclasses.replace(many, kernel=kernel))
    np.testing.assert_array_equal(got, want)
    assert count.tolist() == [16]
    assert traced == ([3, 4] if steps == 4 else [5])  # 3 + 3 x 4 and 3 x 5 tokens after the prompt's
    np.testing.assert_array_equal(run(many, new=steps + 2)[0], want[:, :steps + 2])  # a first call of one step
    eos = int(want[0, 6])  # a token the sequence reaches
    first = int(np.argmax(want[0] == eos))
    want_eos, want_count = run(one, eos_id=eos)
    got_eos, got_count = run(many, eos_id=eos)
    np.testing.assert_array_equal(got_eos, want_eos)
    assert got_count.tolist() == want_count.tolist() == [first + 1]
    hot = SamplingParams(temperature=1.0)
    np.testing.assert_array_equal(run(many, sp=hot)[0], run(one, sp=hot)[0])
    monkeypatch.setattr(mk, "GREEDY_STEPS", 4)  # a measured default: the head inside and the state kept
    auto = decoder.plan(CFG, params, 1, 64, "megakernel", KERNEL)
    assert (auto.greedy_steps, auto.head, auto.kernel_state) == (4, "fused", True)
    assert decoder.plan(CFG, params, 1, 64, "megakernel", KERNEL, head="xla").greedy_steps == 1
    assert decoder.plan(CFG, params, 1, 64, "megakernel", KERNEL, kernel_state=False).greedy_steps == 1
    # split attention declines them (a step's new k and v are read by the block that wrote them)
    assert decoder.plan(CFG, params, 1, 64, "megakernel", KERNEL, att_splits=4).greedy_steps == 1
    for bad in (dict(head="xla", kernel_state=True, greedy_steps=4), dict(head="fused", kernel_state=False,
                                                                         greedy_steps=4),
                dict(head="fused", kernel_state=True, greedy_steps=65),
                dict(head="fused", kernel_state=True, greedy_steps=4, att_splits=2)):
        with pytest.raises(ValueError, match="greedy_steps="):
            decoder.plan(CFG, params, 1, 64, "megakernel", KERNEL, **bad)


def test_unsupported_models_say_why():
    assert mk.supported(CFG, 2) == "batch 1 (this is batch 2)"
    assert mk.supported(GQA, 1) is None and mk.supported(dataclasses.replace(GQA, num_kv_heads=1), 1) is None
    assert "num_heads * head_dim == d_model (this has 2 x 128 for 128)" in mk.supported(
        dataclasses.replace(CFG, head_dim=128), 1)
    assert "head_dim a multiple of 64 (is 32)" in mk.supported(
        dataclasses.replace(CFG, head_dim=32, num_heads=4), 1)
    assert mk.supported(CFG, 1) is None
    with pytest.raises(ValueError, match="megakernel needs mlp='swiglu'"):
        mk.chain_params(dataclasses.replace(CFG, mlp="gelu"), {})


def test_rolled_back_chain_cache_decodes_as_a_fresh_one(params):
    """Speculative decoding rolls a cache back over rejected drafts: steps after a rollback
    (stale rows past the length) give the logits of a cache that never held them."""
    plan = _plan(params, 32, mk.chain_reference)
    prompt = jnp.arange(1, 9, dtype=jnp.int32)[None]
    _, fresh = plan.prefill(prompt, jnp.array([8], jnp.int32), plan.make_cache())
    _, used = plan.prefill(prompt, jnp.array([8], jnp.int32), plan.make_cache())
    for t in (200, 201, 202):  # three rejected drafts
        _, used = plan.step(jnp.array([t], jnp.int32), used)
    used = used.rollback(jnp.array([8], jnp.int32))
    for t in (5, 6, 7):
        want, fresh = plan.step(jnp.array([t], jnp.int32), fresh)
        got, used = plan.step(jnp.array([t], jnp.int32), used)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("kernel_state", [False, True])
def test_a_grouped_query_llama_checkpoint_decodes_through_the_megakernel(tmp_path, kernel_state):
    """A Llama checkpoint in the Hugging Face layout (2 query heads a kv head, head_dim 64,
    llama3 RoPE scaling, tied embeddings), loaded by `gendist.hf`: its greedy tokens through
    the megakernel (the kernel's XLA reference on a CPU, the kernel on an sm90 GPU) are the
    reference path's, the first is the Hugging Face forward's (NumPy, float64) argmax, and
    each step's logits are within twice the model's own bf16 error of that forward's; also
    with the kernel's state kept between steps."""
    hf_cfg = llama_config(vocab=96, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=128,
                          rope_scaling=LLAMA3)
    weights = random_weights(hf_cfg, seed=3)
    write_llama(tmp_path, hf_cfg, weights)
    cfg, params = hf.load(tmp_path, ModelConfig(dtype="bfloat16"))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.rope_llama3 is not None) == (4, 2, True)
    assert mk.supported(cfg, 1) is None
    prompt = np.arange(5, 29, dtype=np.int32) % 96
    run = lambda **kw: G.generate_tokens(  # noqa: E731
        cfg, params, jnp.asarray(prompt)[None], jnp.array([prompt.size], jnp.int32), jax.random.key(0),
        max_new_tokens=8, sp=GREEDY, **kw)
    want, _ = run(path="reference")
    plan = decoder.plan(cfg, params, 1, prompt.size + 8, "megakernel", KERNEL, kernel_state=kernel_state)
    got, count = G.generate(plan, jnp.asarray(prompt)[None], jnp.array([prompt.size], jnp.int32),
                            jax.random.key(0), max_new_tokens=8, sp=GREEDY)
    assert int(count[0]) == 8
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    ids = np.concatenate([prompt, np.asarray(got)[0]])[None]
    exact = hf_llama_logits(hf_cfg, weights, ids)[0, prompt.size - 1:-1]
    assert int(np.asarray(got)[0, 0]) == int(exact[0].argmax())
    # the steps' logits against Hugging Face's, within twice the model's own bf16 error
    plan = decoder.plan(cfg, params, 1, ids.shape[1], "megakernel", KERNEL, kernel_state=kernel_state)
    logits, cache = plan.prefill(jnp.asarray(prompt)[None], jnp.array([prompt.size], jnp.int32), plan.make_cache())
    steps = [logits[0]]
    for t in ids[0, prompt.size:-1]:
        step_logits, cache = plan.step(jnp.array([t], jnp.int32), cache)
        steps.append(step_logits[0])
    model = transformer.forward(cfg, params, jnp.asarray(ids))[0, prompt.size - 1:-1]
    err = lambda a: np.linalg.norm(np.asarray(a, np.float64) - exact, axis=1) / np.linalg.norm(exact, axis=1)  # noqa: E731
    assert err(jnp.stack(steps)).max() <= 2 * err(jnp.asarray(model, jnp.float32)).max()
