"""PipeDream (stashing / no stashing) and PipeDream-2BW against sequential oracles.

The weights carry a `tag` that the optimizer increments at every update, so the tag a
forward or backward reads is the weight version it computed with. The predictions are
derived by hand from 1F1B (stage s runs p-1-s warm-up forwards), not from the plan:
forward of microbatch i on stage s sees version max(0, i-(p-1-s)); without stashing the
backward sees version i, min(i, p-1-s) newer; 2BW with window W uses max(0, i//W - 1) in
both. Each run is also compared with a plain-Python replay of those semantics.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import stash_update
from jax.sharding import Mesh

from gendist.parallel import pipeline as pl
from gendist.parallel.pipeline import pipedream as PD
from gendist.parallel.pipeline import schedules as S

D, F, V, T, MB = 16, 32, 32, 8, 2
DATA, P_STAGES = 2, 4
RTOL, ATOL = 1e-5, 1e-6  # fp32 params after several SGD steps, fixed
NAN = float("nan")


def init_params(key, num_layers=4):
    k = jax.random.split(key, 4)
    return {"embed": {"tok": jax.random.normal(k[0], (V, D))},
            "layers": {"w1": jax.random.normal(k[1], (num_layers, D, F)) / 4,
                       "w2": jax.random.normal(k[2], (num_layers, F, D)) / 6,
                       "tag": jnp.zeros((num_layers,))},
            "head": {"w": jax.random.normal(k[3], (D, V)) / 4}}


def embed_fn(e, tokens_BT):
    return e["tok"][tokens_BT]


def layer_fn(lp, x_BTD):
    return x_BTD + jnp.tanh(x_BTD @ lp["w1"]) @ lp["w2"]


def head_loss_fn(hp, x_BTD, targets_BT):
    logp = jax.nn.log_softmax(x_BTD @ hp["w"])
    return -jnp.take_along_axis(logp, targets_BT[..., None], -1).sum(), targets_BT.size


MODEL = dict(embed_fn=embed_fn, layer_fn=layer_fn, head_loss_fn=head_loss_fn)


def tagged(opt):
    """`opt` on the weights; the `tag` leaves count updates instead."""
    def update(grads, state, params=None):
        updates, state = opt.update(grads, state, params)
        return jax.tree_util.tree_map_with_path(
            lambda path, u: jnp.ones_like(u) if path[-1].key == "tag" else u, updates), state
    return optax.GradientTransformation(opt.init, update)


def probe(w):
    return w[1]["tag"][0]  # the stage's first layer


def batch(m, seed=0):
    kt, ky = jax.random.split(jax.random.key(seed))
    shape = (DATA * m * MB, T)
    return jax.random.randint(kt, shape, 0, V), jax.random.randint(ky, shape, 0, V)


def microbatch(arr, i, m):
    """Rows of microbatch i as the executor splits them: each data shard's i-th slice."""
    return arr.reshape(DATA, m, MB, *arr.shape[1:])[:, i].reshape(DATA * MB, *arr.shape[1:])


@functools.cache
def mesh():
    devices = np.array(jax.devices()[: DATA * P_STAGES]).reshape(DATA, P_STAGES, 1, 1)
    return Mesh(devices, ("data", "pipeline", "expert", "tensor"))


def run(params, m, mode, opt, schedule="1f1b", window=1, seed=0):
    tokens, targets = batch(m, seed)
    f = jax.jit(functools.partial(PD.pipedream_train, mesh=mesh(), optimizer=tagged(opt),
                                  num_microbatches=m, mode=mode, window=window,
                                  schedule=schedule, probe_fn=probe, bubble_value=NAN, **MODEL))
    return f(params, tokens, targets)


# --- the plain-Python replay -------------------------------------------------------------

def stage_params(params, s, p=P_STAGES):
    n = params["layers"]["w1"].shape[0] // p
    out = {"layers": jax.tree.map(lambda a: a[s * n:(s + 1) * n], params["layers"])}
    out |= {"embed": params["embed"]} if s == 0 else {}
    out |= {"head": params["head"]} if s == p - 1 else {}
    return out


