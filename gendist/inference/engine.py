"""Continuous batching over a paged KV cache: requests join and leave fixed batch slots.

Jitted functions of a few fixed shapes serve every request mix without recompiling:

* `prefill` computes only the requests that join: [R, T] with R a power of two up to
  `prefill_rows` (more joiners take several calls) and T the prompt width ([1, max_len] for
  a preempted request that rejoins with its output so far, rare). Row r is slot rows_R[r] of the
  paged cache, through a row view (`PagedKVCache.take_rows`/`put_rows`), so a prefill costs
  what its joiners cost, not the whole batch.
* `step` decodes one token for every active slot. Its input tokens stay on the device (the
  previous call's output) and its positions are the cache's lengths: nothing is copied to
  the device per step.

The host runs one call ahead of what it reads (`overlap`): it dispatches step t+1 before it
reads step t's tokens, so the device does not wait for Python bookkeeping and transfers.
What the host must know before a dispatch it knows without reading the device: which
requests reach max_new_tokens (it counts the tokens dispatched), and the pages every slot
holds (the allocator is deterministic: ceil(length / page_size) pages per slot) and so
whether the next step fits in the pool. An EOS is seen one step late: the extra token is
discarded and the slot freed then. When the next step would not fit, the host first reads
everything in flight (an EOS may free pages); if it still does not fit, it preempts the most
recently admitted request (its pages are freed, it is re-queued with its generated tokens
and recomputed later, as vLLM does) or refuses with a clear error. The device still checks
the allocator in every call; a failed call changes nothing (the allocator commits
all-or-nothing, no row is written) and the host raises.

The model decodes through the front door (`decoder.plan`, `EngineConfig.path`, with a paged
cache): on a GPU the fast path by default (the decode weight layout, one page pool per layer
written in place, the Pallas paged kernel); on a CPU the reference path. Requests may carry arrival times (`run(realtime=True)`), and
every output token's time (when the host reads it) is recorded, for serving benchmarks
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
from gendist.inference import decoder
from gendist.inference import page_allocator as pa
from gendist.inference.sampling import SamplingParams, sample


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_slots: int = 8  # sequences decoded together (the batch)
    max_prompt_len: int = 64  # longest prompt (prefill chunk width)
    max_len: int = 256  # longest sequence, prompt + output
    num_pages: int = 64  # pages per layer in the pool
    page_size: int = 16  # tokens per page
    backend: str = "auto"  # paged attention: "pallas" kernel, "xla" gather, "auto" (GPU: pallas)
    preempt: bool = True  # on an empty pool: preempt and recompute (False: raise)
    path: str = "auto"  # decode path (`decoder`): auto, fast (per-layer pools) or reference
    prefill_rows: int = 8  # most joiners per prefill call (row counts: powers of two up to it)
    overlap: bool = True  # dispatch each call before reading the last one's tokens (same tokens)


@dataclasses.dataclass
class Request:
    prompt: np.ndarray  # int token ids
    max_new_tokens: int
    eos_id: int = -1
    output: list = dataclasses.field(default_factory=list)
    arrival: float = 0.0  # seconds after the start of `run` (realtime runs)
    token_times: list = dataclasses.field(default_factory=list)  # seconds after the start


# Every call returns the device's next input tokens as one int32 array [S + 1]: the slots'
# tokens, then the allocator status of the call. The host reads it a call later; the next
# call reads it on the device. The cache is donated: its page pools are updated in place
# (without donation every call would copy every pool). A failed call (status != OK) leaves
# the cache and the tokens unchanged, but for the frees it was given: the allocator commits
# all-or-nothing and no row is written.
@functools.partial(jax.jit, static_argnames=("sp",), donate_argnums=(1,))
def _prefill(plan, cache, next_S1, free_S, job_RC, key, *, sp):
    """Frees the slots in free_S (finished since the last call), then the joiners: job_RC
    [R, 2 + T] holds per row its slot (>= S: a padding row), its length and its tokens.
    Claims the slots, fills their pages, samples their first token."""
    S = cache.lengths.shape[0]
    cache = cache.free_slots(free_S)
    rows_R, len_R, tokens_RT = job_RC[:, 0], job_RC[:, 1], job_RC[:, 2:]
    t_T = jnp.arange(tokens_RT.shape[1], dtype=jnp.int32)
    pos_RT = jnp.where(t_T[None, :] < len_R[:, None], t_T[None, :], -1)
    key, sub = jax.random.split(key)
    view = cache.take_rows(rows_R, activate=True)
    logits, view = plan.forward(tokens_RT, pos_RT, view)
    ok = view.status == pa.OK
    view = dataclasses.replace(
        view, lengths=jnp.where(ok & view.alloc.active, len_R, view.lengths),
        alloc=dataclasses.replace(view.alloc, active=view.alloc.active & ok))
    cache = cache.put_rows(view, rows_R)
    last_R = jnp.maximum(len_R - 1, 0)
    tok_R = sample(sub, jnp.take_along_axis(logits, last_R[:, None, None], 1)[:, 0], sp)
    next_S1 = next_S1.at[rows_R].set(jnp.where(ok, tok_R, next_S1[jnp.minimum(rows_R, S)]),
                                     mode="drop")
    return cache, next_S1.at[S].set(view.status), key


@functools.partial(jax.jit, static_argnames=("sp",), donate_argnums=(1,))
def _step(plan, cache, next_S1, free_S, key, *, sp):
    """Frees the slots in free_S, then one token for every active slot at its cached length;
    on success the lengths advance."""
    S = cache.lengths.shape[0]
    cache = cache.free_slots(free_S)
    key, sub = jax.random.split(key)
    active_S = cache.alloc.active
    pos_S = jnp.where(active_S, cache.lengths, 0)
    logits, cache = plan.forward(next_S1[:S, None], pos_S[:, None], cache)
    ok = cache.status == pa.OK
    cache = cache.advance(jnp.where(ok & active_S, 1, 0))
    tok_S = jnp.where(ok, sample(sub, logits[:, 0], sp), next_S1[:S])
    return cache, jnp.concatenate([tok_S, cache.status[None]]), key


@functools.partial(jax.jit, donate_argnums=(0,))
def _free(cache, mask_S):
    return cache.free_slots(mask_S)


class Engine:
    """Serve a list of requests with continuous batching; `run` returns them completed."""

    def __init__(self, cfg: ModelConfig, params, ecfg: EngineConfig,
                 sp: SamplingParams = SamplingParams(temperature=0.0), seed: int = 0):
        if ecfg.max_len > cfg.max_seq_len:
            raise ValueError(f"EngineConfig.max_len={ecfg.max_len} exceeds model.max_seq_len="
                             f"{cfg.max_seq_len}; lower max_len.")
        if ecfg.backend not in ("auto", "xla", "pallas"):
            raise ValueError(f"EngineConfig.backend={ecfg.backend!r}; choose auto, xla or pallas.")
        if ecfg.prefill_rows < 1:
            raise ValueError(f"EngineConfig.prefill_rows={ecfg.prefill_rows} must be >= 1.")
        # The weights laid out for the path once (cast; the decode layout on the fast
        # path), not inside every jitted step.
        self.cfg, self.ecfg, self.sp = cfg, ecfg, sp
        self.plan = decoder.plan(cfg, params, ecfg.max_slots, ecfg.max_len, ecfg.path,
                                 paged=True,
                                 backend=None if ecfg.backend == "auto" else ecfg.backend)
        self.key = jax.random.key(seed)
        self.cache = self.plan.paged_cache(num_pages=ecfg.num_pages, page_size=ecfg.page_size,
                                           active=False, share_pages=False)  # nothing forks
        self._next = jnp.zeros((ecfg.max_slots + 1,), jnp.int32)  # see `_step`
        self._no_free = jnp.zeros((ecfg.max_slots,), bool)  # on the device: no transfer
        # page_steps / token_steps: pages held / tokens cached, summed over steps (means);
        # prefill_tokens: rows x width computed by prefills, padding included;
        # overlapped_reads: calls read while a later one was already dispatched.
        self.stats = {"steps": 0, "prefills": 0, "preemptions": 0, "peak_pages": 0,
                      "tokens": 0, "page_steps": 0, "token_steps": 0, "prefill_tokens": 0,
                      "overlapped_reads": 0}
        # Host mirror of the device after every call dispatched so far: the request in each
        # slot, its tokens cached, tokens dispatched (read or in flight), slots to free.
        self._slots: list[Request | None] = [None] * ecfg.max_slots
        self._order: list[int] = []  # admission order of occupied slots (preempt the newest)
        self._len = np.zeros(ecfg.max_slots, np.int64)
        self._sent = np.zeros(ecfg.max_slots, np.int64)
        self._to_free = np.zeros(ecfg.max_slots, bool)
        self._t0 = time.perf_counter()
        self._on_token = None

    # ------------------------------------------------------------------ shapes and warm-up

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (rows, width) a prefill may take: fresh prompts in power-of-two row counts,
        a preempted request rejoining (rare) one at a time at max_len."""
        e = self.ecfg
        cap = min(e.prefill_rows, e.max_slots)
        rows = sorted({min(1 << i, cap) for i in range(cap.bit_length() + 1)})
        wide = [(1, e.max_len)] if e.max_len > e.max_prompt_len else []
        return [(r, e.max_prompt_len) for r in rows] + wide

    def warmup(self) -> None:
        """Compile every prefill shape, the step and the free without touching any sequence,
        so that a timed run pays no compile."""
        S = self.ecfg.max_slots
        for r, t in self.prefill_shapes():
            job = np.zeros((r, 2 + t), np.int32)
            job[:, 0] = S  # padding rows: write nothing
            self.cache, self._next, self.key = _prefill(
                self.plan, self.cache, self._next, self._no_free,
                jax.device_put(job), self.key, sp=self.sp)  # as `run` passes it
        self.cache, self._next, self.key = _step(self.plan, self.cache, self._next,
                                                 self._no_free, self.key, sp=self.sp)
        self.cache = _free(self.cache, self._no_free)
        jax.block_until_ready((self.cache, self._next))

    # ------------------------------------------------------------------ the loop

    def run(self, requests: list[Request], realtime: bool = False, on_token=None
            ) -> list[Request]:
        """Serve `requests` to completion. realtime: a request joins the queue only once
        `arrival` seconds have passed since the call (idle waits sleep). on_token(n) is
        called with the number of tokens emitted after each prefill and step is read."""
        e = self.ecfg
        for r in requests:
            if len(r.prompt) > e.max_prompt_len or len(r.prompt) + r.max_new_tokens > e.max_len:
                raise ValueError(
                    f"request of {len(r.prompt)} prompt + {r.max_new_tokens} new tokens exceeds "
                    f"EngineConfig.max_prompt_len={e.max_prompt_len} or max_len={e.max_len}.")
        pending = deque(sorted(requests, key=lambda r: r.arrival) if realtime else ())
        queue = deque() if realtime else deque(requests)
        inflight: deque = deque()  # (tokens [S + 1] on the device, [(slot, request)])
        self._stopped: set[int] = set()  # id() of requests whose output is complete
        self._lag = 1 if e.overlap else 0  # calls left unread after a dispatch
        self._t0 = time.perf_counter()
        self._on_token = on_token
        while pending or queue or self._order or inflight:
            now = time.perf_counter() - self._t0
            while pending and pending[0].arrival <= now:
                queue.append(pending.popleft())
            if not queue and not self._order:
                if inflight:
                    self._read(inflight)
                else:
                    time.sleep(max(0.0, pending[0].arrival - now))
                continue
            admitted = self._admit_waiting(queue, inflight)
            if self._order:
                if not self._step_fits():
                    if inflight:  # an EOS not read yet may free pages
                        while inflight:
                            self._read(inflight)
                    else:
                        self._preempt(queue)
                    continue
                self._dispatch_step(inflight)
            elif not admitted and not inflight:  # the empty pool cannot take the next one
                raise pa.PagePoolExhausted(
                    f"a request of {len(queue[0].prompt) + len(queue[0].output)} tokens does not "
                    f"fit the empty pool of {e.num_pages} pages of {e.page_size} tokens; raise "
                    "EngineConfig.num_pages")
            while inflight and not self._order:
                self._read(inflight)
        if self._to_free.any():
            self.cache = _free(self.cache, self._frees())
        return requests

    def _pages(self, lengths):
        return -(-lengths // self.ecfg.page_size)

    def _free_pages(self) -> int:
        return self.ecfg.num_pages - int(self._pages(self._len).sum())  # free slots: length 0

    def _step_fits(self) -> bool:
        """Whether the next step finds its pages: a slot whose length is a multiple of the
        page size starts a new page (what `pa.grow_batch` checks on the device)."""
        occupied = np.asarray(self._order)
        need = int(np.sum(self._len[occupied] % self.ecfg.page_size == 0))
        return need <= self._free_pages()

    def _frees(self):
        """The slots freed on the host since the last call, for the next call to free."""
        if not self._to_free.any():
            return self._no_free
        mask = jax.device_put(self._to_free.copy())
        self._to_free[:] = False
        return mask

    def _release(self, s: int):
        """Host side now; on the device before the next call."""
        self._slots[s] = None
        self._order.remove(s)
        self._len[s] = self._sent[s] = 0
        self._to_free[s] = True

    def _sent_token(self, s: int):
        """One more token dispatched for slot s: free the slot once its request has all."""
        self._sent[s] += 1
        if self._sent[s] >= self._slots[s].max_new_tokens:
            self._release(s)

    def _dispatch_step(self, inflight):
        self.cache, self._next, self.key = _step(self.plan, self.cache, self._next,
                                                 self._frees(), self.key, sp=self.sp)
        self._next.copy_to_host_async()
        occupied = list(self._order)
        inflight.append((self._next, [(s, self._slots[s]) for s in occupied]))
        self._len[occupied] += 1
        self._stats_after_step(occupied)
        for s in occupied:
            self._sent_token(s)
        while len(inflight) > self._lag:
            self._read(inflight)

    def _stats_after_step(self, occupied):
        in_use = self.ecfg.num_pages - self._free_pages()
        self.stats["steps"] += 1
        self.stats["peak_pages"] = max(self.stats["peak_pages"], in_use)
        self.stats["page_steps"] += in_use
        self.stats["token_steps"] += int(self._len[occupied].sum())

    def _read(self, inflight):
        """Emit the tokens of the oldest call in flight (blocks until it has run)."""
        arr, entries = inflight.popleft()
        self.stats["overlapped_reads"] += bool(inflight)  # a newer call already queued
        out = np.asarray(arr).tolist()
        status = out[-1]
        if status != pa.OK:  # the host's page accounting should have prevented it
            raise pa.PagePoolExhausted(
                f"an engine call could not reserve pages (status {pa.STATUS_NAMES[status]}); "
                "raise EngineConfig.num_pages")
        stamp = time.perf_counter() - self._t0
        n, stopped = 0, self._stopped
        for s, req in entries:
            if id(req) in stopped:
                continue  # a token past this request's EOS
            token = out[s]
            req.output.append(token)
            req.token_times.append(stamp)
            n += 1
            if len(req.output) >= req.max_new_tokens or token == req.eos_id:
                stopped.add(id(req))
                if self._slots[s] is req:  # an EOS: the slot is freed only now
                    self._release(s)
        self.stats["tokens"] += n
        if self._on_token is not None:
            self._on_token(n)

    def _admit_waiting(self, queue, inflight) -> int:
        """Admit waiting requests into free slots while the pool has room; dispatch their
        prefills. Returns how many were admitted."""
        e = self.ecfg
        joining = []
        free = self._free_pages()
        for s in range(e.max_slots):
            if not queue:
                break
            if self._slots[s] is not None:
                continue
            req = queue[0]
            need = -(-(len(req.prompt) + len(req.output) + 1) // e.page_size)
            # Keep one page of headroom per running sequence, so a just-preempted
            # request is not re-admitted straight into the same shortage.
            if need + len(self._order) > free:
                break
            free -= need
            queue.popleft()
            self._slots[s] = req
            self._order.append(s)
            self._sent[s] = len(req.output)
            joining.append(s)
        if not joining:
            return 0
        seqs = {s: np.concatenate([self._slots[s].prompt,
                                   np.asarray(self._slots[s].output, np.int32)])
                for s in joining}
        # Fresh prompts fit the prompt width; a preempted request re-prefills its output too.
        narrow = [s for s in joining if len(seqs[s]) <= e.max_prompt_len]
        wide = [s for s in joining if len(seqs[s]) > e.max_prompt_len]
        rows = min(e.prefill_rows, e.max_slots)
        for group, width, cap in ((narrow, e.max_prompt_len, rows), (wide, e.max_len, 1)):
            for i in range(0, len(group), cap):
                self._dispatch_prefill(group[i: i + cap], seqs, width, inflight)
        return len(joining)

    def _dispatch_prefill(self, rows, seqs, width, inflight):
        e = self.ecfg
        R = min(1 << (len(rows) - 1).bit_length(), e.prefill_rows, e.max_slots)
        job = np.zeros((R, 2 + width), np.int32)
        job[:, 0] = e.max_slots  # padding rows
        for r, s in enumerate(rows):
            job[r, 0], job[r, 1] = s, len(seqs[s])
            job[r, 2: 2 + len(seqs[s])] = seqs[s]
        self.cache, self._next, self.key = _prefill(self.plan, self.cache,
                                                    self._next, self._frees(),
                                                    jax.device_put(job), self.key,
                                                    sp=self.sp)
        self._next.copy_to_host_async()
        inflight.append((self._next, [(s, self._slots[s]) for s in rows]))
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += R * width
        for s in rows:
            self._len[s] = len(seqs[s])
            self._sent_token(s)
        while len(inflight) > self._lag:
            self._read(inflight)

    def _preempt(self, queue):
        """The next step does not fit (nothing in flight): preempt the newest request."""
        if not self.ecfg.preempt or len(self._order) <= 1:
            raise pa.PagePoolExhausted(
                f"the page pool ({self.ecfg.num_pages} pages of {self.ecfg.page_size} tokens) "
                "cannot hold the running sequences; raise EngineConfig.num_pages, lower "
                "max_slots, or enable preempt.")
        victim = self._order[-1]
        req = self._slots[victim]
        self._release(victim)
        queue.appendleft(req)  # recomputed from prompt + output so far when re-admitted
        self.stats["preemptions"] += 1
