"""The decode front door: which path decodes a model, and everything that path needs.

    p = plan(cfg, params, batch, max_len, path="auto")   # outside jit: weights laid out once
    print(p.line)     # decode: fast path — the megakernel needs batch 1 (this is batch 8)
    cache = p.make_cache()
    logits_BV, cache = p.prefill(prompt_BT, prompt_len_B, cache)
    logits_BV, cache = p.step(tokens_B, cache)

Every decoder in gendist goes through a `DecodePlan`: `generate.generate_tokens` and
`generate_text`, the CLI's `generate`, the continuous-batching `Engine` (its paged cache,
`paged_cache`) and speculative decoding (`lm.transformer_lm(plan)` for target and draft).

The paths, fastest first; none changes the math beyond rounding (greedy tokens are tested
equal across them):

* "megakernel": every layer of a one-token step in one persistent kernel (`megakernel`,
  `pallas_kernels.chain`): a Hopper GPU, batch 1, a dense multi-head SwiGLU bf16 model
  (`megakernel.supported`); auto takes it up to `megakernel.LONGEST_CONTEXT` tokens (past
  them the fast path's attention is the faster). The kernel is an argument: `chain_mgpu` by default,
  `megakernel.chain_reference` (its math in XLA) to run the path on any device.
* "fast": weights in the decode layout (`decode_layout`), one cache buffer per layer written
  in place (`LayerKVCache`), the layers straight-line (`decode_block`); on a GPU attention
  through the paged kernel and the fused RoPE/attention and RMSNorm kernels. Dense models.
* "reference": the training model's own forward (`models.transformer`) over its stacked
  weights cast once, one stacked cache, attention in XLA. Any model.

"auto" takes the first that supports the model, batch and device (`choose`, a pure function
of them), and the plan says in one line which path runs and why a faster one does not.
A `DecodePlan` is a pytree: its weights are the leaves and everything else is static, so a
jitted function takes it as an argument.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp

from gendist.config import DECODE_HEADS, DECODE_PATHS, ModelConfig
from gendist.inference import decode_block, decode_layout, megakernel
from gendist.inference.cache import ContiguousKVCache, KVCache
from gendist.inference.layer_cache import LayerKVCache
from gendist.inference.paged_cache import PagedKVCache
from gendist.models import transformer
from gendist.models.params import DTYPES
from pallas_kernels.chain import chain_mgpu
from pallas_kernels.chain.resolve import MAX_STEPS


def hopper(device_kind: str) -> bool:
    """Whether a device kind names a Hopper GPU (sm90): H100, H200, H800, H20, GH200."""
    return re.search(r"\bG?H(100|200|800|20)\b", device_kind) is not None


def attention_backend(cfg: ModelConfig, platform: str, backend: str | None = None) -> str:
    """The fast path's attention: "pallas" (the paged kernel reads only valid tokens) on a
    GPU when the kernels take the head dim (a power of two >= 16), else "xla"; an explicit
    `backend` wins."""
    if backend is not None:
        return backend
    h = cfg.head_dim
    return "pallas" if platform == "gpu" and h >= 16 and h & (h - 1) == 0 else "xla"


def choose(cfg: ModelConfig, batch: int, platform: str, device_kind: str, *,
           paged: bool = False, step_tokens: int = 1, max_len: int | None = None) -> tuple[str, str]:
    """(path, its one-line reason) that "auto" takes for `cfg` at `batch` on a device of
    `platform` ("gpu", "cpu", ...) and `device_kind` ("NVIDIA H200"). `paged`: the caller
    needs a paged cache (continuous batching); `step_tokens`: tokens a call decodes (a
    speculative target verifies gamma + 1); `max_len`: the longest sequence the plan decodes
    (past `megakernel.LONGEST_CONTEXT` the fast path's attention is the faster; None: short)."""
    if platform != "gpu":
        return "reference", f"decode: reference — {platform} (the fast path and the megakernel need a GPU)"
    if cfg.moe_experts:
        return "reference", ("decode: reference — an MoE model (the fast path and the "
                             "megakernel are dense)")
    why = megakernel.supported(cfg, batch)
    if why is None and not hopper(device_kind):
        why = f"a Hopper GPU (sm90; this is {device_kind})"
    if why is None and paged:
        why = "a contiguous cache (continuous batching pages it)"
    if why is None and step_tokens != 1:
        why = f"one token a call (this plan decodes {step_tokens})"
    if why is None and max_len is not None and max_len > megakernel.LONGEST_CONTEXT:
        why = (f"a context of at most {megakernel.LONGEST_CONTEXT:,} tokens to be the faster (this plan "
               f"decodes up to {max_len:,}: past it its attention reads the cache slower than the fast path's)")
    if why is None:
        return "megakernel", f"decode: megakernel (batch {batch}, {device_kind})"
    return "fast", f"decode: fast path — the megakernel needs {why}"


def this_device() -> tuple[str, str]:
    """(platform, device kind) of the first device: what "auto" chooses for."""
    dev = jax.devices()[0]
    return dev.platform, dev.device_kind


def _refuse(path: str, why: str, fix: str) -> ValueError:
    return ValueError(f"generate.path={path!r}: {why}; {fix}.")


def resolve(cfg: ModelConfig, batch: int, path: str = "auto", *, platform: str,
            device_kind: str, kernel: Callable | None = None, paged: bool = False,
            step_tokens: int = 1, max_len: int | None = None) -> tuple[str, str]:
    """(path, line) for an explicit or "auto" `path`; an explicit path that cannot run is a
    ValueError naming generate.path and the fix. An explicit "megakernel" runs at any
    max_len (`choose`'s context rule is auto's)."""
    if path not in DECODE_PATHS:
        raise ValueError(f"generate.path={path!r}; choose one of {', '.join(DECODE_PATHS)}.")
    if path == "auto":
        return choose(cfg, batch, platform, device_kind, paged=paged, step_tokens=step_tokens,
                      max_len=max_len)
    if path == "megakernel":
        why = megakernel.supported(cfg, batch)
        if why:
            raise _refuse(path, f"the megakernel needs {why}",
                          "use generate.path='fast' or 'auto'")
        if paged:
            raise _refuse(path, "the megakernel reads a contiguous cache, not a paged one",
                          "use generate.path='fast' or 'auto'")
        if kernel is None and not (platform == "gpu" and hopper(device_kind)):
            raise _refuse(path, f"the megakernel's kernel needs a Hopper GPU (sm90; this is "
                          f"{device_kind})", "use generate.path='auto', or pass "
                          "kernel=megakernel.chain_reference (its math in XLA)")
        named = getattr(kernel, "func", kernel)  # a functools.partial names its function
        kind = device_kind if kernel is None else f"{device_kind}, kernel {named.__name__}"
        return path, f"decode: megakernel (batch {batch}, {kind}; generate.path='megakernel')"
    if path == "fast" and cfg.moe_experts:
        raise _refuse(path, "an MoE model has no decode layout (its expert blocks stay "
                      "stacked)", "use generate.path='reference' or 'auto'")
    name = "fast path" if path == "fast" else path
    return path, f"decode: {name} (generate.path={path!r})"


# XLA's options for a program that runs a megakernel plan: its prompt is a scan over the
# kernel's stacked matrices (`megakernel.prompt_params`), and with dynamic-slice fusion each
# layer's matmuls read their slices in place (cuBLAS at an offset), where XLA 0.11's Triton
# matmul fusions copy each slice out first (benchmarks/decode.md, "Before the loop").
STACKED_PROMPT_OPTIONS = (("xla_gpu_enable_dynamic_slice_fusion", True),
                          ("xla_gpu_enable_triton_gemm", False))


def compiler_options(*paths: str) -> dict | None:
    """XLA's options for a program that runs plans of these decode paths (`jax.jit`'s
    `compiler_options`): `STACKED_PROMPT_OPTIONS` where one is the megakernel's, else None."""
    return dict(STACKED_PROMPT_OPTIONS) if "megakernel" in paths else None


def jit_by_path(fun: Callable, static_argnames: tuple, paths: Callable) -> Callable:
    """`fun` jitted once for each set of XLA options its call needs: those of the decode
    paths that `paths(*args, **kwargs)` names (a megakernel plan's `STACKED_PROMPT_OPTIONS`,
    none for the others). The result calls, lowers (`.lower`) and traces (`.trace`) as
    `jax.jit`'s does; called inside another jit it takes none (XLA compiles the outer
    program, with that program's options). `.program(*args, **kwargs)`: the `jax.jit`
    program such a call runs; `.for_paths(*paths)`: the one of those paths' options, whatever
    the arguments (no paths: XLA's defaults)."""
    @functools.cache
    def jitted(options: tuple):  # one program per set of options (sorted items)
        return jax.jit(fun, static_argnames=static_argnames, compiler_options=dict(options) or None)

    def for_paths(*paths_):
        return jitted(tuple(sorted((compiler_options(*paths_) or {}).items())))

    def pick(*args, **kwargs):
        nested = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))
        return for_paths() if nested else for_paths(*paths(*args, **kwargs))

    @functools.wraps(fun)
    def call(*args, **kwargs):
        return pick(*args, **kwargs)(*args, **kwargs)

    call.lower = lambda *args, **kwargs: pick(*args, **kwargs).lower(*args, **kwargs)
    call.trace = lambda *args, **kwargs: pick(*args, **kwargs).trace(*args, **kwargs)
    call.program, call.for_paths = pick, for_paths
    return call


