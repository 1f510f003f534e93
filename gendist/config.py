"""Typed, frozen configs (the named presets and dotted overrides are `gendist.presets`).

Every field is overridable from the command line (`python -m gendist train --help`), where
the comment after each field becomes its help text.
"""

from __future__ import annotations

import contextlib
import math
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Literal, get_args

# How a model decodes (`gendist.inference.decoder`): "auto" picks the fastest that runs.
DecodePath = Literal["auto", "megakernel", "fast", "reference"]
DECODE_PATHS: tuple[str, ...] = get_args(DecodePath)
DecodeHead = Literal["auto", "xla", "kernel", "fused"]
DECODE_HEADS: tuple[str, ...] = get_args(DecodeHead)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer (RoPE, RMSNorm, grouped-query attention, SwiGLU)."""

    vocab_size: int = 256  # byte-level tokenizer: 256 symbols
    d_model: int = 128  # residual stream width D
    num_layers: int = 4  # transformer blocks L, stacked on a leading `layers` axis
    num_heads: int = 4  # query heads N
    num_kv_heads: int = 4  # key/value heads K (grouped-query when K < N)
    head_dim: int = 32  # per-head width H
    d_ff: int = 384  # MLP hidden width F
    max_seq_len: int = 256  # longest sequence the model accepts (RoPE table, KV cache)
    mlp: Literal["swiglu", "gelu"] = "swiglu"  # MLP kind
    tie_embeddings: bool = True  # output layer reuses the token embedding
    rope_theta: float = 10_000.0  # RoPE base frequency
    rope_scaling: Literal["none", "llama3"] = "none"  # RoPE frequency scaling (Llama 3.1+: llama3)
    rope_scaling_factor: float = 8.0  # llama3: low frequencies are divided by this
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original_len/this are scaled
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original_len/this are kept
    rope_original_max_len: int = 8192  # llama3: context length of pre-training before scaling
    norm_eps: float = 1e-6  # RMSNorm epsilon
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype (params stay fp32)
    attention: Literal["xla", "cudnn", "pallas"] = "xla"  # attention backend
    remat: Literal["none", "full", "save_matmuls"] = "none"  # activation recomputation per block
    scan_unroll: int = 1  # layers per iteration of the layer scan (num_layers: straight-line)
    fused_projections: bool = False  # one matmul for q|k|v and one for gate|up (tensor=1)
    init_std: float = 0.02  # std of the normal init of weight matrices
    moe_experts: int = 0  # experts per MoE block (0 = dense model)
    moe_every: int = 2  # every N-th block's MLP is an MoE layer
    moe_top_k: int = 2  # experts per token: 1 = Switch, 2 = GShard
    moe_capacity_factor: float = 1.25  # expert buffer slots = ceil(tokens*k/E * this)
    moe_d_ff: int = 0  # hidden width of each expert (0 = d_ff)
    moe_load_balance_weight: float = 0.01  # Switch load-balancing loss coefficient
    moe_z_loss_weight: float = 1e-3  # router z-loss coefficient

    def __post_init__(self):
        _check_unless_deferred(self)

    def check(self) -> None:
        """Raise ValueError naming the field and the fix for values the model cannot take."""
        check_ranges(self)
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"model.mlp={self.mlp!r}; choose 'swiglu' or 'gelu'.")
        if self.moe_experts:
            _check_moe(self)
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError(
                f"model.rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                f"model.rope_low_freq_factor={self.rope_low_freq_factor} (llama3 RoPE scaling "
                "blends between the two); Llama 3.1 uses 4 and 1.")
        if self.num_params > MAX_PARAMS:
            raise ValueError(
                f"the model has {self.num_params:.3g} parameters (model.d_model={self.d_model}, "
                f"model.num_layers={self.num_layers}, model.d_ff={self.d_ff}, "
                f"model.vocab_size={self.vocab_size}), more than {MAX_PARAMS:.0e} that no "
                "machine holds; lower the --model.* sizes (the presets: --preset 8b).")
        if self.moe_experts and self.num_layers % self.moe_every:
            raise ValueError(
                f"model.num_layers={self.num_layers} is not a multiple of model.moe_every="
                f"{self.moe_every}: MoE blocks come in groups of moe_every layers (the last "
                "of each is MoE); choose num_layers divisible by moe_every.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads="
                f"{self.num_kv_heads}: grouped-query attention shares each kv head among "
                "num_heads/num_kv_heads query heads; pick num_kv_heads dividing num_heads.")

    @property
    def moe_expert_d_ff(self) -> int:
        """Hidden width F of each expert (model.moe_d_ff, or d_ff when that is 0)."""
        return self.moe_d_ff or self.d_ff

    def moe_capacity(self, group_tokens: int) -> int:
        """Buffer slots per expert for a routing group of `group_tokens` tokens (GShard)."""
        return math.ceil(group_tokens * self.moe_top_k * self.moe_capacity_factor
                         / self.moe_experts)

    @property
    def rope_llama3(self) -> tuple[float, float, float, int] | None:
        """(factor, low_freq_factor, high_freq_factor, original_max_len), or None."""
        if self.rope_scaling == "none":
            return None
        return (self.rope_scaling_factor, self.rope_low_freq_factor,
                self.rope_high_freq_factor, self.rope_original_max_len)

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers // self.moe_every if self.moe_experts else 0

    def _mlp_params(self, width: int) -> int:
        return self.d_model * width * (3 if self.mlp == "swiglu" else 2)

    def _params(self, experts_per_moe_layer: int) -> int:
        """Parameters with each MoE layer holding this many experts (and its router)."""
        d, v = self.d_model, self.vocab_size
        attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + self._mlp_params(self.d_ff) + 2 * d
        head = 0 if self.tie_embeddings else d * v
        moe = 0
        if self.moe_experts:  # those layers swap the dense MLP for experts + router
            expert = self._mlp_params(self.moe_d_ff or self.d_ff)
            moe = self.num_moe_layers * (experts_per_moe_layer * expert
                                         - self._mlp_params(self.d_ff) + d * self.moe_experts)
        return v * d + self.num_layers * per_layer + d + head + moe

    @property
    def num_params(self) -> int:
        """Parameters stored (every expert of an MoE model; embedding counted once when tied)."""
        return self._params(self.moe_experts)

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses: top-k experts per MoE layer (= num_params when dense)."""
        return self._params(self.moe_top_k)

    @property
    def num_nonembedding_params(self) -> int:
        return self.num_params - self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)

    @property
    def num_matmul_params_per_token(self) -> int:
        """Weights in a token's matmuls: active parameters less the embedding lookup, plus the
        output layer (V·D, tied or not)."""
        embed = self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
        return self.num_active_params - embed + self.vocab_size * self.d_model

    def params_text(self) -> str:
        """'0.89M params', or '2.95M params (1.18M active per token)' for MoE."""
        text = f"{self.num_params / 1e6:.2f}M params"
        if self.moe_experts:
            text += f" ({self.num_active_params / 1e6:.2f}M active per token)"
        return text

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per matmul parameter plus causal attention.

        Matmul parameters (`num_matmul_params_per_token`) exclude the embedding lookup and the
        experts a token is not routed to, and include the output layer (V·D, tied or not).
        Attention scores and values cost 2·2·T·N·H FLOPs per token and layer in the forward
        pass, halved by the causal mask, ×3 for forward + backward (the PaLM paper's MFU
        accounting, appendix B).
        """
        matmul_params = self.num_matmul_params_per_token
        attn = 3 * self.num_layers * 4 * seq_len * self.num_heads * self.head_dim * 0.5
        return 6.0 * matmul_params + attn


@dataclass(frozen=True)
class MeshConfig:
    """Sizes of the four mesh axes; one size may be -1 to take the remaining devices."""

    data: int = -1  # data parallelism (batch sharded; ZeRO shards optimizer state here)
    pipeline: int = 1  # pipeline stages (contiguous slices of the layer stack)
    expert: int = 1  # expert parallelism (also data parallel for non-MoE layers)
    tensor: int = 1  # Megatron tensor parallelism (heads, MLP width, vocabulary)
    sequence_parallel: bool = False  # Megatron-3: norms/residuals split over seq on `tensor`

    def __post_init__(self):
        _check_unless_deferred(self)

    def check(self) -> None:
        """Raise ValueError naming the axis and the fix for sizes no mesh can take."""
        check_ranges(self)
        free = [a for a, s in self.sizes().items() if s == -1]
        if len(free) > 1:
            raise ValueError(f"mesh sizes {self.sizes()}: only one axis may be -1, got "
                             f"{free}; give explicit sizes to all but one "
                             f"(e.g. --mesh.{free[1]} 1).")

    def sizes(self) -> dict[str, int]:
        """The four axis sizes (one may be -1)."""
        return {"data": self.data, "pipeline": self.pipeline, "expert": self.expert,
                "tensor": self.tensor}


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it is cut into windows."""

    corpus: tuple[str, ...] = ()  # text files, dirs, globs, .jsonl, .parquet/.arrow; empty = bundled Shakespeare
    text_field: str = "text"  # the field holding the text in .jsonl/.parquet/.arrow records
    tokenizer: str = "bytes"  # bytes, a tokenizer.json, a SentencePiece .model, or a dir with one
    tokens: str = ""  # a directory of token files from `prepare` (instead of corpus/tokenizer)
    preferences: str = ""  # train.objective=dpo: a JSONL file of {"prompt", "chosen", "rejected"} records
    val_fraction: float = 0.05  # last fraction of the corpus held out for validation
    seed: int = 0  # batches are a pure function of (seed, step)

    def __post_init__(self):
        _check_unless_deferred(self)

    def check(self) -> None:
        """Raise ValueError naming the field and the fix for values the data cannot take."""
        check_ranges(self)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, schedule, logging and checkpointing."""

    batch_size: int = 32  # global sequences per optimizer step
    seq_len: int = 128  # tokens per sequence
    steps: int = 250  # optimizer steps
    grad_accum: int = 1  # microbatches accumulated per step (batch_size % grad_accum == 0)
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # final lr as a fraction of the peak (cosine decay)
    warmup_steps: int = 20  # linear warm-up steps
    weight_decay: float = 0.1  # AdamW decay (not applied to norms and biases)
    b1: float = 0.9  # Adam beta1
    b2: float = 0.95  # Adam beta2
    grad_clip: float = 1.0  # global-norm gradient clipping
    seed: int = 0  # parameter init seed
    eval_every: int = 50  # steps between validation losses
    eval_batches: int = 8  # batches per validation loss
    log_every: int = 10  # steps between console/JSONL/TensorBoard metrics
    checkpoint_every: int = 100  # steps between checkpoints (0 = only at the end)
    checkpoint_every_minutes: float = 0.0  # also checkpoint every this many minutes (0 = off; process 0's clock decides for all)
    keep_checkpoints: int = 2  # checkpoints kept on disk
    out_dir: str = "runs/default"  # metrics, TensorBoard and checkpoints go here
    resume: bool = True  # resume from the latest checkpoint in out_dir/checkpoints
    nonfinite: Literal["stop", "skip"] = "stop"  # on a NaN/inf loss: stop the run or skip the step
    pipeline_schedule: Literal["gpipe", "1f1b", "1f1b-phased", "1f1b-split", "zb-h1",
                               "interleaved-1f1b", "pipedream", "pipedream-nostash", "2bw"] = (
        "1f1b-phased")  # schedule when mesh.pipeline > 1 (1f1b-phased: all stages F or all B per step; *-split, zb-h1: B and W steps; interleaved-1f1b: pipeline_chunks per stage; pipedream*/2bw: async)
    pipeline_chunks: int = 1  # interleaved-1f1b: chunks of layers per stage, v >= 2 (device d holds chunks d, d+p, ...)
    pipeline_microbatches: int = 0  # microbatches per step in the pipeline (0 = 2 x stages)
    pipedream_window: int = 0  # 2bw: microbatches per update window (0 = mesh.pipeline - 1, min 1)
    terapipe_slices: int = 0  # TeraPipe: token slices per sequence through the pipeline (0 = off)
    pipeline_stage_layers: tuple[int, ...] = ()  # layers (MoE: groups) per stage; () = even split
    debug_nan_step: int = -1  # testing: make this step's loss NaN to exercise `nonfinite`
    zero_stage: Literal[0, 1, 2, 3] = 0  # ZeRO stage over `data` (0 = replicated state)
    matmul_precision: Literal["bf16", "fp8"] = "bf16"  # the blocks' projections in the model dtype, or as FP8 products (E4M3 forward, E5M2 gradients, per-tensor scales; Hopper/Ada GPUs, emulated on CPU)
    fp8_recipe: Literal["delayed", "current"] = "delayed"  # FP8 scales from the amax history of earlier steps (Transformer Engine's delayed scaling) or from each tensor's own amax
    fp8_history: int = 16  # FP8 delayed scaling: steps of amax history per tensor
    fp8_margin: int = 0  # FP8 scales leave 2**margin of headroom above the amax
    fp8_transpose: Literal["auto", "xla", "pallas"] = "auto"  # the FP8 GEMMs' float8 operand transposes: the tiled Pallas kernel (auto: on one GPU) or XLA's
    lora_rank: int = 0  # LoRA: rank r of the adapters on frozen base weights (0 = train every parameter)
    lora_alpha: float = 16.0  # LoRA: the adapters' product is scaled by lora_alpha / lora_rank
    lora_targets: str = "q,v"  # LoRA: comma list of the projections adapted, from q,k,v,o,gate,up,down
    lora_base_dtype: Literal["float32", "bfloat16"] = "float32"  # LoRA: dtype the frozen base weights are stored in
    objective: Literal["lm", "dpo"] = "lm"  # next-token cross-entropy, or DPO on data.preferences against the initial model
    dpo_beta: float = 0.1  # DPO: beta, the strength of the KL penalty to the reference model
    tp_comm: Literal["xla", "collective"] = "xla"  # sequence-parallel comm: XLA's, or collective matmuls (ppermute rings under the matmuls)
    tensorboard: bool = True  # write TensorBoard event files
    wandb: Literal["off", "online", "offline"] = "off"  # Weights & Biases logging (extra [wandb])
    wandb_project: str = "gendist"  # W&B project name
    progress: bool = True  # show a progress bar (on a terminal; step lines in a log file)

    def __post_init__(self):
        _check_unless_deferred(self)

    def check(self) -> None:
        """Raise ValueError naming the field and the fix for values training cannot take."""
        check_ranges(self)
        interleaved = self.pipeline_schedule == "interleaved-1f1b"
        if interleaved != (self.pipeline_chunks > 1):
            raise ValueError(
                f"train.pipeline_chunks={self.pipeline_chunks} with train.pipeline_schedule="
                f"{self.pipeline_schedule}: chunks of layers per stage (>= 2) go with "
                "'interleaved-1f1b' only; pass both --train.pipeline-schedule interleaved-1f1b "
                "--train.pipeline-chunks 2, or neither")
        if self.lora_rank:
            bad = [t for t in self.lora_targets.split(",") if t not in LORA_TARGETS]
            if bad or not self.lora_targets:
                raise ValueError(
                    f"train.lora_targets={self.lora_targets!r}: {bad or 'empty'} not "
                    f"projections; pass --train.lora-targets with a comma list from "
                    f"{','.join(LORA_TARGETS)} (e.g. q,v).")
        if self.tp_comm not in ("xla", "collective"):
            raise ValueError(f"train.tp_comm={self.tp_comm!r}: choose 'xla' (XLA's collectives) "
                             "or 'collective' (collective matmuls; needs mesh.sequence_parallel).")


@dataclass(frozen=True)
class GenerateConfig:
    """Sampling from a trained model."""

    prompt: str = "ROMEO:"  # text the sample continues
    max_new_tokens: int = 200  # tokens to generate
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens (0 = off)
    top_p: float = 1.0  # nucleus sampling mass (1 = off)
    seed: int = 0  # sampling seed
    eos_id: int = -1  # stop a sequence at this token (-1 = never)
    path: DecodePath = "auto"  # decode path: auto (fastest that runs), megakernel, fast, reference
    head: DecodeHead = "auto"  # output layer: auto, xla, kernel (Pallas), fused (inside the megakernel)
    kernel_state: bool | None = None  # the megakernel keeps its state between steps (None: its default)

    def __post_init__(self):
        _check_unless_deferred(self)

    def check(self) -> None:
        """Raise ValueError naming the field and the fix for values sampling cannot take."""
        check_ranges(self)
        if self.path not in DECODE_PATHS:
            raise ValueError(f"generate.path={self.path!r}; choose one of "
                             f"{', '.join(DECODE_PATHS)}.")
        if self.head not in DECODE_HEADS:
            raise ValueError(f"generate.head={self.head!r}; choose one of {', '.join(DECODE_HEADS)}.")


@dataclass(frozen=True)
class Config:
    """Everything one run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)

    def __post_init__(self):
        _check_unless_deferred(self)

    def check(self) -> None:
        """Every section's checks, then the ones across sections (mesh against model)."""
        self.model.check()
        self.mesh.check()
        self.data.check()
        self.train.check()
        self.generate.check()
        if self.mesh.pipeline > 1:
            check_pipeline(self.model, self.mesh.pipeline, self.train.pipeline_stage_layers,
                           self.train.pipeline_chunks)


