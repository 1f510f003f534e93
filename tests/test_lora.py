"""LoRA (Hu et al. 2021) on the one train-step builder: a LoRA step on data 2 x tensor 2 x
ZeRO-3 x accumulation 2, on data 4 x ZeRO-2 and on a 2-stage pipeline equals one device (fp32,
rtol 1e-5); the frozen base is
bit-identical after training; the optimizer state holds adapters only (its leaves and the
compiled step's argument bytes); the first SGD step moves W_eff by exactly the relation the
scale alpha/r gives (and, at full rank with matched alpha and orthogonal A, by full
fine-tuning's step); a run's export, and generate --adapters on the base, are base + adapters.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_of, small_config

from gendist import hf
from gendist.data.batches import TextData, shard_batch
from gendist.models import transformer
from gendist.presets import replace
from gendist.sharding import DEFAULT_RULES
from gendist.training import gradients, loop, lora, train

RTOL = 1e-5
TARGETS = "q,k,v,o,gate,up,down"
STEPS = 2


def lora_config(out_dir="/tmp/gendist-test-lora", **kw):
    cfg = replace(small_config(out_dir), **{"train.lora_rank": 4, "train.lora_alpha": 8.0,
                                            "train.lora_targets": TARGETS,
                                            "train.steps": STEPS, **kw})
    return cfg


@pytest.fixture(scope="module")
def data():
    return TextData.from_config(small_config().data)


@pytest.fixture(scope="module")
def one_device_run(data, tmp_path_factory):
    """A LoRA run of STEPS steps on one device, through the training loop (checkpoint and
    adapters folder written)."""
    out = tmp_path_factory.mktemp("lora") / "run"
    cfg = lora_config(str(out))
    result = loop.run(cfg, mesh=mesh_of(1), data=data, log=lambda *_: None)
    return cfg, result, out


def batches(data, mesh):
    return [shard_batch(data.global_batch(i, 8, 16), mesh) for i in range(STEPS)]


@pytest.mark.parametrize("name,kw,mesh", [
    ("data2-tensor2-zero3-accum2", {"train.zero_stage": 3, "train.grad_accum": 2},
     dict(n=4, data=2, tensor=2)),
    ("pipeline2", {}, dict(n=2, data=1, pipeline=2)),
    ("data4-zero2", {"train.zero_stage": 2}, dict(n=4, data=4)),
])
def test_lora_step_matches_one_device(data, one_device_run, name, kw, mesh):
    cfg, ref, _ = one_device_run
    mesh = mesh_of(mesh.pop("n"), **mesh)
    setup = train.build(replace(cfg, **kw), mesh)
    state = setup.init_state()
    base0 = jax.device_get(state["base"])
    losses = []
    for b in batches(data, mesh):
        state, m = setup.step_fn(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, [h["loss"] for h in ref.history], rtol=RTOL)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(state["params"])),
                            jax.tree.leaves(jax.device_get(ref.state["params"])), strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    # the adapters did move (B starts at zero), the base did not, bit for bit
    assert float(np.abs(jax.device_get(state["params"]["blocks"]["wq"]["b"])).max()) > 0
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state["base"]), base0)
    # the adapters' placement follows the layers they adapt: B of wq splits its heads on tensor
    if name.startswith("data2"):
        spec = state["params"]["blocks"]["wq"]["b"].sharding.spec
        assert spec[2] == "tensor" and spec[1] is None  # (layers, r, heads, head_dim)


def test_base_frozen_and_optimizer_state_holds_adapters_only(data, one_device_run):
    cfg, result, _ = one_device_run
    # the base after training is the initial params bit for bit
    init = transformer.init_params(cfg.model, cfg.train.seed)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(result.state["base"]), init)
    shapes = {tuple(x.shape) for x in jax.tree.leaves(lora.shapes(cfg.model, cfg.train))}
    opt_leaves = jax.tree.leaves(result.state["opt_state"])
    assert {tuple(x.shape) for x in opt_leaves if x.ndim} == shapes
    ad_bytes = sum(x.size * 4 for x in jax.tree.leaves(result.state["params"]))
    base_bytes = sum(x.size * 4 for x in jax.tree.leaves(init))
    # compiled: the step's arguments are the base + adapters, Adam's m and v + the batch
    setup = result.setup
    batch = batches(data, setup.mesh)[0]
    args = setup.step_fn.lower(result.state, batch).compile().memory_analysis()
    args = args.argument_size_in_bytes
    batch_bytes = sum(x.size * 4 for x in jax.tree.leaves(batch))
    expected = base_bytes + 3 * ad_bytes + batch_bytes
    assert expected <= args <= expected + 64, (args, expected)  # + step counters (scalars)
    assert args < 1.5 * base_bytes  # full fine-tuning: 3 x base (params, m, v) + the batch


def test_first_sgd_step_follows_the_scale(data):
    """With SGD (lr eta) and B = 0, the first step leaves A and sets B = -eta s A^T G, so
    W_eff moves by -eta s^2 A A^T G (s = alpha/r, G = dL/dW). At full rank r = D with
    A = sigma Q (Q orthogonal) and alpha = r / sigma, s^2 A A^T = I: the step is full
    fine-tuning's -eta G exactly."""
    D = small_config().model.d_model
    cfg = replace(small_config(), **{"train.lora_rank": D, "train.lora_alpha": 3.0,
                                     "train.lora_targets": "q"})
    eta, sigma = 0.5, 0.25
    batch = {k: jnp.asarray(v) for k, v in data.global_batch(0, 8, 16).items()}
    base = transformer.init_params(cfg.model, 0)
    mesh = mesh_of(1)
    W0 = base["blocks"]["wq"]  # [L, D, N, H]
    G = jax.grad(lambda p: gradients.loss_fn(cfg, p, batch))(base)["blocks"]["wq"]

    def lora_step(cfg, adapters):
        engine = lora.wrap_engine(cfg, gradients.plain_engine(cfg, mesh, DEFAULT_RULES))
        opt = optax.sgd(eta)
        step = jax.jit(train.make_train_step(cfg, opt, engine))
        state = {"step": jnp.zeros((), jnp.int32), "params": adapters,
                 "opt_state": opt.init(adapters), "base": base}
        new, _ = step(state, batch)
        np.testing.assert_array_equal(new["params"]["blocks"]["wq"]["a"],
                                      adapters["blocks"]["wq"]["a"])  # dA = s G B^T = 0
        # W_eff - W = s A B (B was 0): the step's change, without fp32 cancellation
        ab = new["params"]["blocks"]["wq"]
        return lora.delta("wq", ab["a"], ab["b"], lora.scale(cfg.train))

    L = W0.shape[0]
    flat = lambda w: w.reshape(L, D, -1)  # noqa: E731
    ad = lora.init(cfg.model, cfg.train, 0)
    A = ad["blocks"]["wq"]["a"]  # [L, D, r]
    s = lora.scale(cfg.train)
    dW = flat(lora_step(cfg, ad))
    want = -eta * s**2 * jnp.einsum("ldr,ler,lef->ldf", A, A, flat(G), precision="highest")
    np.testing.assert_allclose(dW, want, rtol=RTOL, atol=RTOL * float(jnp.abs(want).max()))
    assert float(jnp.abs(dW).max()) > 1e-8  # a step, not zeros

    Q = jnp.linalg.qr(jax.random.normal(jax.random.key(1), (L, D, D)))[0]
    cfg2 = replace(cfg, **{"train.lora_alpha": D / sigma})
    ad2 = {"blocks": {"wq": {"a": sigma * Q, "b": ad["blocks"]["wq"]["b"]}}}
    dW2 = lora_step(cfg2, ad2)
    # atol: 1e-5 of the update's largest entry (Q Q^T = I to fp32 rounding)
    np.testing.assert_allclose(dW2, -eta * G, rtol=RTOL, atol=RTOL * eta * float(jnp.abs(G).max()))