def layout(cfg: ModelConfig, params: dict, path: str, head: str = "xla") -> dict:
    """`params` as `path` reads them (idempotent): cast once; the decode layout for "fast";
    plus the stacked, norm-folded matrices of the kernel for "megakernel" (and its output
    layer's table when `head` is "fused")."""
    if path == "megakernel":
        return megakernel.chain_params(cfg, params, head == "fused")
    if path == "fast":
        return decode_layout.decode_params(cfg, params)
    if decode_layout.is_layout(params):
        raise ValueError("generate.path='reference' reads the model's stacked weights, but these "
                         "params are in the decode layout (decode_layout.decode_params); pass "
                         "the model's params, or use generate.path='fast'.")
    return decode_layout.inference_params(cfg, params)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """One model decoding `batch` sequences of up to `max_len` tokens on one path: its weights
    (`params`, already in the path's layout), its cache and its forward, prefill and step."""

    params: dict
    cfg: ModelConfig = dataclasses.field(metadata=dict(static=True))
    path: str = dataclasses.field(metadata=dict(static=True))
    line: str = dataclasses.field(metadata=dict(static=True))  # which path, and why
    batch: int = dataclasses.field(metadata=dict(static=True))
    max_len: int = dataclasses.field(metadata=dict(static=True))
    backend: str = dataclasses.field(default="xla", metadata=dict(static=True))  # attention
    kernel: Callable | None = dataclasses.field(default=None, metadata=dict(static=True))
    fused: bool = dataclasses.field(default=True, metadata=dict(static=True))
    tiling: str = dataclasses.field(default="", metadata=dict(static=True))
    stages: int = dataclasses.field(default=16, metadata=dict(static=True))  # the kernel's ring
    head: str = dataclasses.field(default="xla", metadata=dict(static=True))  # output layer
    kernel_state: bool = dataclasses.field(default=False, metadata=dict(static=True))  # kept words
    # the megakernel's attention blocks a query group (`plan`: `megakernel.att_splits_for`'s
    # at its max_len unless given; None: each cache's own capacity's)
    att_splits: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    # greedy steps a megakernel call (`megakernel.greedy_steps`; 1: a call a step)
    greedy_steps: int = dataclasses.field(default=1, metadata=dict(static=True))

    def make_cache(self, batch: int | None = None, max_len: int | None = None) -> KVCache:
        """An empty cache of this path for `batch` sequences of up to `max_len` tokens (the
        plan's by default): stacked (reference), one buffer per layer (fast: attention
        `backend`, the fused kernels when `fused`, their `tiling`) or the kernel's
        (megakernel)."""
        cfg, batch, max_len = self.cfg, batch or self.batch, max_len or self.max_len
        dt = DTYPES[cfg.dtype]
        if self.path == "megakernel":
            if batch != 1:
                raise ValueError(f"the megakernel's cache holds one sequence, not {batch}.")
            cache = megakernel.ChainCache.create(cfg, max_len, self.stages, self.att_splits,
                                                 prompt_kernels=self.backend == "pallas")
            return cache.with_state(cfg, self.kernel, self.head) if self.kernel_state else cache
        if self.path == "fast":
            return LayerKVCache.create(cfg.num_layers, batch, max_len, cfg.num_kv_heads,
                                       cfg.head_dim, dt, backend=self.backend, fused=self.fused,
                                       tiling=self.tiling)
        return ContiguousKVCache.create(cfg.num_layers, batch, max_len, cfg.num_kv_heads,
                                        cfg.head_dim, dt)

    def paged_cache(self, *, num_pages: int, page_size: int, active: bool = True,
                    share_pages: bool = True) -> PagedKVCache:
        """An empty paged cache of this path (continuous batching): one page pool per layer
        on the fast path, one stacked pool on the reference path."""
        cfg = self.cfg
        if self.path == "megakernel":
            raise ValueError("the megakernel reads a contiguous cache, not a paged one.")
        return PagedKVCache.create(cfg.num_layers, self.batch, self.max_len, cfg.num_kv_heads,
                                   cfg.head_dim, num_pages=num_pages, page_size=page_size,
                                   dtype=DTYPES[cfg.dtype], backend=self.backend, active=active,
                                   per_layer=self.path == "fast", share_pages=share_pages)

    def forward(self, tokens_BT, pos_BT, cache, order_only: bool = False):
        """fp32 logits [B, T, V] of tokens at positions pos_BT, and the cache with their keys
        and values written (its lengths are the caller's). order_only: only the logits'
        order a row matters (greedy): a path may return them times a positive factor."""
        if self.path == "reference":
            logits_BTV, cache = transformer.forward(self.cfg, self.params, tokens_BT, pos_BT, cache)
        elif self.path == "megakernel" and tokens_BT.shape[1] == 1:
            logits_BV, cache = megakernel.step(self.cfg, self.params, tokens_BT[:, 0],
                                               pos_BT[:, 0], cache, self.kernel,
                                               head=self.head, order_only=order_only)
            return logits_BV[:, None], cache
        else:  # fast, and the megakernel's prompts (a scan over the kernel's matrices)
            params = megakernel.prompt_params(self.cfg, self.params) if self.path == "megakernel" else self.params
            logits_BTV, cache = decode_block.forward(self.cfg, params, tokens_BT, pos_BT, cache,
                                                     head=self.head == "kernel")
        return logits_BTV.astype(jnp.float32), cache

    def prefill(self, prompt_BT, prompt_len_B, cache):
        """The right-padded prompts into the cache: (logits at each last token [B, V], the
        cache counting the prompt tokens)."""
        B, T = prompt_BT.shape
        pos_BT = jnp.arange(T, dtype=jnp.int32)[None, :] + cache.lengths[:, None]
        logits_BTV, cache = self.forward(prompt_BT, pos_BT, cache)
        last_BV = jnp.take_along_axis(logits_BTV, (prompt_len_B - 1)[:, None, None], axis=1)[:, 0]
        return last_BV, cache.rollback(cache.lengths + prompt_len_B)

    def step(self, tokens_B, cache, order_only: bool = False):
        """One token per sequence at its own position (its cached length): (logits [B, V],
        the cache one token longer); order_only as for `forward`."""
        if self.path == "megakernel" and self.kernel_state:  # the kernel moves the length on
            return megakernel.step(self.cfg, self.params, tokens_B, cache.lengths, cache, self.kernel,
                                   head=self.head, order_only=order_only, advance=True)
        logits_BTV, cache = self.forward(tokens_B[:, None], cache.lengths[:, None], cache, order_only)
        return logits_BTV[:, 0], cache.advance(jnp.ones_like(cache.lengths))

    def greedy_tokens(self, tokens_B, cache, steps: int | None = None):
        """The next `steps` (`greedy_steps` by default) greedy tokens after tokens_B, one
        megakernel call: (tokens [1, steps], the cache that many tokens longer). One step is
        the one-step kernel's (`step`) and its argmax."""
        steps = steps or self.greedy_steps
        if steps == 1:
            logits_BV, cache = self.step(tokens_B, cache, order_only=True)
            return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)[:, None], cache
        return megakernel.greedy_steps(self.cfg, self.params, tokens_B, cache, self.kernel, steps)

    def with_params(self, params: dict) -> DecodePlan:
        """This plan over other weights (laid out for the path here when they are not)."""
        return dataclasses.replace(self, params=layout(self.cfg, params, self.path, self.head))