def check_pipeline(m: ModelConfig, pipe: int, stage_layers: tuple[int, ...] = (),
                   chunks: int = 1) -> None:
    """The layer stack must split into `pipe` stages of whole units (layers; with MoE, groups
    of moe_every layers): evenly, or as `train.pipeline_stage_layers` says; interleaved,
    evenly into `pipe` x `chunks` chunks."""
    units = m.num_layers // m.moe_every if m.moe_experts else m.num_layers
    what = (f"{units} MoE groups (model.num_layers={m.num_layers} / model.moe_every="
            f"{m.moe_every})" if m.moe_experts else f"model.num_layers={m.num_layers} layers")
    if chunks > 1:
        if stage_layers:
            raise ValueError(f"train.pipeline_stage_layers={tuple(stage_layers)} with "
                             f"train.pipeline_chunks={chunks}: interleaved chunks take an even "
                             "split; drop train.pipeline_stage_layers")
        if units % (pipe * chunks):
            raise ValueError(
                f"train.pipeline_chunks={chunks}: mesh.pipeline={pipe} x {chunks} chunks does "
                f"not divide the {what}; choose chunks with pipeline x chunks dividing them")
        return
    if stage_layers:
        if len(stage_layers) != pipe or sum(stage_layers) != units or min(stage_layers) < 1:
            raise ValueError(
                f"train.pipeline_stage_layers={tuple(stage_layers)} must give each of the "
                f"mesh.pipeline={pipe} stages at least one of the {what}.")
        return
    if units % pipe:
        raise ValueError(
            f"mesh.pipeline={pipe} does not divide the {what}: each pipeline stage holds an "
            f"equal slice of the layer stack; choose mesh.pipeline in "
            f"{[p for p in range(1, units + 1) if units % p == 0]}, or give "
            "train.pipeline_stage_layers.")


