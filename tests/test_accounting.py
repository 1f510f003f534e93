"""`plan`: predicted memory and communication match what XLA compiled; the HLO reader."""

import jax
import numpy as np
import pytest
from helpers import experiment, mesh_of, small_config

from gendist import accounting, collectives
from gendist.presets import replace
from gendist.training import train

HLO = """HloModule m

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %ar = f32[4,8]{1,0} all-reduce(%x), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add
  %ag = f32[8,8]{1,0} all-gather(%y), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, metadata={op_name="jit(step)/transpose(jvp())/x"}
}

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %w = (s32[], f32[4,8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %rs = bf16[2,8]{1,0} reduce-scatter(%z), channel_id=3, replica_groups=mesh['data'=2,'pipeline'=1,'expert'=1,'tensor'=4] {'data'}, dimensions={0}
  %t2 = (f32[], f32[16]{0}) all-reduce(%q, %r), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %cp = f32[4]{0} collective-permute(%v), channel_id=5, source_target_pairs={{0,4},{4,0},{1,5},{5,1}}
}
"""


def test_hlo_reader_groups_axes_bytes_and_trip_counts():
    mesh = mesh_of(8, data=2, tensor=4)
    got = {(c.kind, c.axes): (c.payload, c.count, c.backward)
           for c in collectives.parse_collectives(HLO, mesh)}
    assert got[("all-reduce", "tensor")] == (4 * 8 * 4, 3, False)  # groups of 4 neighbours
    assert got[("all-gather", "data")] == (8 * 8 * 4, 3, True)  # transposed iota: strided
    assert got[("reduce-scatter", "data")] == (2 * 8 * 2 * 2, 1, False)  # input = out x 2
    assert got[("all-reduce", "data+tensor")] == (4 + 16 * 4, 1, False)
    assert got[("collective-permute", "data")] == (16, 1, False)
    table = collectives.comm_table(collectives.parse_collectives(HLO, mesh))
    assert table[("all-reduce", "tensor")] == 3 * 128
    assert collectives.wire_bytes("all-reduce", 100, 4) == 150
    assert collectives.wire_bytes("all-gather", 100, 4) == 75


CONFIGS = [  # (data, tensor, zero stage, sequence parallel, dtype)
    (2, 4, 0, False, "float32"),
    (4, 2, 2, False, "bfloat16"),
    (2, 4, 3, True, "float32"),
    (8, 1, 1, False, "float32"),
]


@pytest.mark.parametrize("d,t,stage,sp,dtype", CONFIGS)
def test_plan_matches_compiled_within_10_percent(d, t, stage, sp, dtype):
    cfg = replace(small_config(), **{
        "model.num_heads": 8, "model.num_kv_heads": 8, "model.head_dim": 4,
        "model.dtype": dtype, "train.zero_stage": stage, "mesh.sequence_parallel": sp})
    setup = train.build(cfg, mesh_of(8, data=d, tensor=t))
    pred, comp = accounting.predict(setup), accounting.compiled_figures(setup)
    for k in ("params", "optimizer state", "arguments (state + batch)"):
        assert abs(pred["memory"][k] - comp["memory"][k]) <= 0.1 * comp["memory"][k], k
    assert set(pred["comm"]) == set(comp["comm"]), (pred["comm"], comp["comm"])
    for k, v in comp["comm"].items():
        assert abs(pred["comm"][k] - v) <= 0.1 * v, (k, pred["comm"][k], v)


def test_ideal_prediction_differs_only_where_the_cpu_compiler_does():
    cfg = replace(small_config(), **{"model.num_heads": 8, "model.num_kv_heads": 8,
                                     "model.head_dim": 4, "train.zero_stage": 2,
                                     "mesh.sequence_parallel": True, "model.dtype": "bfloat16"})
    setup = train.build(cfg, mesh_of(8, data=2, tensor=4))
    cpu, gpu = accounting.predict(setup, "cpu")["comm"], accounting.predict(setup, "gpu")["comm"]
    assert ("reduce-scatter", "data") in gpu and ("reduce-scatter", "data") not in cpu
    # Megatron with sequence parallelism: reduce-scatters and all-gathers of equal volume
    # per block (2 forward + 2 backward each), in bf16.
    act = 4 * 16 * 32 * 2
    L = cfg.model.num_layers
    assert gpu[("reduce-scatter", "tensor")] == 4 * L * act + act
    assert gpu[("all-gather", "tensor")] == 4 * L * act + 2 * act


def test_plan_command_prints_predictions(capsys):
    from gendist.cli.main import main
    assert main(["plan", "--preset", "tiny", "--mesh.data", "2", "--mesh.tensor", "4",
                 "--mesh.sequence-parallel", "--train.zero-stage", "3",
                 "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "optimizer state" in out and "all-gather over data" in out


def test_collectives_benchmark_times_the_op_it_names():
    """experiments/collectives_bandwidth.py: each timed function computes its collective
    (checked against numpy on 8 devices), and bus bandwidth uses the ring model's bytes."""

    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from gendist.parallel.compat import shard_map

    mod = experiment("collectives_bandwidth")
    n = 8
    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    x = np.arange(n * n * 2, dtype=np.float32)
    blocks = x.reshape(n, -1)  # device i holds blocks[i]
    xs = jax.device_put(x, NamedSharding(mesh, P("d")))
    expect = {
        "all-reduce": np.tile(blocks.sum(0), n),
        "all-gather": np.tile(x, n),
        "reduce-scatter": blocks.sum(0),
        "all-to-all": blocks.reshape(n, n, -1).transpose(1, 0, 2).ravel(),
        "permute": np.roll(blocks, 1, axis=0).ravel(),
    }
    for name, (op, kind) in mod.collectives(n).items():
        fn = jax.jit(shard_map(op, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check=False))
        np.testing.assert_allclose(np.asarray(fn(xs)), expect[name], err_msg=name)
        assert kind == ("collective-permute" if name == "permute" else name)
    assert collectives.wire_bytes("all-reduce", 800, n) == 2 * 800 * (n - 1) / n
    assert collectives.wire_bytes("collective-permute", 800, n) == 800
