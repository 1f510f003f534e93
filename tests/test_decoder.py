"""The decode front door (`gendist.inference.decoder`): which path "auto" takes for a model,
batch and device (a pure function, checked here for every case on a CPU), the errors of an
explicit path that cannot run, and every decoder in gendist going through a plan."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gendist.config import GenerateConfig, ModelConfig
from gendist.inference import decoder
from gendist.inference import generate as G
from gendist.inference import megakernel as mk
from gendist.inference.engine import Engine, EngineConfig, Request
from gendist.inference.sampling import SamplingParams
from gendist.models import transformer
from pallas_kernels.chain import chain_mgpu

MHA = ModelConfig(d_model=128, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=64,
                  d_ff=192, max_seq_len=64, dtype="bfloat16")  # what the megakernel takes
GQA = dataclasses.replace(MHA, num_kv_heads=1)  # the megakernel takes grouped-query attention
WIDE = dataclasses.replace(MHA, head_dim=128)  # num_heads * head_dim != d_model: it does not
MOE = dataclasses.replace(MHA, moe_experts=4, moe_top_k=2, moe_every=2)
H200, A100 = "NVIDIA H200", "NVIDIA A100-SXM4-80GB"
NO_GPU = "decode: reference — cpu (the fast path and the megakernel need a GPU)"


def auto(cfg, batch, **kw):
    """(path, line) that "auto" takes on this machine (the reference path on a CPU)."""
    return decoder.choose(cfg, batch, *decoder.this_device(), **kw)

TABLE = [  # cfg, batch, platform, device kind, options -> path, line
    (MHA, 1, "gpu", H200, {}, "megakernel", "decode: megakernel (batch 1, NVIDIA H200)"),
    (MHA, 1, "gpu", "NVIDIA H100 80GB HBM3", {}, "megakernel",
     "decode: megakernel (batch 1, NVIDIA H100 80GB HBM3)"),
    (GQA, 1, "gpu", H200, {}, "megakernel", "decode: megakernel (batch 1, NVIDIA H200)"),
    (WIDE, 1, "gpu", H200, {}, "fast",
     "decode: fast path — the megakernel needs num_heads * head_dim == d_model (this has 2 x 128 "
     "for 128)"),
    (MOE, 1, "gpu", H200, {}, "reference",
     "decode: reference — an MoE model (the fast path and the megakernel are dense)"),
    (MHA, 4, "gpu", H200, {}, "fast",
     "decode: fast path — the megakernel needs batch 1 (this is batch 4)"),
    (MHA, 1, "gpu", A100, {}, "fast",
     f"decode: fast path — the megakernel needs a Hopper GPU (sm90; this is {A100})"),
    (MHA, 1, "gpu", H200, dict(paged=True), "fast",
     "decode: fast path — the megakernel needs a contiguous cache (continuous batching "
     "pages it)"),
    (MHA, 1, "gpu", H200, dict(step_tokens=5), "fast",
     "decode: fast path — the megakernel needs one token a call (this plan decodes 5)"),
    (MHA, 1, "gpu", H200, dict(max_len=2048), "megakernel", "decode: megakernel (batch 1, NVIDIA H200)"),
    (GQA, 1, "gpu", H200, dict(max_len=2049), "fast",
     "decode: fast path — the megakernel needs a context of at most 2,048 tokens to be the faster "
     "(this plan decodes up to 2,049: past it its attention reads the cache slower than the fast path's)"),
    (MHA, 1, "cpu", "cpu", {}, "reference", NO_GPU),
    (GQA, 4, "cpu", "cpu", {}, "reference", NO_GPU),
    (MOE, 1, "cpu", "cpu", {}, "reference", NO_GPU),
]


@pytest.mark.parametrize("cfg,batch,platform,kind,kw,path,line", TABLE,
                         ids=["mha-h200", "mha-h100", "gqa", "wide", "moe", "batch4", "a100", "paged",
                              "verify5", "short", "long", "cpu", "cpu-gqa-batch4", "cpu-moe"])
def test_auto_takes_the_fastest_path_that_runs(cfg, batch, platform, kind, kw, path, line):
    assert decoder.choose(cfg, batch, platform, kind, **kw) == (path, line)


def test_a_long_context_keeps_an_explicit_megakernel():
    """Past `megakernel.LONGEST_CONTEXT` auto takes the fast path (its attention is the faster
    there); the megakernel asked for by name still runs."""
    kw = dict(platform="gpu", device_kind=H200)
    assert decoder.resolve(MHA, 1, "auto", max_len=4096, **kw)[0] == "fast"
    assert decoder.resolve(MHA, 1, "megakernel", max_len=4096, **kw)[0] == "megakernel"


def test_hopper_device_kinds():
    hopper = ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA GH200 480GB",
              "NVIDIA H800", "NVIDIA H20"]
    other = [A100, "NVIDIA L40S", "Tesla T4", "NVIDIA B200", "cpu", "NVIDIA RTX 6000 Ada"]
    assert all(decoder.hopper(k) for k in hopper)
    assert not any(decoder.hopper(k) for k in other)


@pytest.mark.parametrize("cfg,batch,path,kw,message", [
    (WIDE, 1, "megakernel", {}, "generate.path='megakernel': the megakernel needs num_heads * "
                                "head_dim == d_model (this has 2 x 128 for 128); use generate.path='fast'"),
    (MHA, 2, "megakernel", {}, "needs batch 1 (this is batch 2)"),
    (MHA, 1, "megakernel", dict(device=("cpu", "cpu")),
     "generate.path='megakernel': the megakernel's kernel needs a "
                               "Hopper GPU (sm90; this is cpu); use generate.path='auto', or "
                               "pass kernel=megakernel.chain_reference"),
    (MHA, 1, "megakernel", dict(paged=True, kernel=mk.chain_reference),
     "reads a contiguous cache, not a paged one"),
    (MOE, 1, "fast", {}, "generate.path='fast': an MoE model has no decode layout"),
    (MHA, 1, "fastest", {}, "generate.path='fastest'; choose one of auto, megakernel, fast, "
                            "reference"),
])
def test_a_path_that_cannot_run_says_why_and_the_fix(cfg, batch, path, kw, message):
    params = transformer.init_params(cfg, 0)
    with pytest.raises(ValueError, match=re.escape(message)):
        decoder.plan(cfg, params, batch, 16, path, **kw)


def test_generate_config_checks_the_path():
    assert GenerateConfig().path == "auto" and GenerateConfig().head == "auto"
    assert GenerateConfig().kernel_state is None  # the plan's default (`megakernel.KEEP_STATE`)
    with pytest.raises(ValueError, match=re.escape("generate.path='fastest'; choose one of")):
        GenerateConfig(path="fastest")
    with pytest.raises(ValueError, match=re.escape("generate.head='inside'; choose one of auto, xla")):
        GenerateConfig(head="inside")


def test_a_hopper_plan_holds_the_kernel_and_its_weights():
    """What "auto" builds for the megakernel on a Hopper GPU (laid out here, not run): the
    Mosaic GPU kernel by default, the stacked norm-folded matrices (the layers' only copy: the
    prompt reads them too), and its cache; `kernel=` replaces the kernel; from 32k tokens the output layer runs inside
    the kernel, and the plan's line says so; greedy decoding's steps a call
    (`megakernel.GREEDY_STEPS`) bring the output layer inside and the kept state at any
    vocabulary, unless the plan asks for one step a call."""
    params = transformer.init_params(MHA, 0)
    greedy = (", the output layer inside the kernel, its state kept between steps, "
              f"{mk.GREEDY_STEPS} greedy steps a call")
    p = decoder.plan(MHA, params, 1, 100, device=("gpu", H200))
    assert (p.path, p.kernel, p.line) == ("megakernel", chain_mgpu,
                                          "decode: megakernel (batch 1, NVIDIA H200)" + greedy)
    assert (p.head, p.kernel_state, p.greedy_steps) == ("fused", True, mk.GREEDY_STEPS)
    one = decoder.plan(MHA, params, 1, 100, device=("gpu", H200), greedy_steps=1)
    assert (one.head, one.kernel_state, one.line) == ("xla", False, "decode: megakernel (batch 1, NVIDIA H200)")
    assert p.params["chain"][0].shape == (2, 3 * 128, 128) and "blocks" not in p.params
    blocks = mk.prompt_params(MHA, p.params)["blocks"]
    assert blocks["wqkv_CHD"].shape == (2, 3 * MHA.num_heads, MHA.head_dim, 128)
    assert isinstance(p.make_cache(), mk.ChainCache) and p.make_cache().kv.shape[3] == 128
    ref = decoder.plan(MHA, params, 1, 100, "megakernel", mk.chain_reference, device=("cpu", "cpu"))
    assert ref.kernel is mk.chain_reference and ref.line == (
        "decode: megakernel (batch 1, cpu, kernel chain_reference; generate.path='megakernel')" + greedy)
    gqa = decoder.plan(GQA, transformer.init_params(GQA, 0), 1, 100, device=("gpu", H200))
    assert gqa.path == "megakernel" and gqa.params["chain"][0].shape == (2, 128 + 2 * 64, 128)
    assert gqa.make_cache().kv.shape == (2, 2, 1, 128, 64)  # the kv heads only
    big = dataclasses.replace(MHA, vocab_size=mk.FUSED_HEAD_MIN_VOCAB)
    fused = decoder.plan(big, transformer.init_params(big, 0), 1, 100, device=("gpu", H200), greedy_steps=1)
    assert fused.head == "fused" and fused.line == (
        "decode: megakernel (batch 1, NVIDIA H200), the output layer inside the kernel")
    fast = decoder.plan(WIDE, transformer.init_params(WIDE, 0), 1, 100, device=("gpu", H200))
    assert (fast.path, fast.backend) == ("fast", "pallas")  # the paged kernel on a GPU


CFG = ModelConfig(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, d_ff=64,
                  max_seq_len=64)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture
def recorded(monkeypatch):
    """The paths of every plan built ("plans") and of every plan forward traced ("ran")."""
    rec = {"plans": [], "ran": []}
    real_plan, real_forward = decoder.plan, decoder.DecodePlan.forward

    def plan(*a, **kw):
        p = real_plan(*a, **kw)
        rec["plans"].append(p.path)
        return p

    def forward(self, *a):
        rec["ran"].append(self.path)
        return real_forward(self, *a)

    monkeypatch.setattr(decoder, "plan", plan)
    monkeypatch.setattr(decoder.DecodePlan, "forward", forward)
    jax.clear_caches()  # trace again, through the recording forward
    yield rec
    jax.clear_caches()


def _params(cfg=CFG):
    return jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x, transformer.init_params(cfg, 1))


def test_generate_tokens_and_generate_text_go_through_the_front_door(recorded):
    params = _params()
    pb, lb = G.pad_prompts([np.array([1, 2, 3]), np.array([4, 5])])
    out = {}
    for path in ("reference", "fast"):
        out[path], _ = G.generate_tokens(CFG, params, jnp.asarray(pb), jnp.asarray(lb),
                                         jax.random.key(0), max_new_tokens=5, sp=GREEDY,
                                         path=path)
    np.testing.assert_array_equal(out["fast"], out["reference"])
    texts = {p: G.generate_text(CFG, params, ["ab", "c"], max_new_tokens=4, sp=GREEDY, path=p)
             for p in ("auto", "fast")}
    assert texts["auto"] == texts["fast"] and len(texts["auto"]) == 2
    assert recorded["plans"] == ["reference", "fast", auto(CFG, 2)[0], "fast"]
    assert set(recorded["ran"]) == {"reference", "fast"}


def test_the_engine_goes_through_the_front_door(recorded):
    params = _params()
    ecfg = dict(max_slots=2, max_prompt_len=4, max_len=12, num_pages=8, page_size=4)
    outs = {}
    for path in ("auto", "fast"):
        eng = Engine(CFG, params, EngineConfig(**ecfg, path=path))
        outs[path] = [r.output for r in eng.run([Request(np.array([1, 2, 3]), 5),
                                                 Request(np.array([7]), 4)])]
    assert outs["auto"] == outs["fast"]
    assert recorded["plans"] == [auto(CFG, 2, paged=True)[0], "fast"]
    assert set(recorded["ran"]) == {auto(CFG, 2, paged=True)[0], "fast"}


def test_the_cli_samplers_go_through_the_front_door(recorded, capsys):
    from gendist.cli.generate import sample, speculative_sample
    from gendist.data.tokenizer import load_tokenizer
    tok = load_tokenizer("bytes")
    params = _params()
    g = GenerateConfig(prompt="ab", max_new_tokens=6, temperature=0.0, path="fast")
    text = sample(CFG, params, tok, g, ["ab"])[0]
    err = capsys.readouterr().err
    assert "decode: fast path (generate.path='fast')" in err and "tokens/s" in err
    assert recorded["plans"] == ["fast"]
    draft_cfg = dataclasses.replace(CFG, num_layers=1)
    spec, stats = speculative_sample(CFG, params, draft_cfg, _params(draft_cfg), tok, g, "ab",
                                     gamma=2)
    assert spec == text  # greedy: the target's own tokens
    assert recorded["plans"] == ["fast", "fast", "fast"]  # the target's and the draft's
    err = capsys.readouterr().err
    assert "decode: fast path (generate.path='fast') [target]" in err
    assert "decode: fast path (generate.path='fast') [draft]" in err
    assert int(stats["steps"]) > 0 and set(recorded["ran"]) == {"fast"}


def test_generate_a_preset_with_random_weights(recorded, capsys):
    from gendist.cli.main import main
    assert main(["generate", "--preset", "tiny", "--prompt", "x",
                 "--generate.max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("weights: random (preset tiny; 0.89M params); give --checkpoint DIR "
                          "for a trained model\nx")
    from gendist.presets import preset
    path, line = auto(preset("tiny").model, 1)
    assert line in err and "tokens/s" in err
    assert recorded["plans"] == [path]
    assert main(["generate", "--preset", "tiny", "--generate.path", "fast", "--prompt", "x",
                 "--generate.max-new-tokens", "4"]) == 0
    assert "decode: fast path (generate.path='fast')" in capsys.readouterr().err
    assert main(["generate"]) == 2
    err = capsys.readouterr().err
    assert all(flag in err for flag in ("--checkpoint DIR", "--model-dir DIR", "--preset NAME"))


def test_a_megakernel_program_compiles_with_the_stacked_prompt_options(monkeypatch):
    """`decoder.jit_by_path` (what `generate` and `speculative_generate` are): a program
    that runs a megakernel plan compiles with `STACKED_PROMPT_OPTIONS` (its prompt's layer
    slices read in place), any other with XLA's defaults; `.lower` picks the same; inside
    another jit it makes no program of its own, so it takes the outer one's options."""
    made, real = [], jax.jit

    def recording(fun, **kw):
        made.append(kw.get("compiler_options"))
        return real(fun, **kw)

    monkeypatch.setattr(jax, "jit", recording)
    f = decoder.jit_by_path(lambda path, x: x + 1, ("path",), lambda path, x: (path,))
    one = jnp.float32(1)
    assert float(f("megakernel", one)) == 2.0 and float(f("fast", one)) == 2.0
    assert made == [dict(decoder.STACKED_PROMPT_OPTIONS), None]
    assert decoder.compiler_options("fast", "megakernel") == made[0] and decoder.compiler_options("fast") is None
    assert float(f.lower("megakernel", one).compile()(one)) == 2.0
    assert float(real(lambda x: f("megakernel", x))(one)) == 2.0  # nested: the no-option program
    assert made == [dict(decoder.STACKED_PROMPT_OPTIONS), None]
