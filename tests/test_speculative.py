"""Speculative decoding: exact target distribution, greedy identity, per-sequence acceptance,
one compile and no host transfers."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gendist.config import ModelConfig
from gendist.inference import decoder
from gendist.inference import generate as G
from gendist.inference import megakernel as mk
from gendist.inference.lm import markov_lm, transformer_lm
from gendist.inference.sampling import SamplingParams, probs
from gendist.inference.speculative import SpecConfig, speculative_generate
from gendist.models import transformer

V, N_SAMPLES, N_TOK = 5, 20_000, 3


def chi_square_pvalue(counts, expected_p, n):
    """Pearson chi-square p-value over cells with expected count >= 5 (rest pooled)."""
    exp = expected_p.ravel() * n
    obs = counts.ravel()
    big = exp >= 5
    o = np.append(obs[big], obs[~big].sum())
    e = np.append(exp[big], exp[~big].sum())
    keep = e > 0
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(jax.scipy.special.gammaincc(dof / 2, stat / 2)), stat, dof


def exact_first_tokens(table, sp, start):
    P = np.asarray(probs(table, sp), np.float64)
    ex = np.zeros((V,) * N_TOK)
    for seq in itertools.product(range(V), repeat=N_TOK):
        p, prev = 1.0, start
        for x in seq:
            p, prev = p * P[prev, x], x
        ex[seq] = p
    return ex


def empirical(out):
    counts = np.zeros((V,) * N_TOK)
    np.add.at(counts, tuple(np.asarray(out)[:, i] for i in range(N_TOK)), 1)
    return counts


@pytest.mark.parametrize("draft_scale,sp", [
    (5.0, SamplingParams(temperature=1.0)),  # a draft far from the target: alpha ~ 0.35
    (5.0, SamplingParams(temperature=1.0, top_k=4, top_p=0.9)),
    (0.2, SamplingParams(temperature=0.7, top_k=3)),  # draft close to the target
])
def test_distribution_is_exactly_the_targets(draft_scale, sp):
    rng = np.random.default_rng(1)
    target = jnp.asarray(rng.normal(size=(V, V)) * 1.5, jnp.float32)
    draft = target + draft_scale * jnp.asarray(rng.normal(size=(V, V)) * 2.0, jnp.float32)
    prompt = jnp.full((N_SAMPLES, 2), 1, jnp.int32)
    plen = jnp.full((N_SAMPLES,), 2, jnp.int32)
    out, count, stats = speculative_generate(
        markov_lm("t"), target, markov_lm("d"), draft, prompt, plen, jax.random.key(7),
        max_new_tokens=N_TOK, sp=sp, spec=SpecConfig(gamma=3))
    assert (np.asarray(count) == N_TOK).all()
    alpha = float(stats["accepted"]) / float(stats["trials"])  # per-token acceptance rate
    expected = exact_first_tokens(target, sp, start=1)
    p, stat, dof = chi_square_pvalue(empirical(out), expected, N_SAMPLES)
    assert p > 1e-3, f"chi2={stat:.1f} dof={dof} p={p:.2e} (alpha={alpha:.2f})"
    # The test has power: the draft's own distribution is rejected by the same check.
    wrong = exact_first_tokens(draft, sp, start=1)
    p_wrong, _, _ = chi_square_pvalue(empirical(out), wrong, N_SAMPLES)
    assert p_wrong < 1e-6
    if draft_scale > 1.0:
        assert alpha < 0.4, alpha  # a draft far from the target
    else:
        assert alpha > 0.5, alpha


CFG_T = ModelConfig(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, d_ff=64,
                    max_seq_len=96)
CFG_D = ModelConfig(d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, d_ff=32,
                    max_seq_len=96)


def lm(cfg, params, name, path="auto", **kw):
    """A transformer LM decoding through its plan (on a CPU "auto" is the reference path)."""
    return transformer_lm(decoder.plan(cfg, params, 1, cfg.max_seq_len, path, **kw), name)


@pytest.fixture(scope="module")
def models():
    tp = transformer.init_params(CFG_T, 0)
    tp = jax.tree.map(lambda x: x * 3 if x.ndim > 1 else x, tp)
    # A draft that agrees with the target often: the target's own embedding, small blocks.
    dp = transformer.init_params(CFG_D, 1)
    prompts = [np.array([5, 6, 7, 8, 9]), np.array([3, 4]), np.array([1, 2, 3, 4, 5, 6, 7, 8]),
               np.array([10, 11, 12])]
    pb, lb = G.pad_prompts(prompts)
    return tp, dp, jnp.asarray(pb), jnp.asarray(lb)


def plain_greedy(tp, pb, lb, n):
    out, _ = G.generate_tokens(CFG_T, tp, pb, lb, jax.random.key(0), max_new_tokens=n,
                               sp=SamplingParams(temperature=0.0))
    return np.asarray(out)


@pytest.mark.parametrize("draft_is_target", [False, True])
def test_greedy_equals_plain_greedy(models, draft_is_target):
    tp, dp, pb, lb = models
    n = 12
    target = lm(CFG_T, tp, "target")
    draft, dparams = (target, tp) if draft_is_target else (lm(CFG_D, dp, "draft"), dp)
    out, count, stats = speculative_generate(
        target, tp, draft, dparams, pb, lb, jax.random.key(0), max_new_tokens=n,
        sp=SamplingParams(temperature=0.0), spec=SpecConfig(gamma=3))
    np.testing.assert_array_equal(np.asarray(out), plain_greedy(tp, pb, lb, n))
    if draft_is_target:
        assert int(stats["accepted"]) == int(stats["proposed"])  # a perfect draft


def test_per_sequence_acceptance_equals_running_alone(models):
    tp, dp, pb, lb = models
    n = 10
    target, draft = lm(CFG_T, tp, "target"), lm(CFG_D, dp, "draft")
    kw = dict(max_new_tokens=n, sp=SamplingParams(temperature=0.0), spec=SpecConfig(gamma=4))
    out, _, stats = speculative_generate(target, tp, draft, dp, pb, lb, jax.random.key(0), **kw)
    acc = np.asarray(stats["accepted_B"])
    assert len(set(acc.tolist())) > 1, "sequences should accept different numbers of tokens"
    for b in range(pb.shape[0]):
        L = int(lb[b])
        alone, _, st = speculative_generate(target, tp, draft, dp, pb[b:b + 1, :L], lb[b:b + 1],
                                            jax.random.key(0), **kw)
        np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(out[b]))
        assert int(st["accepted_B"][0]) == acc[b]


def test_one_compile_and_no_host_transfers(models):
    tp, dp, pb, lb = models
    traces = []
    base = lm(CFG_T, tp, "counted")

    def counted_apply(*a):
        traces.append(1)
        return base.apply(*a)

    target = dataclasses.replace(base, apply=counted_apply)
    draft = lm(CFG_D, dp, "draft")
    kw = dict(max_new_tokens=8, sp=SamplingParams(temperature=1.0, top_k=20),
              spec=SpecConfig(gamma=3, adaptive=True))
    key = jax.device_put(jax.random.key(3))
    speculative_generate(target, tp, draft, dp, pb, lb, key, **kw)
    n_traced = len(traces)
    with jax.transfer_guard("disallow"):
        out, count, _ = speculative_generate(target, tp, draft, dp, pb, lb, key, **kw)
        jax.block_until_ready(out)
    assert len(traces) == n_traced == 2  # prefill + the loop body, traced once
    assert (np.asarray(count) == 8).all()


def test_greedy_with_paged_caches_equals_plain_greedy(models):
    from gendist.inference.paged_cache import PagedKVCache
    tp, dp, pb, lb = models
    n = 10

    def paged(cfg, batch, max_len):
        return PagedKVCache.create(cfg.num_layers, batch, max_len, cfg.num_kv_heads,
                                   cfg.head_dim, num_pages=batch * (-(-max_len // 4)),
                                   page_size=4)

    target = transformer_lm(decoder.plan(CFG_T, tp, 4, 96), "target-paged", cache_factory=paged)
    draft = transformer_lm(decoder.plan(CFG_D, dp, 4, 96), "draft-paged", cache_factory=paged)
    out, _, _ = speculative_generate(target, tp, draft, dp, pb, lb, jax.random.key(0),
                                     max_new_tokens=n, sp=SamplingParams(temperature=0.0),
                                     spec=SpecConfig(gamma=3))
    np.testing.assert_array_equal(np.asarray(out), plain_greedy(tp, pb, lb, n))


CFG_MK = ModelConfig(d_model=128, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=64,
                     d_ff=192, max_seq_len=96, dtype="bfloat16")  # the megakernel's kind


@pytest.mark.parametrize("gamma,kernel_state,adaptive", [
    (1, False, False), (3, False, False), (3, True, False), (5, True, True)])
def test_greedy_with_a_megakernel_draft_equals_plain_greedy(models, gamma, kernel_state, adaptive):
    """The draft decodes through the megakernel (its XLA reference here), its cache rolled
    back over rejected drafts every round: the tokens are plain greedy's. With the kernel's
    state kept, the plan's default greedy steps make the draft's calls after the first one
    kernel launch (`LM.greedy`, from γ = 3; with adaptive γ the chains of 3 or more)."""
    tp, _, pb, lb = models
    n = 10
    dp = transformer.init_params(CFG_MK, 4)
    on_sm90 = decoder.hopper(decoder.this_device()[1])  # the kernel itself, else its XLA math
    draft = lm(CFG_MK, dp, "draft-megakernel", "megakernel",
               kernel=None if on_sm90 else mk.chain_reference, kernel_state=kernel_state)
    assert (draft.greedy is not None) == kernel_state  # the default greedy steps need the kept state
    launches = []
    if draft.greedy is not None:
        def counted(params, tokens_B, cache, steps):  # traced once per chain length
            launches.append(steps)
            return greedy(params, tokens_B, cache, steps)
        greedy, draft = draft.greedy, dataclasses.replace(draft, greedy=counted)
    out, count, stats = speculative_generate(
        lm(CFG_T, tp, "target"), tp, draft, dp, pb[:1], lb[:1], jax.random.key(0),
        max_new_tokens=n, sp=SamplingParams(temperature=0.0), spec=SpecConfig(gamma=gamma, adaptive=adaptive))
    np.testing.assert_array_equal(np.asarray(out), plain_greedy(tp, pb[:1], lb[:1], n))
    assert int(count[0]) == n and int(stats["proposed"]) > int(stats["accepted"])  # rollbacks
    assert sorted(launches) == ([] if not kernel_state else list(range(2, gamma)))


def test_a_megakernel_draft_leaves_the_verification_with_xla_defaults(models):
    """A speculative program takes the XLA options of its target's path alone
    (`speculative.program_paths`): a megakernel draft does not switch the target's
    verification, which every step repeats, to cuBLAS matmuls; plain megakernel decoding
    keeps its options."""
    tp, _, pb, lb = models
    dp = transformer.init_params(CFG_MK, 4)
    draft = lm(CFG_MK, dp, "draft-megakernel", "megakernel", kernel=mk.chain_reference)
    target = lm(CFG_T, tp, "target-fast", "fast")
    args = (target, tp, draft, dp, pb[:1], lb[:1], jax.random.key(0))
    kw = dict(max_new_tokens=4, sp=SamplingParams(temperature=0.0), spec=SpecConfig(gamma=3))
    assert (target.path, draft.path) == ("fast", "megakernel")
    program = speculative_generate.program(*args, **kw)
    assert program is speculative_generate.for_paths("fast") is speculative_generate.for_paths()
    assert program is not speculative_generate.for_paths("megakernel")
    plan = decoder.plan(CFG_MK, dp, 1, 16, path="megakernel", kernel=mk.chain_reference)
    assert G.generate.program(plan, pb[:1], lb[:1], jax.random.key(0)) is G.generate.for_paths("megakernel")


@pytest.mark.parametrize("gamma,adaptive", [(3, False), (6, False), (6, True)])
def test_a_megakernel_draft_proposes_in_one_launch_what_it_proposes_a_call_a_token(gamma, adaptive):
    """`_draft` of a greedy megakernel draft (the kernel on an sm90 GPU, its XLA reference
    elsewhere): γ proposals with the tokens after the first in one launch (`LM.greedy`) equal
    those of one kernel call a token, from rolled-back caches at two positions. (Speculative
    decoding's output cannot tell: it is the target's whatever the draft proposes.)"""
    from gendist.inference.speculative import _draft
    dp = jax.tree.map(lambda x: x * 3 if x.ndim > 1 else x, transformer.init_params(CFG_MK, 4))
    on_sm90 = decoder.hopper(decoder.this_device()[1])
    draft = lm(CFG_MK, dp, "draft-megakernel", "megakernel", kernel=None if on_sm90 else mk.chain_reference,
               kernel_state=True)
    assert draft.greedy is not None
    params = draft.prepare(dp)
    toks_BT = jnp.asarray(np.random.default_rng(0).integers(0, CFG_MK.vocab_size, (1, 40)), jnp.int32)
    _, cache = draft.apply(params, toks_BT, jnp.arange(40)[None], draft.make_cache(1, CFG_MK.max_seq_len))
    sp = SamplingParams(temperature=0.0)

    @functools.partial(jax.jit, static_argnums=(0,))
    def propose(one_launch, cache, n_B):
        lm_ = draft if one_launch else dataclasses.replace(draft, greedy=None)
        d_BG, *_ = _draft(lm_, params, cache.rollback(n_B), toks_BT[:, n_B[0] - 1], toks_BT[:, n_B[0]], n_B,
                          jax.random.key(0), sp, gamma, jnp.int32(gamma - 1 if adaptive else gamma), adaptive)
        return d_BG
    for n in (17, 39):
        n_B = jnp.array([n], jnp.int32)
        got, want = propose(True, cache, n_B), propose(False, cache, n_B)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert len(set(np.asarray(want)[0, :gamma - int(adaptive)].tolist())) > 1  # proposals that vary


def test_greedy_acceptance_equals_the_rejection_rule_with_one_hot_distributions():
    from gendist.inference.speculative import accept, accept_greedy
    B, G, V = 64, 5, 4  # a tiny vocabulary so drafts often agree with the target
    kd, kl = jax.random.split(jax.random.key(3))
    d_BG = jax.random.randint(kd, (B, G), 0, V)
    logits = jax.random.normal(kl, (B, G + 1, V))
    sp = SamplingParams(temperature=0.0)
    p = jax.nn.one_hot(jnp.argmax(logits, -1), V)
    q = jax.nn.one_hot(d_BG, V)
    for g in (G, 3):
        k_ref, y_ref = accept(jax.random.key(0), d_BG, q, p, jnp.int32(g), sp)
        k, y = accept_greedy(d_BG, logits, jnp.int32(g))
        np.testing.assert_array_equal(k, k_ref)
        np.testing.assert_array_equal(y, y_ref)
    assert 0 < int(jnp.sum(k)) < B * G  # both accepted and rejected drafts occur
