"""Op-kind split of a compiled step: HLO classification and profile aggregation."""

import jax
import jax.numpy as jnp
import pytest

from gendist import profiling

FAKE_GPU_HLO = """
%fused_dot (p0: bf16[64,64], p1: bf16[64,64]) -> bf16[64,64] {
  %p0 = bf16[64,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_norm (p0: f32[64,64]) -> f32[64] {
  %p0 = f32[64,64]{1,0} parameter(0)
  %c = f32[] constant(0)
  ROOT %r = f32[64]{0} reduce(%p0, %c), dimensions={1}, to_apply=%add_comp
}

%add_comp (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_cast (p0: f32[64,64]) -> bf16[64,64] {
  %p0 = f32[64,64]{1,0} parameter(0)
  %t = f32[64,64]{0,1} transpose(%p0), dimensions={1,0}
  ROOT %cv = bf16[64,64]{1,0} convert(%t)
}

ENTRY %main (x: f32[64,64], q: bf16[1,64,4,64]) -> f32[64] {
  %x = f32[64,64]{1,0} parameter(0)
  %q = bf16[1,64,4,64]{3,2,1,0} parameter(1)
  %cast = bf16[64,64]{1,0} fusion(%x), kind=kLoop, calls=%fused_cast
  %gemm = bf16[64,64]{1,0} fusion(%cast, %cast), kind=kCustom, calls=%fused_dot
  %fmha = (bf16[1,64,4,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(f)/matmul"}
  %cublas = (bf16[64,64]{1,0}, s8[0]{0}) custom-call(%cast, %cast), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(f)/attention"}
  %tanh = f32[64,64]{1,0} tanh(%x)
  %ar = f32[64,64]{1,0} all-reduce(%tanh), replica_groups={}, to_apply=%add_comp
  ROOT %norm = f32[64]{0} fusion(%ar), kind=kInput, calls=%fused_norm
}
"""


def test_classify_hlo_kinds_on_gpu_style_module():
    kinds = profiling.classify_hlo(FAKE_GPU_HLO)
    assert kinds == {"cast": "data movement", "gemm": "matmul", "fmha": "attention",
                     "cublas": "matmul", "tanh": "elementwise", "ar": "collective",
                     "norm": "normalisation"}


def test_time_by_kind_on_a_cpu_profile():
    @jax.jit
    def f(w_LDD, x_BD):
        def body(x, w):
            return jnp.tanh(x @ w), None
        return jax.lax.scan(body, x_BD, w_LDD)[0]

    args = (jnp.ones((3, 256, 256)), jnp.ones((64, 256)))
    kinds = profiling.classify_hlo(f.lower(*args).compile().as_text())
    assert "matmul" in kinds.values() and "control" in kinds.values()
    jax.block_until_ready(f(*args))
    with profiling.trace() as prof:  # jax 0.11 yields no session: the helper reads the file
        jax.block_until_ready(f(*args))
    split = profiling.time_by_kind(prof.profile_data, kinds)
    assert split["seconds"]["matmul"] > 0
    assert abs(sum(split["seconds"].values()) - split["total_s"]) < 1e-9
    assert all(op["kind"] != "control" for op in split["top_ops"])  # the loop is not counted


def test_trace_keeps_the_exported_trace_and_reads_it_back_without_a_session(tmp_path):
    f = jax.jit(lambda a: jnp.tanh(a @ a))
    a = jnp.ones((128, 128))
    kinds = profiling.classify_hlo(f.lower(a).compile().as_text())
    jax.block_until_ready(f(a))
    with profiling.trace(str(tmp_path)) as prof:
        jax.block_until_ready(f(a))
    assert list(tmp_path.rglob("*.xplane.pb"))  # kept for xprof when a directory is given
    assert profiling.time_by_kind(prof.profile_data, kinds)["seconds"]["matmul"] > 0
    data = profiling.load_profile(None, str(tmp_path))  # the jax 0.11 path, on any jax
    assert profiling.time_by_kind(data, kinds)["seconds"]["matmul"] > 0


def test_trace_without_a_directory_leaves_no_files(tmp_path, monkeypatch):
    monkeypatch.setattr(profiling.tempfile, "tempdir", str(tmp_path))
    with profiling.trace() as prof:
        jax.block_until_ready(jnp.ones(8) + 1)
    assert prof.profile_data is not None and prof.trace_dir is None
    assert list(tmp_path.iterdir()) == []


class _Event:
    def __init__(self, name, hlo, ns):
        self.name, self.duration_ns = name, ns
        self.stats = [("hlo_op", hlo)] if hlo else []


class _Line:
    def __init__(self, name, events):
        self.name, self.events = name, events


class _Plane:
    def __init__(self, name, lines):
        self.name, self.lines = name, lines


class _Profile:
    def __init__(self, planes):
        self.planes = planes


def test_kernels_inside_a_cuda_graph_are_classified_by_their_own_names():
    kinds = {"loop_multiply_fusion.3": "elementwise", "transpose_copy_fusion": "data movement",
             "gemm.1": "matmul", "command_buffer_1": "control"}
    events = [_Event("loop_multiply_fusion_3", "command_buffer_1", 3_000),
              _Event("transpose_copy_fusion", "command_buffer_1", 2_000),
              _Event("nvjet_hsh_128x256_2cta", "command_buffer_1", 10_000),
              _Event("cudnn_generated_fort_native_sdpa_sm90", "command_buffer_1", 5_000),
              _Event("input_reduce_fusion_7", "command_buffer_1", 1_000),
              _Event("gemm.1", "gemm.1", 4_000)]
    prof = _Profile([_Plane("/device:GPU:0", [_Line("Stream #13(compute)", events),
                                              _Line("XLA Ops", events)])])  # not counted twice
    split = profiling.time_by_kind(prof, kinds)
    s = {k: round(v * 1e6, 3) for k, v in split["seconds"].items()}
    assert s == {"matmul": 14.0, "attention": 5.0, "normalisation": 1.0, "elementwise": 3.0,
                 "data movement": 2.0, "collective": 0.0, "other": 0.0}


