"""Batch-1 decode steps through one persistent kernel: every layer's products, attention and
residual adds in `pallas_kernels.chain`.

A decode step at batch 1 reads every weight once, and on an H200 the step of XLA's fast path
is ~230 small kernels that each pay a ramp and a tail (`benchmarks/decode.md`). Here the
step is: the embedding row (XLA), the chain kernel over all layers (RMSNorms folded into the
weights, q|k|v, attention over the cache, o, gate|up, SwiGLU, down, the residual adds; from
32k tokens the output layer too), one in-place update writing every layer's new k and v at
the step's position, and the final norm, the output layer and sampling (XLA). With a kept
state (`ChainCache.with_state`) the kernel also reads the token's embedding row, writes the
new k and v and moves the cache's length on itself, and nothing zeroes its words between
steps.

The decode front door (`decoder.plan(..., path="megakernel")`) puts the pieces together:
`chain_params` once (it keeps the decode layout for the prompt and adds the stacked,
norm-folded matrices the kernel reads), a `ChainCache`, the prompt through the decode block
(on a GPU its norms and its attention through their Pallas kernels,
`pallas_kernels.prompt_attention`, each layer's new rows written once for all layers:
`ChainCache.layer_states`) and each step through `step` or `greedy_steps` with the kernel it
is given (`chain.chain_mgpu` on a Hopper GPU; `chain_reference`, its math in XLA, anywhere).
`supported` says what a model and batch need besides the GPU.
A rolled-back cache (speculative decoding) needs nothing more: the kernel and the prompt's
attention read only the rows up to the query's position, and the rows past it stay finite.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gendist.config import ModelConfig
from gendist.inference import decode_block, decode_layout
from gendist.inference.cache import KVCache
from gendist.models.layers import rope_angles
from pallas_kernels import prompt_attention
from pallas_kernels._mgpu import sm_count
from pallas_kernels.chain import xla as cx
from pallas_kernels.chain.resolve import attention_blocks, attention_group


def chain_reference(x0_D, w_qkv, w_o, w_gu, w_down, kv, pos, rope, *, norm_eps: float, stages: int = 16,
                    w_head=None, state=None, new_state: bool = False, embed=None, advance: bool = False,
                    att_splits: int = 1, steps: int = 1):
    """`chain_mgpu`'s result from its own inputs (norm gains folded) by `cx.reference`: the
    kernel's math in XLA, for any device (stages, the kernel's ring depth, and att_splits, its
    attention blocks a query group, change nothing but the rounding).
    With a state (which it keeps as given; new_state: two zero words) the cache comes back
    with the new k and v written, as the kernel's does; embed=(table, token): x_0 is the
    token's row (clamped); advance: pos + 1 last. steps > 1: that many greedy steps, each
    token the argmax of the step's logits before the final norm's factor, as the kernel's:
    (x_L of the last, kv, tokens [steps], state, pos + steps)."""
    if steps > 1:
        def one(carry, _):
            token, kv, pos = carry
            x_D, kv, z, _, pos = chain_reference(None, w_qkv, w_o, w_gu, w_down, kv, pos, rope, norm_eps=norm_eps,
                                                 w_head=w_head, state=state, embed=(embed[0], token), advance=True)
            nxt = jnp.argmax(z.sum(axis=0)).astype(jnp.int32)
            return (nxt[None], kv, pos), (nxt, x_D)
        (_, kv, pos), (tokens, xs) = jax.lax.scan(one, (embed[1], kv, pos), None, length=steps)
        return xs[-1], kv, tokens, state, pos
    if embed is not None:
        x0_D = jnp.take(embed[0], embed[1][0], axis=0, mode="clip").astype(jnp.float32)
    ones = jnp.ones((w_qkv.shape[0], x0_D.shape[0]), jnp.float32)
    out = cx.reference(x0_D, w_qkv, w_o, w_gu, w_down, kv, pos, rope, norms=(ones, ones), eps=norm_eps,
                       w_head=w_head)
    if state is None and not new_state:
        return out
    x_D, kv_new, *z = out
    kv = jax.lax.dynamic_update_slice(kv, kv_new[:, :, :, None, :], (0, 0, 0, pos[0], 0))
    return (x_D, kv, *z, jnp.zeros((2,), jnp.int32) if new_state else state) + ((pos + 1,) if advance else ())


def supported(cfg: ModelConfig, batch: int) -> str | None:
    """None if `cfg` at `batch` can decode through the chain kernel, else what the kernel
    needs that it lacks ("batch 1 (this is batch 4); num_heads * head_dim == d_model ...").
    Grouped-query attention is taken for any group size (num_kv_heads dividing num_heads);
    q|k|v's rows, attention's output and o's columns must all be d_model wide."""
    D, hd = cfg.d_model, cfg.head_dim
    needs = [
        (batch != 1, f"batch 1 (this is batch {batch})"),
        (cfg.moe_experts > 0, "a dense model (this is MoE)"),
        (cfg.mlp != "swiglu", f"mlp='swiglu' (this is {cfg.mlp!r})"),
        (cfg.num_heads % cfg.num_kv_heads, f"num_kv_heads dividing num_heads (this has "
                                           f"{cfg.num_kv_heads} for {cfg.num_heads})"),
        (cfg.num_heads * hd != D, f"num_heads * head_dim == d_model (this has {cfg.num_heads} x {hd} "
                                  f"for {D})"),
        (hd % 64, f"head_dim a multiple of 64 (is {hd})"),
        (D % 128, f"d_model a multiple of 128 (is {D})"),
        (cfg.d_ff % 64, f"d_ff a multiple of 64 (is {cfg.d_ff})"),
        (cfg.dtype != "bfloat16", f"dtype='bfloat16' (this is {cfg.dtype!r})"),
    ]
    return "; ".join(need for lacking, need in needs if lacking) or None