def plan(cfg: ModelConfig, params: dict, batch: int, max_len: int, path: str = "auto",
         kernel: Callable | None = None, *, paged: bool = False, step_tokens: int = 1,
         backend: str | None = None, fused: bool = True, tiling: str = "", stages: int = 16,
         head: str = "auto", kernel_state: bool | None = None, att_splits: int | None = None,
         greedy_steps: int | None = None, device: tuple[str, str] | None = None) -> DecodePlan:
    """The decode plan of `cfg` for `batch` sequences of up to `max_len` tokens (module
    docstring). Call it outside jit: it lays the weights out for the path once.

    path: "auto" | "megakernel" | "fast" | "reference". kernel: the megakernel's
    (`pallas_kernels.chain.chain_mgpu` by default; `megakernel.chain_reference` runs the path
    in XLA). paged, step_tokens: what the caller needs (`choose`). backend ("xla" |
    "pallas"), fused, tiling: the fast path's attention (`LayerKVCache`); stages: the
    megakernel's ring. head: the final norm and the output layer as XLA's ops ("xla"), one
    Pallas kernel (`pallas_kernels.head`, "kernel") or, on the megakernel path, inside the
    megakernel ("fused": its table streams right behind the last layer's weights; a tied
    table is kept twice, once with the norm's gain folded in); "auto": "fused" where the
    megakernel runs and the vocabulary is large enough to pay (`megakernel.FUSED_HEAD_MIN_VOCAB`,
    `fused_head_supported`), else "xla". kernel_state: the megakernel's caches keep its
    state from step to step: its words, x_0's and the cache written by the kernel
    (`megakernel.ChainCache.with_state`: four kernels fewer a step); None: where the
    megakernel runs, `megakernel.KEEP_STATE`'s choice. att_splits: the megakernel's attention
    blocks a query group, each over a split of the cached positions (`chain_mgpu(att_splits=)`);
    None: the max_len's (`megakernel.att_splits_for`: from `SPLIT_CONTEXT` on, as many as the
    grid holds), fixed for every cache of the plan. greedy_steps: greedy decoding's
    steps a megakernel call (`megakernel.greedy_steps`: each token chosen inside the kernel;
    more than 1 takes the output layer inside the kernel and the kept state); None:
    `megakernel.GREEDY_STEPS` where the megakernel runs and head and kernel_state allow it
    (more than 1 then sets them), else 1.
    device: (platform, device_kind), the first device's by default.
    """
    if head not in DECODE_HEADS:
        raise ValueError(f"head={head!r}; choose 'auto', 'xla' (XLA's output layer), 'kernel' "
                         "(pallas_kernels.head) or 'fused' (inside the megakernel).")
    platform, kind = device or this_device()
    path, line = resolve(cfg, batch, path, platform=platform, device_kind=kind, kernel=kernel,
                         paged=paged, step_tokens=step_tokens, max_len=max_len)
    splits = 1  # the megakernel's: a greedy call's steps read their new k and v in the block that wrote them
    if path == "megakernel":
        splits = att_splits if att_splits is not None else megakernel.att_splits_for(megakernel.cache_rows(max_len), cfg)
    if greedy_steps is None:  # the measured default takes the output layer inside and the kept state
        greedy_steps = (megakernel.GREEDY_STEPS if path == "megakernel" and head in ("auto", "fused")
                        and kernel_state is not False and splits == 1
                        and not megakernel.fused_head_supported(cfg) else 1)
        if greedy_steps > 1:
            head, kernel_state = "fused", True
    if head == "auto":
        head = ("fused" if path == "megakernel" and cfg.vocab_size >= megakernel.FUSED_HEAD_MIN_VOCAB
                and not megakernel.fused_head_supported(cfg) else "xla")
    elif head == "fused" and (path != "megakernel" or megakernel.fused_head_supported(cfg)):
        why = megakernel.fused_head_supported(cfg) or f"the megakernel path (this is {path!r})"
        raise ValueError(f"head='fused' runs the output layer inside the megakernel and needs {why}; "
                         "use head='auto' or 'xla'.")
    if head == "fused":
        line += ", the output layer inside the kernel"
    if path == "megakernel" and kernel is None:
        kernel = chain_mgpu
    if kernel_state is None:
        kernel_state = path == "megakernel" and megakernel.KEEP_STATE
    elif kernel_state and path != "megakernel":
        raise ValueError(f"kernel_state=True keeps the megakernel's state between steps "
                         f"(generate.kernel_state); this plan's path is {path!r}: decode on the "
                         "megakernel path (a Hopper GPU, batch 1) or leave it False.")
    if kernel_state:
        line += ", its state kept between steps"
    if greedy_steps != 1 and not (path == "megakernel" and kernel_state and head == "fused"
                                    and 1 <= greedy_steps <= MAX_STEPS and splits == 1):
        raise ValueError(f"greedy_steps={greedy_steps}: greedy steps in one megakernel call (2 to {MAX_STEPS}) "
                         f"need the megakernel path with head='fused', kernel_state=True and one attention "
                         f"split (this plan: {path!r}, head {head!r}, kernel_state {kernel_state}, "
                         f"att_splits {splits}); pass those, or greedy_steps=1.")
    if greedy_steps > 1:
        line += f", {greedy_steps} greedy steps a call"
    if path == "megakernel" and splits > 1:
        line += f", each query group's positions split over {splits} attention blocks"
    return DecodePlan(layout(cfg, params, path, head), cfg, path, line, batch, max_len,
                      attention_backend(cfg, platform, backend), kernel, fused, tiling, stages,
                      head, kernel_state, splits if path == "megakernel" else att_splits, greedy_steps)