def run_layers(lp, x):
    return jax.lax.scan(lambda x, l: (layer_fn(l, x), None), x, lp)[0]


@jax.jit
def stage_grads(ws, xs_in, tok, tgt):
    """Per-stage grads of one microbatch's mean loss; stage s runs its backward with ws[s]
    on the input xs_in[s] that the forward (possibly other weights) produced."""
    p = len(ws)
    count = tgt.size
    last = lambda w, x: head_loss_fn(w["head"], run_layers(w["layers"], x), tgt)[0] / count
    loss, vjp = jax.vjp(last, ws[-1], xs_in[-1])
    g_last, cot = vjp(jnp.ones_like(loss))
    grads = [g_last]
    for s in range(p - 2, 0, -1):
        _, vjp = jax.vjp(lambda w, x: run_layers(w["layers"], x), ws[s], xs_in[s])
        g, cot = vjp(cot)
        grads.insert(0, g)
    _, vjp = jax.vjp(lambda w: run_layers(w["layers"], embed_fn(w["embed"], tok)), ws[0])
    grads.insert(0, vjp(cot)[0])
    return loss, grads


@jax.jit
def stage_inputs(ws, tok):
    xs = [embed_fn(ws[0]["embed"], tok)]
    xs.append(run_layers(ws[0]["layers"], xs[0]))
    for w in ws[1:-1]:
        xs.append(run_layers(w["layers"], xs[-1]))
    return xs[1:]  # input of stages 1..p-1


def replay(params, m, opt, fwd_version, bwd_version, window=1, seed=0):
    """Sequential replay: microbatch i forwards with versions fwd_version(s, i) and
    backwards with bwd_version(s, i); stage s updates after every `window` backwards."""
    p = P_STAGES
    tokens, targets = batch(m, seed)
    versions = [[stage_params(params, s)] for s in range(p)]
    states = [opt.init(v[0]) for v in versions]
    acc = [None] * p
    losses = []
    for i in range(m):
        tok, tgt = microbatch(tokens, i, m), microbatch(targets, i, m)
        wf = [versions[s][fwd_version(s, i)] for s in range(p)]
        wb = [versions[s][bwd_version(s, i)] for s in range(p)]
        xs_in = [None] + stage_inputs(wf, tok)
        xs_in[0] = jnp.zeros(())  # stage 0 starts from tokens
        loss, grads = stage_grads(wb, xs_in, tok, tgt)
        losses.append(float(loss))
        stash_update(acc, grads, versions, states, opt, i, window)
    final = [v[-1] for v in versions]
    layers = jax.tree.map(lambda *a: jnp.concatenate(a), *[w["layers"] for w in final])
    return {"embed": final[0]["embed"], "layers": layers, "head": final[-1]["head"]}, losses


def assert_params_close(got, want, skip_tag=True):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                            strict=True):
        if skip_tag and path[-1].key == "tag":
            continue
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL,
                                   err_msg=jax.tree_util.keystr(path))


# --- tests -------------------------------------------------------------------------------

M = 8
OPT = optax.sgd(0.3)
STAGE = np.arange(P_STAGES)[:, None]
MB_I = np.arange(M)[None, :]
FWD_1F1B = np.maximum(0, MB_I - (P_STAGES - 1 - STAGE))  # versions forwards see


def test_stashing_backward_uses_the_forwards_version():
    params = init_params(jax.random.key(0))
    got, info = run(params, M, "stash", OPT)
    np.testing.assert_array_equal(info["fwd_probe"], FWD_1F1B)
    np.testing.assert_array_equal(info["bwd_probe"], FWD_1F1B)
    np.testing.assert_array_equal(got["layers"]["tag"], M)  # one update per microbatch
    v = lambda s, i: max(0, i - (P_STAGES - 1 - s))
    want, losses = replay(params, M, OPT, v, v)
    np.testing.assert_allclose(info["loss"], losses, rtol=RTOL)
    assert_params_close(got, want)


