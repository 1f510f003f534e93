"""Continuous batching over a paged KV cache: requests join and leave fixed batch slots.

Jitted functions of fixed shape serve every request mix without recompiling: `prefill`
([slots, max_prompt_len], rows not joining carry position −1 and write nothing; a
preempted request that rejoins with its output so far takes the [slots, max_len] shape)
and `step` (one token for every active slot). The host loop admits waiting requests into
free slots, frees a slot's pages when its request finishes, and, when the page pool runs
dry, preempts the most recently admitted request (its pages are freed, it is re-queued
with its generated tokens and recomputed later, as vLLM does) or refuses with a clear
error. A failed step changes nothing: the allocator commits all-or-nothing and the host
keeps the previous state.

On a GPU the engine takes the decode fast path by default (`fastpath`: the decode weight
layout, one page pool per layer written in place, the Pallas paged kernel); on a CPU the
reference path, as before. Requests may carry arrival times (`run(realtime=True)`), and
every output token's time is recorded, for serving benchmarks
(`experiments/serve_trace.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from gendist.config import ModelConfig
from gendist.inference import fastpath
from gendist.inference import page_allocator as pa
from gendist.inference.paged_cache import PagedKVCache
from gendist.inference.sampling import SamplingParams, sample
from gendist.models import transformer


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_slots: int = 8  # sequences decoded together (the batch)
    max_prompt_len: int = 64  # longest prompt (prefill chunk width)
    max_len: int = 256  # longest sequence, prompt + output
    num_pages: int = 64  # pages per layer in the pool
    page_size: int = 16  # tokens per page
    backend: str = "auto"  # paged attention: "pallas" kernel, "xla" gather, "auto" (GPU: pallas)
    preempt: bool = True  # on an empty pool: preempt and recompute (False: raise)
    fast: bool | None = None  # decode layout + per-layer pools (None: on a GPU only)


@dataclasses.dataclass
class Request:
    prompt: np.ndarray  # int token ids
    max_new_tokens: int
    eos_id: int = -1
    output: list = dataclasses.field(default_factory=list)
    arrival: float = 0.0  # seconds after the start of `run` (realtime runs)
    token_times: list = dataclasses.field(default_factory=list)  # seconds after the start


# The cache is donated: its page pools are updated in place (without donation every call
# would copy every pool). A failed call (status != OK) returns the cache unchanged: the
# allocator commits all-or-nothing and no row is written.
@functools.partial(jax.jit, static_argnames=("cfg", "sp"), donate_argnums=(2,))
def _prefill(cfg, params, cache, tokens_BT, pos_BT, key, *, sp):
    logits, cache = transformer.forward(cfg, params, tokens_BT, pos_BT, cache)
    last = jnp.argmax(pos_BT, axis=1)
    tok = sample(key, jnp.take_along_axis(logits, last[:, None, None], 1)[:, 0], sp)
    return cache, tok


@functools.partial(jax.jit, static_argnames=("cfg", "sp"), donate_argnums=(2,))
def _step(cfg, params, cache, tok_B, pos_B, key, *, sp):
    """One token for every active slot; on success the slots' lengths advance by one."""
    key, sub = jax.random.split(key)
    logits, cache = transformer.forward(cfg, params, tok_B[:, None], pos_B[:, None], cache)
    ok = cache.status == pa.OK
    cache = cache.advance(jnp.where(ok & cache.alloc.active, 1, 0))
    return cache, sample(sub, logits[:, 0], sp), key