# The vocabulary from which `decoder.plan(head="auto")` runs the output layer inside the kernel:
# at Llama-3's 128,256 rows a step was 1.4% faster so (0.698 against 0.708 ms at
# Llama-3.2-1B's shape), at 256 rows no faster (benchmarks/decode.md).
FUSED_HEAD_MIN_VOCAB = 32_000


# The longest context (a plan's max_len) for which `decoder.plan(path="auto")` takes the
# megakernel. Its attention gives each query group one block unless the cache splits the
# positions over several (`att_splits_for`); unsplit, a step grows with the context 3-5x
# faster than the fast path's, whose attention kernel reads the cache with every SM. Measured
# on an H100 (benchmarks/decode.md, "Long contexts"), positions 1,984-2,047, fast path in the
# same process: split, the megakernel is the faster at both shapes timed (350m 0.655 against
# 0.852 ms, Llama-3.2-1B's shape 1.297 against 1.454); unsplit it was the slower. Past 2,048
# nothing is timed, so auto stops there.
LONGEST_CONTEXT = 2048

# From this cache capacity on, `att_splits_for` splits each query group's positions over
# several attention blocks (FlashDecoding's split-K). Measured on an H100 after a 960-token
# prompt (capacity 1,024; benchmarks/decode.md): 350m 0.454 ms split 8 ways against 0.560
# unsplit with 16 greedy steps a launch, Llama-3.2-1B's shape 1.029 (4 ways) against 1.083.
# At positions 32-287 two splits are no faster (0.324 against 0.322 ms), and a split cache
# takes a launch a step (greedy steps read their new k and v in the block that wrote them),
# ~5% slower there than 16 greedy steps a launch: below 1,024 the cache stays unsplit.
SPLIT_CONTEXT = 1024


def att_splits_for(capacity: int, cfg: ModelConfig | None = None, blocks: int | None = None) -> int:
    """The attention blocks a query group gets (`chain_mgpu(att_splits=...)`) in a cache of
    `capacity` positions for `cfg` on `blocks` blocks (the GPU's SMs): one below
    `SPLIT_CONTEXT` or without a cfg the kernel runs (`supported`), else the most of 8, 4, 2
    whose attention blocks the grid holds (350m: 16 query groups x 8; Llama-3.2-1B's shape:
    32 x 4).
    `ChainCache.create(att_splits=N)` asks for N instead."""
    if cfg is None or capacity < SPLIT_CONTEXT or supported(cfg, 1):
        return 1
    D, hd, NB = cfg.d_model, cfg.head_dim, blocks or sm_count()
    group = attention_group(D, D + 2 * cfg.num_kv_heads * hd, cfg.d_ff, NB, hd, cfg.num_kv_heads)
    return next((R for R in (8, 4, 2) if attention_blocks(D, hd, group, R) < NB), 1)