def test_without_stashing_backward_is_p_minus_1_minus_s_versions_newer():
    params = init_params(jax.random.key(0))
    got, info = run(params, M, "nostash", OPT)
    np.testing.assert_array_equal(info["fwd_probe"], FWD_1F1B)
    staleness = np.minimum(MB_I, P_STAGES - 1 - STAGE)  # [[0 1 2 3 3 ...], ..., [0 0 ...]]
    np.testing.assert_array_equal(info["bwd_probe"] - info["fwd_probe"], staleness)
    want, losses = replay(params, M, OPT, lambda s, i: max(0, i - (P_STAGES - 1 - s)),
                          lambda s, i: i)
    np.testing.assert_allclose(info["loss"], losses, rtol=RTOL)
    assert_params_close(got, want)
    stashed, _ = run(params, M, "stash", OPT)
    diff = np.abs(np.asarray(stashed["layers"]["w1"]) - np.asarray(got["layers"]["w1"])).max()
    assert diff > 1e-3, "stashing made no difference: the staleness test would be vacuous"


def test_2bw_uses_one_version_per_window_delayed_by_one():
    params = init_params(jax.random.key(1))
    m, window = 12, 4
    got, info = run(params, m, "2bw", OPT, window=window)
    want_version = np.broadcast_to(np.maximum(0, np.arange(m) // window - 1), (P_STAGES, m))
    np.testing.assert_array_equal(info["fwd_probe"], want_version)
    np.testing.assert_array_equal(info["bwd_probe"], want_version)
    np.testing.assert_array_equal(got["layers"]["tag"], m // window)
    v = lambda s, i: max(0, i // window - 1)
    want, losses = replay(params, m, OPT, v, v, window=window)
    np.testing.assert_allclose(info["loss"], losses, rtol=RTOL)
    assert_params_close(got, want)
    assert PD.version_plan(S.one_f_one_b(P_STAGES, m), "2bw", window).num_slots == 2


@pytest.mark.parametrize("mode", ["stash", "nostash"])
def test_one_microbatch_in_flight_equals_plain_optimizer_steps(mode):
    """The `sequential` schedule: no staleness, so PipeDream is plain SGD+momentum steps."""
    opt = optax.sgd(0.2, momentum=0.9)
    params = init_params(jax.random.key(2))
    m = 3
    got, info = run(params, m, mode, opt, schedule="sequential")
    np.testing.assert_array_equal(info["bwd_probe"], np.broadcast_to(np.arange(m), (P_STAGES, m)))
    tokens, targets = batch(m)
    loss_grad = jax.jit(jax.value_and_grad(functools.partial(pl.sequential_loss, **MODEL)))
    want, state = params, opt.init(params)
    for i in range(m):
        loss, g = loss_grad(want, microbatch(tokens, i, m), microbatch(targets, i, m))
        np.testing.assert_allclose(info["loss"][i], loss, rtol=RTOL)
        upd, state = opt.update(g, state, want)
        want = optax.apply_updates(want, upd)
    assert_params_close(got, want)


def test_plan_errors_name_the_field():
    with pytest.raises(ValueError, match="window"):
        PD.version_plan(S.one_f_one_b(4, 8), "2bw", 2)  # window < p - 1
    with pytest.raises(ValueError, match="window"):
        PD.version_plan(S.one_f_one_b(4, 8), "2bw", 3)  # does not divide m
    with pytest.raises(ValueError, match="mode"):
        PD.version_plan(S.one_f_one_b(4, 8), "vertical")
    assert PD.version_plan(S.one_f_one_b(4, 8), "stash").num_slots == 4  # p versions on stage 0
    assert PD.version_plan(S.one_f_one_b(4, 8), "nostash").num_slots == 1