_deferred: ContextVar[bool] = ContextVar("gendist_config_checks_deferred", default=False)


@contextlib.contextmanager
def deferred_checks():
    """Build configs without running their checks (the CLI parses all flags first, then
    calls `Config.check()` once, so that a mistake gets our one-line error)."""
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def _check_unless_deferred(cfg) -> None:
    if not _deferred.get():
        cfg.check()


_SECTIONS = {"ModelConfig": "model", "MeshConfig": "mesh", "DataConfig": "data",
             "TrainConfig": "train", "GenerateConfig": "generate"}


def _check_moe(m: ModelConfig) -> None:
    """The MoE fields against each other (their ranges: `check_ranges`)."""
    if m.moe_top_k > m.moe_experts:
        raise ValueError(
            f"model.moe_top_k={m.moe_top_k} must be in [1, model.moe_experts={m.moe_experts}]: "
            "a token cannot pick more experts than exist; lower moe_top_k or add experts.")


# The projections LoRA can adapt (train.lora_targets).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
INT32_MAX = 2**31 - 1  # sizes, steps and seeds become int32 arrays and shapes
FLOAT32_MAX = 3.4028234663852886e38  # floats feed float32 math: larger ones turn into inf
MAX_PARAMS = 10**13  # no machine holds the training state of a larger model