def cache_rows(max_len: int) -> int:
    """The positions a `ChainCache` of max_len tokens holds: max_len rounded up to 64."""
    return -(-max_len // 64) * 64


# Whether `decoder.plan(kernel_state=None)` keeps the kernel's state between steps where the
# megakernel runs: no. Compiled, a step is 4 XLA kernels shorter; timed on an H100 it is no
# faster at d 2048 and, with the weight-tile cap, 1.0-1.6% faster at 350m (four processes,
# benchmarks/decode.md): off until an H200 confirms the gain, since at d 1024 it would also
# change speculative decoding's draft, timed without it (docs/decisions.md).
KEEP_STATE = False

# The greedy steps one megakernel launch runs where `decoder.plan(greedy_steps=None)` chooses
# (`chain_mgpu(steps=N)`: the token chosen inside the kernel, no kernel between steps; with
# the output layer inside and the kept state). Timed on an H100 (benchmarks/decode.md,
# "Greedy steps inside the megakernel"): at 350m 16 steps per launch 0.307 ms a step against
# 0.316 with one step per launch (the head inside, the state kept) and 0.320 for the one-step
# default, 64 no faster than 16; at Llama-3.2-1B's shape 8 per launch at par (0.874 against 0.876).
GREEDY_STEPS = 16


def fused_head_supported(cfg: ModelConfig) -> str | None:
    """None when the output layer can run inside the kernel (`step(head="fused")`), else
    what the model lacks."""
    return None if cfg.vocab_size % 64 == 0 else f"a vocabulary a multiple of 64 (is {cfg.vocab_size})"


def chain_params(cfg: ModelConfig, params: dict, head: bool = False) -> dict:
    """The weights of the megakernel path: the decode layout's embedding, final norm and
    output layer (`decode_layout.decode_params`) and "chain": the matrices the kernel reads,
    stacked over layers, RMSNorm gains folded into q|k|v's and gate|up's columns: (w_qkv
    [L, D + 2 K hd, D] (rows q | k | v, K kv heads), w_o [L, D, D], w_gu [L, 2F, D], w_down
    [L, D, F]). The layers' weights are held once: a prompt reads the same matrices, as a
    scan over the layers (`prompt_params`). head: also "chain_head", the output layer's
    table with the final norm's gain folded in (`cx.fold_head`; a second copy of a tied
    table: V x D bf16 more memory), for the output layer inside the kernel."""
    if "chain" in params:
        if head and "chain_head" not in params:
            why = fused_head_supported(cfg)
            if why:
                raise ValueError(f"chain_params: the output layer inside the megakernel needs {why}; "
                                 "use head='xla'.")
            table_VD = params["embed"] if cfg.tie_embeddings else params["head_VD"]
            return {**params, "chain_head": cx.fold_head(table_VD, params["final_norm"])}
        return params
    why = supported(cfg, 1)
    if why:
        raise ValueError(f"chain_params: the megakernel needs {why}.")
    dp = decode_layout.decode_params(cfg, params)
    blocks = dp["blocks"]
    D = cfg.d_model
    stack = lambda key, shape: jnp.stack([b[key].reshape(shape) for b in blocks])  # noqa: E731
    N1 = D + 2 * cfg.num_kv_heads * cfg.head_dim
    w_qkv, w_gu = cx.fold_norms(stack("wqkv_CHD", (N1, D)), stack("w_gate_up_GD", (2 * cfg.d_ff, D)),
                                jnp.stack([b["attn_norm"] for b in blocks]),
                                jnp.stack([b["mlp_norm"] for b in blocks]))
    out = {k: v for k, v in dp.items() if k != "blocks"}
    out["chain"] = (w_qkv, stack("wo_DNH", (D, D)), w_gu, stack("w_down_DF", (D, cfg.d_ff)))
    return chain_params(cfg, out, head) if head else out


def prompt_params(cfg: ModelConfig, params: dict) -> dict:
    """`chain_params`' weights as the decode block's scan over layers reads them for a
    prompt (`decode_block.scan_layers`): "blocks" the decode layout's keys over the kernel's
    stacked matrices (reshapes: no copy), the RMSNorms' gains ones since the matrices hold
    them (the kernel's own products, so that a prompt's rows are those a step would write)."""
    w_qkv, w_o, w_gu, w_down = params["chain"]
    L, D = w_o.shape[:2]
    ones = jnp.ones((L, D), jnp.float32)
    blocks = {"wqkv_CHD": w_qkv.reshape(L, -1, cfg.head_dim, D), "wo_DC": w_o,
              "w_gate_up_GD": w_gu, "w_down_DF": w_down, "attn_norm": ones, "mlp_norm": ones}
    return {**{k: v for k, v in params.items() if k not in ("chain", "chain_head")}, "blocks": blocks}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChainCache(KVCache):
    """One sequence's keys and values as the chain kernel reads them: kv [L, 2, K, S, hd]
    (K kv heads; zeroed: rows at and past the length must be finite), S a multiple of 64;
    rope [S, hd]: every position's angles (`rope_table`), of which the kernel reads its
    step's row; state: None, or the kernel's words kept from step to step (`with_state`)."""

    kv: jax.Array
    lengths: jax.Array  # [1] int32
    rope: jax.Array  # [S, hd] fp32
    stages: int = dataclasses.field(default=16, metadata=dict(static=True))  # the kernel's ring slots
    state: jax.Array | None = None  # the kernel's words between steps (`chain_mgpu(state=...)`)
    # the kernel's attention blocks a query group, each over a split of the positions
    att_splits: int = dataclasses.field(default=1, metadata=dict(static=True))
    # the prompt's RMSNorms and attention through their Pallas kernels (a GPU's; `decode_kernels`)
    prompt_kernels: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def create(cls, cfg: ModelConfig, max_len: int, stages: int = 16, att_splits: int | None = None,
               prompt_kernels: bool = False):
        """A zeroed cache of max_len positions (rounded up to 64); att_splits None: the
        capacity's (`att_splits_for`); prompt_kernels: a prompt's norms and attention through
        their Pallas kernels (`decode_kernels`; a GPU's)."""
        S = cache_rows(max_len)
        shape = (cfg.num_layers, 2, cfg.num_kv_heads, S, cfg.head_dim)
        R = att_splits_for(S, cfg) if att_splits is None else att_splits
        return cls(jnp.zeros(shape, jnp.bfloat16), jnp.zeros((1,), jnp.int32), rope_table(cfg, S),
                   stages, att_splits=R, prompt_kernels=prompt_kernels)

    def kernel_options(self) -> dict:
        """What the kernel takes from this cache besides its arrays: the ring's slots and,
        where more than one, the attention's splits."""
        return dict(stages=self.stages, **(dict(att_splits=self.att_splits) if self.att_splits > 1 else {}))

    def with_state(self, cfg: ModelConfig, kernel, head: str = "xla") -> ChainCache:
        """This cache with a fresh state for `kernel` (zeros of the size it takes for `cfg`'s
        weights, as `chain_params` lays them out, this cache and the output layer `head`,
        `step`'s): its steps then keep the kernel's words from one to the next, and the kernel
        reads the token's embedding row and writes the new k and v in place, so that no
        kernel of a step zeroes the words, builds x_0's or writes the cache."""
        L, D, F, V = cfg.num_layers, cfg.d_model, cfg.d_ff, cfg.vocab_size
        bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
        chain = (bf16(L, D + 2 * cfg.num_kv_heads * cfg.head_dim, D), bf16(L, D, D), bf16(L, 2 * F, D),
                 bf16(L, D, F))
        one = jax.ShapeDtypeStruct((1,), jnp.int32)
        extra = dict(w_head=bf16(V, D)) if head == "fused" else {}
        out = jax.eval_shape(lambda token, table, *a, **kw: kernel(
            None, *a, norm_eps=cfg.norm_eps, **self.kernel_options(), new_state=True, embed=(table, token), **kw),
            one, bf16(V, D), *chain, self.kv, one, self.rope, **extra)
        return dataclasses.replace(self, state=jnp.zeros(out[-1].shape, jnp.int32))

    def layer_state(self):
        return self.kv

    def with_layer_state(self, state):
        return dataclasses.replace(self, kv=state)

    # A prompt (the decode block's scan over the layers, `decode_block.scan_layers`) reads
    # the cache in its own layout and writes it once for every layer: layer l's state is (l,
    # the whole cache), each layer hands back its new rows [2, K, T, hd], and
    # `with_scanned_states` writes them all in one update (no layer's slice copied, moved
    # into another layout or written back on its own).
    def scan_state(self, layer):
        return layer, self.kv

    def with_scanned_states(self, rows_L2KTH, pos_BT) -> ChainCache:
        return dataclasses.replace(self, kv=self.kv.at[:, :, :, pos_BT[0]].set(rows_L2KTH, mode="drop"))

    def decode_kernels(self, batch: int, tokens: int) -> tuple[bool, bool]:
        """With `prompt_kernels`: RMSNorm as one kernel for up to 64 rows, and RoPE +
        attention as one (`pallas_kernels.prompt_attention`) where it takes the head dim."""
        if not self.prompt_kernels:
            return False, False
        return batch * tokens <= 64, batch == 1 and prompt_attention.supports(self.kv.shape[-1])

    def attend_qkv(self, layer_state, qkv_BTCH, num_heads: int, q_pos_BT, cos_BTh, sin_BTh, sm_scale):
        """The prompt's RoPE and attention in one kernel from q|k|v unsplit, its rotated rows
        [2, K, T, hd] handed back; its positions are contiguous from q_pos_BT[0, 0] (a
        prompt's, a speculative verification's)."""
        layer, kv = layer_state
        o_TNH, rows_2KTH = prompt_attention.prompt_attention(
            qkv_BTCH[0], kv, q_pos_BT[0, :1], cos_BTh[0], sin_BTh[0], layer=layer, num_heads=num_heads,
            sm_scale=sm_scale)
        return o_TNH[None], rows_2KTH

    def attend(self, layer_state, q_BTNH, k_BTKH, v_BTKH, q_pos_BT, sm_scale):
        """The prompt's attention (XLA) over this layer's [2, K, S, hd] slice with its new rows
        written at q_pos_BT, and those rows [2, K, T, hd]."""
        layer, kv = layer_state
        rows_2KTH = jnp.stack([k_BTKH[0], v_BTKH[0]]).transpose(0, 2, 1, 3).astype(kv.dtype)
        kv_2KSH = kv[layer].at[:, :, q_pos_BT[0]].set(rows_2KTH, mode="drop")
        return cache_attention(q_BTNH, kv_2KSH, q_pos_BT, sm_scale), rows_2KTH


def cache_attention(q_BTNH, kv_2KSH, q_pos_BT, sm_scale):
    """Attention of one sequence's queries (at positions q_pos) over a cache slice
    [2, K, S, hd] already written: `models.attention.xla_attention`'s math in the cache's own
    layout (fp32 softmax; a position is seen by the queries at it and after)."""
    _, T, N, H = q_BTNH.shape
    _, K, S, _ = kv_2KSH.shape
    q_KGTH = q_BTNH[0].reshape(T, K, N // K, H).transpose(1, 2, 0, 3)
    s_KGTS = jnp.einsum("KGTH,KSH->KGTS", q_KGTH, kv_2KSH[0].astype(q_BTNH.dtype),
                        preferred_element_type=jnp.float32) * sm_scale
    s_KGTS = jnp.where(jnp.arange(S)[None, :] <= q_pos_BT[0][:, None], s_KGTS, -jnp.inf)
    m = jnp.max(s_KGTS, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s_KGTS - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l == 0, 1.0, l)
    o_KGTH = jnp.einsum("KGTS,KSH->KGTH", p.astype(kv_2KSH.dtype), kv_2KSH[1].astype(q_BTNH.dtype),
                        preferred_element_type=jnp.float32)  # batch-major (XLA:CPU 0.11's bf16 dot)
    return o_KGTH.transpose(2, 0, 1, 3).reshape(1, T, N, H).astype(q_BTNH.dtype)


def greedy_steps(cfg: ModelConfig, params: dict, tokens_B, cache: ChainCache, kernel, steps: int):
    """`steps` greedy tokens after tokens_B [1] (the token at the cache's length) in one
    kernel call (`chain_mgpu(steps=...)`: each step's argmax chosen inside the kernel, which
    reads the next token's row itself): (tokens [1, steps], the cache `steps` longer). Needs
    the output layer inside the kernel (`chain_params(head=True)`) and a cache with the
    kernel's state (`ChainCache.with_state`)."""
    if cache.state is None or "chain_head" not in params:
        raise ValueError("megakernel.greedy_steps: the kernel chooses the tokens itself and needs its "
                         "state kept (ChainCache.with_state) and the output layer inside it "
                         "(chain_params(head=True)): decoder.plan(greedy_steps=N) sets both.")
    _, kv, tokens, state, lengths = kernel(None, *params["chain"], cache.kv, cache.lengths, cache.rope,
                                           norm_eps=cfg.norm_eps, **cache.kernel_options(),
                                           w_head=params["chain_head"], state=cache.state,
                                           embed=(params["embed"], tokens_B), advance=True, steps=steps)
    return tokens[None], dataclasses.replace(cache, kv=kv, state=state, lengths=lengths)


def rope_table(cfg: ModelConfig, rows: int):
    """cos | sin of positions 0 .. rows - 1's rotary angles, [rows, head_dim] fp32: made once
    a cache, so that a step computes none (the kernel copies its position's row)."""
    cos, sin = rope_angles(jnp.arange(rows, dtype=jnp.int32)[None], cfg.head_dim, cfg.rope_theta,
                           cfg.rope_llama3)
    return jnp.concatenate([cos[0], sin[0]], axis=-1)


def step(cfg: ModelConfig, params: dict, tokens_B, pos_B, cache: ChainCache, kernel,
         head: str = "xla", order_only: bool = False, advance: bool = False):
    """One token at position pos_B through `kernel` (`chain.chain_mgpu` or `chain_reference`):
    (fp32 logits [1, V], the cache with every layer's new k and v written at pos_B; its
    lengths are the caller's, as for a forward). `head`: the final norm and the output layer
    as XLA's ops ("xla"), one kernel after this one ("kernel", `decode_block.head_logits`) or
    inside it ("fused": the kernel reads `chain_params(head=True)`'s table right behind the
    last layer and returns the logits' pieces before the norm's factor, applied here).
    order_only: the caller needs only the logits' order (greedy decoding's argmax), so the
    fused output layer's positive factor is left out (a kernel less a step). With the
    cache's state (`ChainCache.with_state`) the kernel keeps its words, reads the token's
    embedding row and writes the new k and v itself, and with advance (pos_B the cache's
    length) it also moves the length on by one: the cache comes back one token longer."""
    extra = dict(w_head=params["chain_head"]) if head == "fused" else {}
    if cache.state is not None:  # the kernel reads the token's row itself
        x0, extra = None, dict(extra, state=cache.state, embed=(params["embed"], tokens_B))
        if advance:
            extra["advance"] = True
    elif advance:
        raise ValueError("megakernel.step: advance=True needs a cache with the kernel's state "
                         "(ChainCache.with_state); advance the cache outside.")
    else:
        x0 = decode_block.embed(params, tokens_B[:, None], cfg)[0, 0].astype(jnp.float32)
    x_D, kv, *out = kernel(x0, *params["chain"], cache.kv, pos_B, cache.rope, norm_eps=cfg.norm_eps,
                           **cache.kernel_options(), **extra)
    if cache.state is not None:  # the kernel wrote the cache (and with advance its length)
        *out, state, lengths = out if advance else (*out, cache.lengths)
        cache = dataclasses.replace(cache, kv=kv, state=state, lengths=lengths)
    else:
        cache = dataclasses.replace(cache, kv=jax.lax.dynamic_update_slice(
            cache.kv, kv[:, :, :, None, :], (0, 0, 0, pos_B[0], 0)))
    if head == "fused":
        logits = out[0].sum(axis=0)[None]
        if not order_only:  # the norm's factor of x_L as the model rounds it (bf16)
            x = x_D.astype(cache.kv.dtype).astype(jnp.float32)
            logits = logits * jax.lax.rsqrt(jnp.mean(x * x) + cfg.norm_eps)
    else:
        logits = decode_block.head_logits(params, x_D.astype(cache.kv.dtype)[None, None], cfg,
                                          kernel=head == "kernel")[:, 0]
    return logits.astype(jnp.float32), cache
