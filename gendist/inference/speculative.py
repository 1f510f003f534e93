"""Speculative decoding as one jitted `lax.while_loop`, with per-sequence acceptance.

Each step: the draft proposes γ tokens from its own KV cache; the target scores all γ+1
positions in one forward; modified rejection sampling (Leviathan et al. 2023, Chen et al.
2023) accepts draft token x with probability min(1, p(x)/q(x)), on the first rejection
samples from norm(max(0, p − q)), and after γ acceptances samples a bonus token from p.
The output distribution is exactly the target's. Greedy decoding (temperature 0) is the
same rule with one-hot p and q: accept while the target's argmax agrees.

Bookkeeping per sequence b: `n[b]` tokens are in both caches; `last[b]` (position n) is
committed but not yet fed. The draft's first call feeds [token at n−1, last] so that a
draft cache one token behind (all γ accepted last step) catches up in the same call.
Sequences advance by their own k+1 tokens; rejected positions are simply overwritten
later, since attention only sees keys at positions <= the query's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gendist.inference import decoder
from gendist.inference.lm import LM
from gendist.inference.sampling import SamplingParams, probs


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    gamma: int = 4  # draft tokens per step (the maximum when adaptive)
    adaptive: bool = False  # pick γ each step from the running acceptance rate
    cost_ratio: float = 0.1  # c = draft call time / target call time (for adaptive γ)
    ema: float = 0.8  # smoothing of the running acceptance-rate estimate

    def __post_init__(self):
        if self.gamma < 1:
            raise ValueError(f"gamma={self.gamma}: propose at least one draft token.")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"ema={self.ema} must be in [0, 1).")


def expected_tokens_per_cost(alpha, gamma, c):
    """Leviathan et al. eq. (1) over cost: (1 − α^(γ+1)) / ((1 − α)(γc + 1))."""
    alpha = jnp.clip(alpha, 1e-6, 1 - 1e-6)
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def _gather(x_BG, idx_B):
    return jnp.take_along_axis(x_BG, idx_B[:, None], axis=1)[:, 0]


def _draft(draft: LM, dparams, dcache, prev_B, last_B, n_B, key, sp, G, g_dyn, adaptive):
    """γ proposals d [B, G] and their distributions q [B, G, V].

    With a fixed γ the G − 1 draft calls are unrolled in the trace (no inner device loop,
    whose trip test costs a host round-trip per iteration on GPU); an adaptive γ picks one
    of G unrolled chains (1 .. G calls) with one `switch` per step. A greedy draft with
    `LM.greedy` (greedy steps inside the megakernel) makes the calls after the first one
    call: its γ − 1 tokens chosen in one kernel launch (from γ = 3; two tokens a call at
    least).
    """
    tok = jnp.stack([prev_B, last_B], 1)
    pos = jnp.stack([jnp.maximum(n_B - 1, 0), n_B], 1)
    logits, dcache = draft.apply(dparams, tok, pos, dcache)
    B, V = logits.shape[0], logits.shape[-1]
    # Greedy needs only the draft's argmax tokens: no distributions, no random keys.
    d_BG = jnp.zeros((B, G), jnp.int32)
    q_BGV = None if sp.greedy else jnp.zeros((B, G, V), jnp.float32)

    def propose(i, logits_BV, d_BG, q_BGV, key):
        if sp.greedy:
            return d_BG.at[:, i].set(jnp.argmax(logits_BV, -1).astype(jnp.int32)), q_BGV, key
        q = probs(logits_BV, sp)
        key, sub = jax.random.split(key)
        return d_BG.at[:, i].set(_sample(sub, q, sp)), q_BGV.at[:, i].set(q), key

    d_BG, q_BGV, key = propose(0, logits[:, 1], d_BG, q_BGV, key)

    def body(i, carry):
        dcache, d_BG, q_BGV, key = carry
        logits, dcache = draft.apply(dparams, d_BG[:, i - 1][:, None], (n_B + i)[:, None],
                                     dcache)
        return (dcache, *propose(i, logits[:, 0], d_BG, q_BGV, key))

    def in_one_call(n):  # draft tokens 1 .. n-1 in one greedy call: d_0 at position n + 1 on
        def run(carry):
            dcache, d_BG, q_BGV, key = carry
            toks_BN, dcache = draft.greedy(dparams, d_BG[:, 0], dcache.rollback(n_B + 1), n - 1)
            return dcache, d_BG.at[:, 1:n].set(toks_BN), q_BGV, key
        return run

    def unrolled(n):  # draft calls 1 .. n-1, straight-line
        if sp.greedy and draft.greedy is not None and n >= 3:
            return in_one_call(n)

        def run(carry):
            for i in range(1, n):
                carry = body(i, carry)
            return carry
        return run

    carry = (dcache, d_BG, q_BGV, key)
    if adaptive:  # one branch per γ: a single branch choice per step, not a loop test per call
        carry = jax.lax.switch(jnp.clip(g_dyn, 1, G) - 1,
                               [unrolled(n) for n in range(1, G + 1)], carry)
    else:
        carry = unrolled(G)(carry)
    dcache, d_BG, q_BGV, key = carry
    return d_BG, q_BGV, dcache, key


def _sample(key, p_BV, sp: SamplingParams):
    if sp.greedy:
        return jnp.argmax(p_BV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, jnp.log(p_BV), axis=-1).astype(jnp.int32)


def accept_greedy(d_BG, logits_BG1V, g_dyn):
    """Greedy acceptance: keep drafts while they equal the target's argmax; the next token
    is the target's argmax after the last kept draft. This is `accept` with one-hot p and q
    (a draft is accepted iff p(d) = 1; the residual max(0, p − q) is p's one-hot), without
    building the distributions."""
    G = d_BG.shape[1]
    t_BG1 = jnp.argmax(logits_BG1V, -1).astype(jnp.int32)
    ok = (d_BG == t_BG1[:, :G]) & (jnp.arange(G)[None, :] < g_dyn)
    k_B = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    return k_B, _gather(t_BG1, k_B)


def accept(key, d_BG, q_BGV, p_BG1V, g_dyn, sp: SamplingParams):
    """Modified rejection sampling: accepted count k [B] and the next token y [B]."""
    B, G = d_BG.shape
    k1, k2 = jax.random.split(key)
    pd = jnp.take_along_axis(p_BG1V[:, :G], d_BG[..., None], -1)[..., 0]
    qd = jnp.take_along_axis(q_BGV, d_BG[..., None], -1)[..., 0]
    r = jax.random.uniform(k1, (B, G))
    ok = (r * qd < pd) & (jnp.arange(G)[None, :] < g_dyn)
    k_B = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    p_k = jnp.take_along_axis(p_BG1V, k_B[:, None, None], 1)[:, 0]
    q_k = jnp.take_along_axis(q_BGV, jnp.minimum(k_B, G - 1)[:, None, None], 1)[:, 0]
    rejected = (k_B < g_dyn)[:, None]
    resid = jnp.where(rejected, jnp.maximum(p_k - q_k, 0.0), p_k)
    mass = jnp.sum(resid, -1, keepdims=True)
    resid = jnp.where(mass > 0, resid / jnp.where(mass > 0, mass, 1.0), p_k)
    return k_B, _sample(k2, resid, sp)


def _speculative_generate(target: LM, tparams, draft: LM, dparams, prompt_BT, prompt_len_B,
                          key, *, max_new_tokens: int, sp: SamplingParams, spec: SpecConfig,
                          eos_id: int = -1, tcache=None, dcache=None):
    """New tokens [B, max_new_tokens] (eos-padded), counts [B] and acceptance statistics."""
    B, P = prompt_BT.shape
    G = spec.gamma
    tparams, dparams = target.prepare(tparams), draft.prepare(dparams)
    max_len = P + max_new_tokens + G + 1
    tcache = target.make_cache(B, max_len) if tcache is None else tcache
    dcache = draft.make_cache(B, max_len) if dcache is None else dcache
    pos_BP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    _, tcache = target.apply(tparams, prompt_BT, pos_BP, tcache)
    _, dcache = draft.apply(dparams, prompt_BT, pos_BP, dcache)
    n_B = prompt_len_B.astype(jnp.int32) - 1
    tcache, dcache = tcache.rollback(n_B), dcache.rollback(n_B)
    last_B = _gather(prompt_BT, n_B)
    prev_B = _gather(prompt_BT, jnp.maximum(n_B - 1, 0))
    pad = max(eos_id, 0)
    state = dict(tc=tcache, dc=dcache, n=n_B, last=last_B, prev=prev_B, key=key,
                 out=jnp.full((B, max_new_tokens), pad, jnp.int32),
                 count=jnp.zeros((B,), jnp.int32), done=jnp.zeros((B,), bool),
                 accepted=jnp.zeros((), jnp.int32), accepted_B=jnp.zeros((B,), jnp.int32),
                 trials=jnp.zeros((), jnp.int32),
                 proposed=jnp.zeros((), jnp.int32),
                 steps=jnp.zeros((), jnp.int32), gamma=jnp.int32(G), alpha=jnp.float32(0.5))

    def body(s):
        g_dyn = s["gamma"]
        d_BG, q_BGV, dc, key = _draft(draft, dparams, s["dc"], s["prev"], s["last"], s["n"],
                                      s["key"], sp, G, g_dyn, spec.adaptive)
        tok = jnp.concatenate([s["last"][:, None], d_BG], 1)
        pos = s["n"][:, None] + jnp.arange(G + 1, dtype=jnp.int32)[None, :]
        logits, tc = target.apply(tparams, tok, pos, s["tc"])
        if sp.greedy:
            k_B, y_B = accept_greedy(d_BG, logits, g_dyn)
        else:
            key, sub = jax.random.split(key)
            k_B, y_B = accept(sub, d_BG, q_BGV, probs(logits, sp), g_dyn, sp)
        # Emitted this step: d_1..d_k then y; cut at EOS and at the token budget.
        j = jnp.arange(G + 1)[None, :]
        emit = jnp.where(j < k_B[:, None], jnp.pad(d_BG, ((0, 0), (0, 1))), y_B[:, None])
        n_emit = k_B + 1
        is_eos = (emit == eos_id) & (j < n_emit[:, None])
        first_eos = jnp.where(is_eos.any(1), jnp.argmax(is_eos, 1), G + 1)
        n_emit = jnp.minimum(jnp.minimum(n_emit, first_eos + 1), max_new_tokens - s["count"])
        active = ~s["done"]
        n_emit = jnp.where(active, n_emit, 0)
        rows = jnp.broadcast_to(jnp.arange(B)[:, None], emit.shape)
        cols = jnp.where(j < n_emit[:, None], s["count"][:, None] + j, max_new_tokens)
        out = s["out"].at[rows, cols].set(emit, mode="drop")
        count = s["count"] + n_emit
        done = s["done"] | (first_eos < n_emit) | (count >= max_new_tokens)
        n_new = jnp.where(active, s["n"] + k_B + 1, s["n"])
        prev_new = jnp.where(k_B > 0, _gather(d_BG, jnp.maximum(k_B - 1, 0)), s["last"])
        acc = jnp.sum(jnp.where(active, k_B, 0))
        trials = jnp.sum(jnp.where(active, k_B + (k_B < g_dyn), 0))
        alpha = jnp.where(trials > 0, spec.ema * s["alpha"]
                          + (1 - spec.ema) * acc / jnp.maximum(trials, 1), s["alpha"])
        gamma = g_dyn
        if spec.adaptive:
            gs = jnp.arange(1, G + 1)
            gamma = gs[jnp.argmax(expected_tokens_per_cost(alpha, gs, spec.cost_ratio))]
        return dict(tc=tc.rollback(n_new), dc=dc.rollback(n_new), n=n_new,
                    last=jnp.where(active, y_B, s["last"]),
                    prev=jnp.where(active, prev_new, s["prev"]), key=key, out=out,
                    count=count, done=done, accepted=s["accepted"] + acc,
                    trials=s["trials"] + trials,
                    accepted_B=s["accepted_B"] + jnp.where(active, k_B, 0),
                    proposed=s["proposed"] + jnp.sum(jnp.where(active, g_dyn, 0)),
                    steps=s["steps"] + 1, gamma=gamma.astype(jnp.int32),
                    alpha=alpha.astype(jnp.float32))

    s = jax.lax.while_loop(lambda s: ~jnp.all(s["done"]), body, state)
    # alpha = accepted / trials estimates the per-token acceptance rate (draft tokens after
    # a rejection are never tested); accepted / proposed is the fraction of drafts kept.
    stats = {"accepted": s["accepted"], "trials": s["trials"], "accepted_B": s["accepted_B"],
             "proposed": s["proposed"], "steps": s["steps"],
             "final_gamma": s["gamma"], "alpha_ema": s["alpha"]}
    return s["out"], s["count"], stats


def program_paths(target: LM, draft: LM) -> tuple[str, ...]:
    """The decode paths whose XLA options a speculative program takes
    (`decoder.compiler_options`): the target's alone. Its verification of γ + 1 tokens is
    what every step repeats; a megakernel draft's options (cuBLAS matmuls, for its scan over
    the layers) would compile it without Triton's fused matmuls and with more kernels a step
    (`benchmarks/speculative.md`), while the draft's scans without them copy at most the
    draft's few layer slices."""
    del draft
    return (target.path,)


# jitted with the XLA options of its paths (`program_paths`, `decoder.jit_by_path`)
speculative_generate = decoder.jit_by_path(
    _speculative_generate, ("target", "draft", "max_new_tokens", "sp", "spec", "eos_id"),
    lambda target, tparams, draft, *a, **kw: program_paths(target, draft))