def test_export_and_generate_adapters_equal_base_plus_adapters(one_device_run, tmp_path,
                                                               capsys):
    from gendist.cli.export import cmd_export
    from gendist.cli.generate import cmd_generate
    cfg, result, out = one_device_run
    saved_t, adapters, _ = lora.load(out / loop.ADAPTERS_DIR)
    assert (saved_t.lora_rank, saved_t.lora_alpha, saved_t.lora_targets) == (4, 8.0, TARGETS)
    base = transformer.init_params(cfg.model, cfg.train.seed)
    # the merge done here in NumPy: W + (alpha / r) A B, A [L, in..., r], B [L, r, out...]
    want = jax.tree.map(np.asarray, base)
    for name, ab in adapters["blocks"].items():
        a, b = np.asarray(ab["a"], np.float64), np.asarray(ab["b"], np.float64)
        w = want["blocks"][name]
        n_in = 2 if name == "wo" else 1
        L, r = a.shape[0], a.shape[-1]
        prod = np.matmul(a.reshape(L, -1, r), b.reshape(L, r, -1))
        want["blocks"][name] = (w + 8.0 / 4 * prod.reshape(w.shape)).astype(np.float32)
        assert math.prod(w.shape[1:1 + n_in]) == a.reshape(L, -1, r).shape[1]
    tokens = jnp.asarray(np.arange(24, dtype=np.int32).reshape(2, 12) * 7 % 256)
    want_logits = transformer.forward(cfg.model, want, tokens)
    assert cmd_export(["--checkpoint", str(out), "--out", str(tmp_path / "merged")]) == 0
    got = hf.load_params(tmp_path / "merged", cfg.model)
    np.testing.assert_allclose(transformer.forward(cfg.model, got, tokens), want_logits,
                               rtol=RTOL, atol=1e-5)
    # the adapters differ from zero enough to matter
    base_logits = transformer.forward(cfg.model, base, tokens)
    assert float(jnp.abs(base_logits - want_logits).max()) > 1e-4
    # generate: the base in HF layout + --adapters gives the merged model's greedy text
    hf.save(tmp_path / "base", cfg.model, base)
    flags = ["--tokenizer", "bytes", "--max-new-tokens", "6", "--temperature", "0",
             "--prompt", "KING"]
    capsys.readouterr()
    assert cmd_generate(["--model-dir", str(tmp_path / "merged"), *flags]) == 0
    merged_text = capsys.readouterr().out
    assert cmd_generate(["--model-dir", str(tmp_path / "base"), "--adapters",
                         str(out / loop.ADAPTERS_DIR), *flags]) == 0
    assert capsys.readouterr().out == merged_text