def test_ops_inside_a_call_are_classified_and_the_call_is_control():
    hlo = """
%called (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %inner_tanh = f32[8]{0} tanh(%p0)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %c = f32[8]{0} call(%x), to_apply=%called
}
"""
    assert profiling.classify_hlo(hlo) == {"inner_tanh": "elementwise", "c": "control"}


GEMV_HLO = """
%add_comp (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_gemv (p0: bf16[1,1024], p1: bf16[1024,4096]) -> bf16[1,4096] {
  %p0 = bf16[1,1024]{1,0} parameter(0)
  %p1 = bf16[1024,4096]{1,0} parameter(1)
  %b0 = bf16[1,1024,4096]{2,1,0} broadcast(%p0), dimensions={0,1}
  %b1 = bf16[1,1024,4096]{2,1,0} broadcast(%p1), dimensions={1,2}
  %m = bf16[1,1024,4096]{2,1,0} multiply(%b0, %b1)
  %f = f32[1,1024,4096]{2,1,0} convert(%m)
  %c = f32[] constant(0)
  %r = f32[1,4096]{1,0} reduce(%f, %c), dimensions={1}, to_apply=%add_comp
  ROOT %o = bf16[1,4096]{1,0} convert(%r)
}

%fused_rms (p0: bf16[1,1024]) -> f32[1] {
  %p0 = bf16[1,1024]{1,0} parameter(0)
  %x = f32[1,1024]{1,0} convert(%p0)
  %sq = f32[1,1024]{1,0} multiply(%x, %x)
  %c = f32[] constant(0)
  ROOT %r = f32[1]{0} reduce(%sq, %c), dimensions={1}, to_apply=%add_comp
}

%fused_max (p0: f32[1,1024], p1: f32[1024,8]) -> f32[1,8] {
  %p0 = f32[1,1024]{1,0} parameter(0)
  %p1 = f32[1024,8]{1,0} parameter(1)
  %b0 = f32[1,1024,8]{2,1,0} broadcast(%p0), dimensions={0,1}
  %b1 = f32[1,1024,8]{2,1,0} broadcast(%p1), dimensions={1,2}
  %m = f32[1,1024,8]{2,1,0} multiply(%b0, %b1)
  %c = f32[] constant(-inf)
  ROOT %r = f32[1,8]{1,0} reduce(%m, %c), dimensions={1}, to_apply=%max_comp
}

%max_comp (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] maximum(%a, %b)
}

ENTRY %main (x: bf16[1,1024], w: bf16[1024,4096], v: f32[1024,8]) -> bf16[1,4096] {
  %x = bf16[1,1024]{1,0} parameter(0)
  %w = bf16[1024,4096]{1,0} parameter(1)
  %v = f32[1024,8]{1,0} parameter(2)
  %norm = f32[1]{0} fusion(%x), kind=kInput, calls=%fused_rms
  %xf = f32[1,1024]{1,0} convert(%x)
  %mx = f32[1,8]{1,0} fusion(%xf, %v), kind=kInput, calls=%fused_max
  ROOT %gemv = bf16[1,4096]{1,0} fusion(%x, %w), kind=kInput, calls=%fused_gemv
}
"""


def test_one_row_dot_written_as_reduce_of_product_is_a_matmul():
    """A decode step's matmuls reach the GPU as reduce(multiply(x, W)) fusions; a norm's
    sum of squares and a max-reduction of a product stay normalisation."""
    kinds = profiling.classify_hlo(GEMV_HLO)
    assert kinds["gemv"] == "matmul"
    assert kinds["norm"] == "normalisation"
    assert kinds["mx"] == "normalisation"


def test_a_decode_steps_timeline_is_its_kernels_in_order():
    """decode_step_timeline: events cut at each anchor kernel into steps; the median step
    lists each kernel with its time and the gap before it, the period, the idle time (gaps
    plus the tail before the next anchor), and leaves out a step whose kernels differ."""
    from helpers import experiment  # noqa: PLC0415

    t = experiment("decode_step_timeline")
    ev, s = [], 0
    for i in range(20):  # ns: the anchor 700, a gap of 2, a memset of 1, a gap of 2, 5, a tail of 10
        ev += [("decode_chain_kernel", s, s + 700), ("memset", s + 702, s + 703), ("fusion", s + 705, s + 710)]
        if i == 10:
            ev.append(("extra", s + 711, s + 712))
        s += 720
    its = t.iterations(ev, "decode_chain")
    assert len(its) == 19 and [e[0] for e in its[0]] == ["decode_chain_kernel", "memset", "fusion"]
    r = t.timeline(its)
    assert (r["iterations"], r["other_sequences"], r["kernels"]) == (9, 1, 3)  # steps 4 .. 13, one with an extra kernel
    assert r["period_us"] == pytest.approx(0.72) and r["anchor_us"] == pytest.approx(0.7)
    assert r["other_kernels_us"] == pytest.approx(0.006) and r["idle_us"] == pytest.approx(0.014)
    assert [x["gap_before_us"] for x in r["rows"]] == pytest.approx([0, 0.002, 0.002])