@dataclass(frozen=True)
class Range:
    """The values a numeric field takes: [lo, hi] (open ends: lo_open / hi_open), plus
    `special` values outside it with a meaning (-1 = the remaining devices), a `noun` saying
    what the number is and a `note` on a value's meaning (0 = off). Integers stop at INT32_MAX, floats must be finite float32."""

    lo: float
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    special: tuple[tuple[float, str], ...] = ()
    noun: str = ""
    note: str = ""

    def holds(self, v) -> bool:
        if any(v == s for s, _ in self.special):
            return True
        hi = self.hi
        return ((v > self.lo if self.lo_open else v >= self.lo)
                and (hi is None or (v < hi if self.hi_open else v <= hi)))

    def text(self, noun: str = "") -> str:
        """'> 0', 'an integer >= 1', 'in [0, 1)', '-1 (the remaining devices) or >= 1'."""
        if self.hi is None:
            rng = f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        else:
            rng = (f"in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}"
                   f"{')' if self.hi_open else ']'}")
        rng = f"{noun} {rng}" if noun else rng
        return "".join(f"{_num(v)} ({what}) or " for v, what in self.special) + rng


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


POSITIVE, NON_NEGATIVE = Range(1), Range(0)  # integers
POSITIVE_REAL, NON_NEGATIVE_REAL = Range(0, lo_open=True), Range(0)
FRACTION = Range(0, 1)
# Every numeric field's range by section; a numeric field not listed must be >= 0.
RANGES: dict[str, dict[str, Range]] = {
    "model": {
        **dict.fromkeys(("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                         "head_dim", "d_ff", "max_seq_len", "rope_original_max_len",
                         "scan_unroll", "moe_every", "moe_top_k"), POSITIVE),
        **dict.fromkeys(("rope_theta", "rope_scaling_factor", "rope_low_freq_factor",
                         "rope_high_freq_factor", "norm_eps", "init_std",
                         "moe_capacity_factor"), POSITIVE_REAL),
        "moe_experts": Range(0, noun="a number of experts", note="0 = a dense model"),
        "moe_d_ff": Range(0, noun="a width", note="0 = model.d_ff"),
        "moe_load_balance_weight": NON_NEGATIVE_REAL, "moe_z_loss_weight": NON_NEGATIVE_REAL,
    },
    "mesh": dict.fromkeys(("data", "pipeline", "expert", "tensor"),
                          Range(1, special=((-1, "the remaining devices"),),
                                noun="a number of devices")),
    "data": {"val_fraction": Range(0, 1, lo_open=True, hi_open=True,
                                   noun="a fraction of the corpus"),
             "seed": NON_NEGATIVE},
    "train": {
        **dict.fromkeys(("batch_size", "seq_len", "steps", "grad_accum", "eval_every",
                         "eval_batches", "log_every", "keep_checkpoints", "pipeline_chunks"),
                        POSITIVE),
        "lr": POSITIVE_REAL, "min_lr_ratio": FRACTION, "warmup_steps": NON_NEGATIVE,
        "weight_decay": NON_NEGATIVE_REAL, "b1": Range(0, 1, hi_open=True),
        "b2": Range(0, 1, hi_open=True), "grad_clip": POSITIVE_REAL, "seed": NON_NEGATIVE,
        "checkpoint_every": Range(0, noun="a number of steps", note="0 = only at the end"),
        "checkpoint_every_minutes": Range(0, noun="a number of minutes", note="0 = off"),
        "pipeline_microbatches": Range(0, noun="a number of microbatches",
                                       note="0 = 2 x stages"),
        "pipedream_window": NON_NEGATIVE, "terapipe_slices": NON_NEGATIVE,
        "pipeline_stage_layers": Range(1, noun="a list of layer counts, each"),
        "debug_nan_step": Range(0, special=((-1, "off"),)),
        "fp8_history": Range(1, 1024, noun="a number of steps"),
        "fp8_margin": Range(0, 16, noun="a power of two of headroom"),
        "lora_rank": Range(0, noun="a rank", note="0 = off"),
        "lora_alpha": POSITIVE_REAL, "dpo_beta": POSITIVE_REAL,
    },
    "generate": {
        "max_new_tokens": NON_NEGATIVE,
        "temperature": Range(0, noun="a temperature", note="0 = greedy"),
        "top_k": Range(0, noun="a number of tokens", note="0 = off"),
        "top_p": Range(0, 1, lo_open=True, noun="a probability mass", note="1 = off"),
        "seed": NON_NEGATIVE, "eos_id": Range(0, special=((-1, "never"),)),
    },
}


