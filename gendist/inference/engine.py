"""Continuous batching over a paged KV cache: requests join and leave fixed batch slots.

Two jitted functions of fixed shape serve every request mix without recompiling: `prefill`
([slots, max_prompt_len], rows not joining carry position −1 and write nothing) and `step`
(one token for every active slot). The host loop admits waiting requests into free slots,
frees a slot's pages when its request finishes, and, when the page pool runs dry,
preempts the most recently admitted request (its pages are freed, it is re-queued with
its generated tokens and recomputed later, as vLLM does) or refuses with a clear error.
A failed step changes nothing: the allocator commits all-or-nothing and the host keeps
the previous state.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from gendist.config import ModelConfig
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
    backend: str = "xla"  # paged attention: "pallas" kernel or "xla" gather
    preempt: bool = True  # on an empty pool: preempt and recompute (False: raise)


@dataclasses.dataclass
class Request:
    prompt: np.ndarray  # int token ids
    max_new_tokens: int
    eos_id: int = -1
    output: list = dataclasses.field(default_factory=list)


@functools.partial(jax.jit, static_argnames=("cfg", "sp"))
def _prefill(cfg, params, cache, tokens_BT, pos_BT, key, *, sp):
    logits, cache = transformer.forward(cfg, params, tokens_BT, pos_BT, cache)
    last = jnp.argmax(pos_BT, axis=1)
    tok = sample(key, jnp.take_along_axis(logits, last[:, None, None], 1)[:, 0], sp)
    return cache, tok


@functools.partial(jax.jit, static_argnames=("cfg", "sp"))
def _step(cfg, params, cache, tok_B, pos_B, key, *, sp):
    logits, cache = transformer.forward(cfg, params, tok_B[:, None], pos_B[:, None], cache)
    return cache, sample(key, logits[:, 0], sp)


class Engine:
    """Serve a list of requests with continuous batching; `run` returns them completed."""

    def __init__(self, cfg: ModelConfig, params, ecfg: EngineConfig,
                 sp: SamplingParams = SamplingParams(temperature=0.0), seed: int = 0):
        if ecfg.max_len > cfg.max_seq_len:
            raise ValueError(f"EngineConfig.max_len={ecfg.max_len} exceeds model.max_seq_len="
                             f"{cfg.max_seq_len}; lower max_len.")
        # Matrices cast to the compute dtype once, not inside every jitted step.
        self.cfg, self.ecfg, self.sp = cfg, ecfg, sp
        self.params = transformer.inference_params(cfg, params)
        self.key = jax.random.key(seed)
        self.cache = PagedKVCache.create(
            cfg.num_layers, ecfg.max_slots, ecfg.max_len, cfg.num_kv_heads, cfg.head_dim,
            num_pages=ecfg.num_pages, page_size=ecfg.page_size,
            dtype=transformer.DTYPES[cfg.dtype], backend=ecfg.backend, active=False)
        self.stats = {"steps": 0, "prefills": 0, "preemptions": 0, "peak_pages": 0,
                      "tokens": 0}

    def _next_key(self):
        self.key, sub = jax.random.split(self.key)
        return sub

    def _admit(self, slot: int, req: Request):
        alloc, new_slot, status = pa.allocate_slot(self.cache.alloc)
        assert int(new_slot) == slot and int(status) == pa.OK
        self.cache = dataclasses.replace(self.cache, alloc=alloc)

    def _release(self, slot: int):
        self.cache = self.cache.free_slot(slot)

    def run(self, requests: list[Request]) -> list[Request]:
        e = self.ecfg
        for r in requests:
            if len(r.prompt) > e.max_prompt_len or len(r.prompt) + r.max_new_tokens > e.max_len:
                raise ValueError(
                    f"request of {len(r.prompt)} prompt + {r.max_new_tokens} new tokens exceeds "
                    f"EngineConfig.max_prompt_len={e.max_prompt_len} or max_len={e.max_len}.")
        queue = deque(requests)
        slots: list[Request | None] = [None] * e.max_slots
        order: list[int] = []  # admission order of occupied slots (preempt the newest)
        last = np.zeros(e.max_slots, np.int32)
        while queue or any(s is not None for s in slots):
            self._admit_waiting(queue, slots, order, last)
            active = np.array([s is not None for s in slots])
            pos = np.where(active, np.asarray(self.cache.lengths), 0).astype(np.int32)
            cache, tok = _step(self.cfg, self.params, self.cache, jnp.asarray(last),
                               jnp.asarray(pos), self._next_key(), sp=self.sp)
            if int(cache.status) != pa.OK:
                self._on_full(queue, slots, order)
                continue
            self.cache = cache.advance(jnp.asarray(active.astype(np.int32)))
            self.stats["steps"] += 1
            self.stats["peak_pages"] = max(self.stats["peak_pages"],
                                           e.num_pages - int(self.cache.alloc.num_free))
            tok = np.asarray(tok)
            for s, req in enumerate(slots):
                if req is None:
                    continue
                self._emit(req, int(tok[s]), s, slots, order, last)
        return requests

    def _emit(self, req, token, s, slots, order, last):
        req.output.append(token)
        last[s] = token
        self.stats["tokens"] += 1
        if len(req.output) >= req.max_new_tokens or token == req.eos_id:
            slots[s] = None
            order.remove(s)
            self._release(s)

    def _admit_waiting(self, queue, slots, order, last):
        e = self.ecfg
        joining = []
        for s in range(e.max_slots):
            if slots[s] is None and queue:
                req = queue[0]
                need = -(-(len(req.prompt) + len(req.output) + 1) // e.page_size)
                # Keep one page of headroom per running sequence, so a just-preempted
                # request is not re-admitted straight into the same shortage.
                if need + len(order) > int(self.cache.alloc.num_free):
                    break
                queue.popleft()
                self._admit(s, req)
                slots[s] = req
                order.append(s)
                joining.append(s)
        if not joining:
            return
        T = e.max_len  # a preempted request re-prefills its output too
        tokens = np.zeros((e.max_slots, T), np.int32)
        pos = np.full((e.max_slots, T), -1, np.int32)
        for s in joining:
            seq = np.concatenate([slots[s].prompt, np.asarray(slots[s].output, np.int32)])
            tokens[s, : len(seq)] = seq
            pos[s, : len(seq)] = np.arange(len(seq))
        cache, tok = _prefill(self.cfg, self.params, self.cache, jnp.asarray(tokens),
                              jnp.asarray(pos), self._next_key(), sp=self.sp)
        if int(cache.status) != pa.OK:
            raise pa.PagePoolExhausted(
                f"prefill could not reserve pages (status {pa.STATUS_NAMES[int(cache.status)]}); "
                "raise EngineConfig.num_pages")
        lengths = np.array(cache.lengths)
        for s in joining:
            lengths[s] = len(slots[s].prompt) + len(slots[s].output)
        self.cache = dataclasses.replace(cache, lengths=jnp.asarray(lengths))
        self.stats["prefills"] += 1
        tok = np.asarray(tok)
        for s in joining:
            self._emit(slots[s], int(tok[s]), s, slots, order, last)

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