class Engine:
    """Serve a list of requests with continuous batching; `run` returns them completed."""

    def __init__(self, cfg: ModelConfig, params, ecfg: EngineConfig,
                 sp: SamplingParams = SamplingParams(temperature=0.0), seed: int = 0):
        if ecfg.max_len > cfg.max_seq_len:
            raise ValueError(f"EngineConfig.max_len={ecfg.max_len} exceeds model.max_seq_len="
                             f"{cfg.max_seq_len}; lower max_len.")
        if ecfg.backend not in ("auto", "xla", "pallas"):
            raise ValueError(f"EngineConfig.backend={ecfg.backend!r}; choose auto, xla or pallas.")
        # Matrices cast to the compute dtype once (the decode layout when fast), not inside
        # every jitted step.
        self.cfg, self.ecfg, self.sp = cfg, ecfg, sp
        fast = fastpath.enabled(ecfg.fast)
        self.params = fastpath.prepare(cfg, params, fast)
        backend = fastpath.attention_backend(cfg, None if ecfg.backend == "auto" else ecfg.backend)
        self.key = jax.random.key(seed)
        self.cache = PagedKVCache.create(
            cfg.num_layers, ecfg.max_slots, ecfg.max_len, cfg.num_kv_heads, cfg.head_dim,
            num_pages=ecfg.num_pages, page_size=ecfg.page_size,
            dtype=transformer.DTYPES[cfg.dtype], backend=backend, active=False,
            per_layer=fastpath.per_layer(cfg, fast), share_pages=False)  # nothing forks
        # page_steps / token_steps: pages held / tokens cached, summed over steps (means).
        self.stats = {"steps": 0, "prefills": 0, "preemptions": 0, "peak_pages": 0,
                      "tokens": 0, "page_steps": 0, "token_steps": 0}
        self._len = np.zeros(ecfg.max_slots, np.int32)  # host mirror of cache.lengths
        self._t0 = time.perf_counter()
        self._on_token = None

    def _next_key(self):
        self.key, sub = jax.random.split(self.key)
        return sub

    def _admit(self, slot: int, req: Request):
        alloc, new_slot, status = pa.allocate_slot(self.cache.alloc)
        assert int(new_slot) == slot and int(status) == pa.OK
        self.cache = dataclasses.replace(self.cache, alloc=alloc)

    def _release(self, slot: int):
        self.cache = self.cache.free_slot(slot)
        self._len[slot] = 0

    def warmup(self) -> None:
        """Compile prefill (both widths) and step without touching any sequence, so that a
        timed run pays no compile."""
        e = self.ecfg
        for T in sorted({e.max_prompt_len, e.max_len}):
            tokens = jnp.zeros((e.max_slots, T), jnp.int32)
            pos = jnp.full((e.max_slots, T), -1, jnp.int32)
            self.cache, _ = _prefill(self.cfg, self.params, self.cache, tokens, pos,
                                     self._next_key(), sp=self.sp)  # writes nothing
        zeros = jnp.zeros((e.max_slots,), jnp.int32)
        self.cache, _, _ = _step(self.cfg, self.params, self.cache, zeros, zeros,
                                 self._next_key(), sp=self.sp)  # no slot is active
        jax.block_until_ready(self.cache)

    def run(self, requests: list[Request], realtime: bool = False, on_token=None
            ) -> list[Request]:
        """Serve `requests` to completion. realtime: a request joins the queue only once
        `arrival` seconds have passed since the call (idle waits sleep). on_token(n) is
        called with the number of tokens emitted after each prefill and step."""
        e = self.ecfg
        for r in requests:
            if len(r.prompt) > e.max_prompt_len or len(r.prompt) + r.max_new_tokens > e.max_len:
                raise ValueError(
                    f"request of {len(r.prompt)} prompt + {r.max_new_tokens} new tokens exceeds "
                    f"EngineConfig.max_prompt_len={e.max_prompt_len} or max_len={e.max_len}.")
        pending = deque(sorted(requests, key=lambda r: r.arrival) if realtime else ())
        queue = deque() if realtime else deque(requests)
        slots: list[Request | None] = [None] * e.max_slots
        order: list[int] = []  # admission order of occupied slots (preempt the newest)
        last = np.zeros(e.max_slots, np.int32)
        self._t0 = time.perf_counter()
        self._on_token = on_token
        while pending or queue or any(s is not None for s in slots):
            now = time.perf_counter() - self._t0
            while pending and pending[0].arrival <= now:
                queue.append(pending.popleft())
            if not queue and not any(s is not None for s in slots):
                time.sleep(max(0.0, pending[0].arrival - now))
                continue
            self._admit_waiting(queue, slots, order, last)
            active = np.array([s is not None for s in slots])
            if not active.any():
                continue
            pos = np.where(active, self._len, 0).astype(np.int32)
            self.cache, tok, self.key = _step(self.cfg, self.params, self.cache,
                                              jnp.asarray(last), jnp.asarray(pos), self.key,
                                              sp=self.sp)
            # One transfer per step: status, tokens and free pages together.
            status, tok, free = jax.device_get((self.cache.status, tok,
                                                self.cache.alloc.num_free))
            if int(status) != pa.OK:
                self._on_full(queue, slots, order)
                continue
            self._len += active.astype(np.int32)
            self.stats["steps"] += 1
            in_use = e.num_pages - int(free)
            self.stats["peak_pages"] = max(self.stats["peak_pages"], in_use)
            self.stats["page_steps"] += in_use
            self.stats["token_steps"] += int(self._len[active].sum())
            stamp = time.perf_counter() - self._t0
            for s, req in enumerate(slots):
                if req is None:
                    continue
                self._emit(req, int(tok[s]), s, slots, order, last, stamp)
            if on_token is not None:
                on_token(int(active.sum()))
        return requests

    def _emit(self, req, token, s, slots, order, last, stamp):
        req.output.append(token)
        req.token_times.append(stamp)
        last[s] = token
        self.stats["tokens"] += 1
        if len(req.output) >= req.max_new_tokens or token == req.eos_id:
            slots[s] = None
            order.remove(s)
            self._release(s)

    def _admit_waiting(self, queue, slots, order, last):
        e = self.ecfg
        joining = []
        if not queue or all(s is not None for s in slots):
            return
        free = int(self.cache.alloc.num_free)
        for s in range(e.max_slots):
            if slots[s] is None and queue:
                req = queue[0]
                need = -(-(len(req.prompt) + len(req.output) + 1) // e.page_size)
                # Keep one page of headroom per running sequence, so a just-preempted
                # request is not re-admitted straight into the same shortage.
                if need + len(order) > free:
                    break
                free -= need
                queue.popleft()
                self._admit(s, req)
                slots[s] = req
                order.append(s)
                joining.append(s)
        if not joining:
            return
        seqs = {s: np.concatenate([slots[s].prompt, np.asarray(slots[s].output, np.int32)])
                for s in joining}
        # Fresh prompts fit the prompt width; a preempted request re-prefills its output too.
        T = e.max_prompt_len if max(map(len, seqs.values())) <= e.max_prompt_len else e.max_len
        tokens = np.zeros((e.max_slots, T), np.int32)
        pos = np.full((e.max_slots, T), -1, np.int32)
        for s, seq in seqs.items():
            tokens[s, : len(seq)] = seq
            pos[s, : len(seq)] = np.arange(len(seq))
        cache, tok = _prefill(self.cfg, self.params, self.cache, jnp.asarray(tokens),
                              jnp.asarray(pos), self._next_key(), sp=self.sp)
        self.cache = cache  # the old one was donated; on failure this one is unchanged
        status, tok = jax.device_get((cache.status, tok))
        if int(status) != pa.OK:
            raise pa.PagePoolExhausted(
                f"prefill could not reserve pages (status {pa.STATUS_NAMES[int(status)]}); "
                "raise EngineConfig.num_pages")
        for s, seq in seqs.items():
            self._len[s] = len(seq)
        self.cache = dataclasses.replace(cache, lengths=jnp.asarray(self._len))
        self.stats["prefills"] += 1
        stamp = time.perf_counter() - self._t0
        for s in joining:
            self._emit(slots[s], int(tok[s]), s, slots, order, last, stamp)
        if self._on_token is not None:
            self._on_token(len(joining))

    def _on_full(self, queue, slots, order):
        if not self.ecfg.preempt or len(order) <= 1:
            raise pa.PagePoolExhausted(
                f"the page pool ({self.ecfg.num_pages} pages of {self.ecfg.page_size} tokens) "
                "cannot hold the running sequences; raise EngineConfig.num_pages, lower "
                "max_slots, or enable preempt.")
        victim = order.pop()
        req = slots[victim]
        slots[victim] = None
        self._release(victim)
        queue.appendleft(req)  # recomputed from prompt + output so far when re-admitted
        self.stats["preemptions"] += 1