def numeric_fields(cls) -> dict[str, type]:
    """{field: int or float} of a config class: its numbers and tuples of numbers."""
    import typing
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        if typing.get_origin(hint) is tuple:
            hint = typing.get_args(hint)[0]
        if hint in (int, float):
            out[name] = hint
    return out


def check_ranges(cfg) -> None:
    """Raise ValueError for a numeric field outside its `RANGES` entry (or NaN, infinite,
    beyond int32/float32, or not a number), naming the flag, the value and the fix."""
    import dataclasses
    import numbers
    section = _SECTIONS[type(cfg).__name__]
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for name, kind in numeric_fields(type(cfg)).items():
        value = getattr(cfg, name)
        rng = RANGES[section].get(name, NON_NEGATIVE if kind is int else NON_NEGATIVE_REAL)
        for v in value if isinstance(value, tuple) else (value,):
            number = (isinstance(v, numbers.Integral) if kind is int
                      else isinstance(v, numbers.Real)) and not isinstance(v, bool)
            ok = number and rng.holds(v) and (
                abs(v) <= INT32_MAX if kind is int else abs(v) <= FLOAT32_MAX)  # NaN: False
            if ok:
                continue
            noun = rng.noun or ("an integer" if kind is int else "a finite number")
            cap = ""
            if number and kind is int and abs(v) > INT32_MAX:
                cap = f" and at most {INT32_MAX} (int32)"
            elif number and kind is float and abs(v) > FLOAT32_MAX and math.isfinite(v):
                cap = " and at most 3.4e38 (float32)"
            note = f" ({rng.note})" if rng.note else ""
            flag = f"--{section}.{name.replace('_', '-')}"
            default = defaults[name]
            hint = (f" (default {default})" if not isinstance(default, tuple)
                    else f" (default {' '.join(map(str, default))})" if default else "")
            raise ValueError(f"{section}.{name}={value!r} must be {rng.text(noun)}{cap}{note}; "
                             f"pass {flag} with a value {rng.text()}{hint}.")
