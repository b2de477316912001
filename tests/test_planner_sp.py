"""Sequence parallelism read off the compiled step (tests/support/sequence_parallel.py) against
Megatron's formula, its activation saving against the planner's, and the linter's and the
search's handling of the context axis. Each config is compiled once per module."""

import jax
import pytest

from support.configs import configured
from meshtrain import config as config_lib, mesh as mesh_lib
from meshtrain.planner import analytic, lint, search
from support import sequence_parallel as sp
from meshtrain.run.experiment import Experiment
from support.training import compiled_as_users_compile

MODELS = ("gpt2_tiny_dp2_tp4", "llama_tiny_dp2_tp4")  # data:2, tensor:4
LAYOUTS = ("dp_tp", "dp_tp_sp")


@pytest.fixture(scope="module")
def compiled():
    """{(config, layout): (exp, compiled, one [b, T, D] stream's bytes on a device)}."""
    out = {}
    for name in MODELS:
        for layout in LAYOUTS:
            exp = Experiment.build(configured(name, layout=layout))
            m = exp.model.cfg
            stream = exp.cfg.train.batch_size // exp.mesh.shape["data"] * m.seq_len * m.embed_dim * 4
            # as `meshtrain plan` compiles: the same HLO and buffers, faster
            out[name, layout] = exp, exp.compile(analysis=True), stream
    return out


def exp_dims(compiled, name, layout):
    """Bytes of one [b, T, K, E] k (or v) on a device, float32."""
    exp = compiled[name, layout][0]
    m = exp.model.cfg
    return exp.cfg.train.batch_size // exp.mesh.shape["data"] * m.seq_len * m.num_kv_heads * m.head_dim * 4


def exp_kv_heads(compiled, name):
    return compiled[name, "dp_tp"][0].model.cfg.num_kv_heads


def layer_ops(compiled, name, layout):
    exp, c, stream = compiled[name, layout]
    return sp.layer_collectives(c, exp.mesh, exp.model.cfg.num_layers, stream), stream


@pytest.mark.parametrize("name", MODELS)
def test_tensor_parallel_layer_is_megatrons(compiled, name):
    """dp_tp: 2 all-reduces of the [b, T, D] stream per layer each way (attention's and the
    MLP's row-parallel outputs forward, their column-parallel inputs backward). Llama's k
    and v add 2 smaller all-reduces backward (other collectives, not the stream's): dk and
    dv of one kv head [b, T, 1, E], among the 2 ranks whose query heads read it."""
    ops, stream = layer_ops(compiled, name, "dp_tp")
    formula = sp.megatron(stream, 4, sp=False)
    for p in sp.PASSES:
        assert ops[p, "all-reduce"] == formula[p, "all-reduce"]
    if name.startswith("llama"):
        kv = exp_dims(compiled, name, "dp_tp")
        assert ops["backward", "other all-reduce"].count == 2
        assert ops["backward", "other all-reduce"].bytes == 2 * kv / exp_kv_heads(compiled, name)
    assert not any(k in ops for k in [("forward", "reduce-scatter"), ("forward", "all-gather")])


@pytest.mark.parametrize("name", MODELS)
def test_sequence_parallel_turns_each_all_reduce_into_a_reduce_scatter(compiled, name):
    """dp_tp_sp: each of the layer's tensor all-reduces over all 4 ranks is a reduce-scatter
    of the same [b, T, D] (half the wire bytes: the other half is the all-gather that
    follows), forward and backward; the ones over part of the ranks (Llama's kv heads)
    stay all-reduces. Each way, 2 all-gathers of the stream: the forward's at attention's
    and the MLP's inputs, the backward's the transposes of the forward's reduce-scatters."""
    tp, stream = layer_ops(compiled, name, "dp_tp")
    ops, _ = layer_ops(compiled, name, "dp_tp_sp")
    formula = sp.megatron(stream, 4, sp=True)
    assert ops["forward", "reduce-scatter"] == formula["forward", "reduce-scatter"]
    assert ops["backward", "reduce-scatter"] == formula["backward", "reduce-scatter"]
    assert ("forward", "all-reduce") not in ops
    for p in sp.PASSES:
        kept = ops.get((p, "all-reduce"), sp.LayerOps())
        assert ops[p, "reduce-scatter"].count + kept.count == tp[p, "all-reduce"].count
        assert ops[p, "reduce-scatter"].bytes + kept.bytes == tp[p, "all-reduce"].bytes
        if not kept.count:  # a ring all-reduce sends 2 (n-1)/n S, a reduce-scatter (n-1)/n S
            assert ops[p, "reduce-scatter"].wire == tp[p, "all-reduce"].wire / 2
    # Megatron's g (parallel/sequence.sequence_gather): one gather per region each way. Llama's
    # backward gathers the stream once more: its k and v are whole on every rank (pinned as
    # attention sees them), and the partial input gradients of q meet their replicated
    # input gradient there (measured; docs/planner.md).
    assert ops["forward", "all-gather"] == formula["forward", "all-gather"]
    extra = 1 if name.startswith("llama") else 0
    gathered = formula["backward", "all-gather"]
    assert ops["backward", "all-gather"] == sp.LayerOps(gathered.count + extra, gathered.bytes * (2 + extra) / 2,
                                                        gathered.wire * (2 + extra) / 2)


def test_reduce_scatter_found_in_a_fused_slice():
    """The CPU compiler's all-reduce whose consumer slices its 1/n inside a fusion is a
    reduce-scatter; one read whole is not."""
    text = """HloModule m, num_partitions=4

%fused (param_0: f32[8,4], param_1: s32[]) -> f32[2,4] {
  %param_0 = f32[8,4]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %ds = f32[2,4]{1,0} dynamic-slice(%param_0, %param_1, %c), dynamic_slice_sizes={2,4}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[8,4], i: s32[]) -> (f32[2,4], f32[8,4]) {
  %p = f32[8,4]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %ar = f32[8,4]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  %f = f32[2,4]{1,0} fusion(%ar, %i), kind=kLoop, calls=%fused
  %ar2 = f32[8,4]{1,0} all-reduce(%p), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %t = (f32[2,4]{1,0}, f32[8,4]{1,0}) tuple(%f, %ar2)
}
"""
    mesh = mesh_lib.make_mesh(mesh_lib.parse_shape("tensor:4"), jax.devices()[:4])
    ops = sp.layer_collectives(text, mesh, 1, 8 * 4 * 4)
    assert ops["forward", "reduce-scatter"] == sp.LayerOps(1, 128, 3 / 4 * 128)
    assert ops["forward", "all-reduce"] == sp.LayerOps(1, 128, 2 * 3 / 4 * 128)


# GPT-2 small's width and length, 2 layers, 2 rows per device: big enough that XLA's buffer
# reuse no longer moves the saving by a third, as it does at the tiny size.
WIDE = {"model.size": "small", "model.num_layers": 2, "train.batch_size": 4, "train.loss_chunk": 256}


def test_activation_saving_against_the_formula():
    """The compiled step's temporary memory under dp_tp less under dp_tp_sp against the
    formula's saving: the residual-stream share (2 D a token a layer, the 2 norm inputs)
    kept at 1/4; attention's and the MLP's inputs are gathered whole (Megatron's g,
    parallel/sequence.sequence_gather) and kept so. Compile only."""
    saved = {}
    for layout in LAYOUTS:
        exp = Experiment.build(configured("gpt2_tiny_dp2_tp4", layout=layout, **WIDE))
        saved[layout] = (compiled_as_users_compile(exp).memory_analysis().temp_size_in_bytes, analytic.memory(exp)["activations"])
        assert analytic.sequence_parallel(exp) == (4 if layout == "dp_tp_sp" else 1)
    m = exp.model.cfg
    formula = saved["dp_tp"][1] - saved["dp_tp_sp"][1]
    assert formula == m.num_layers * 2 * m.seq_len * 2 * m.embed_dim * 4 * (1 - 1 / 4)
    ratio = (saved["dp_tp"][0] - saved["dp_tp_sp"][0]) / formula
    print(f"compiled saving {(saved['dp_tp'][0] - saved['dp_tp_sp'][0]) / 2**20:.1f} MiB, "
          f"formula {formula / 2**20:.1f} MiB, ratio {ratio:.3f}")
    assert 0.8 <= ratio <= 1.25, ratio


def test_sequence_indivisible():
    """dp_cp on context:4 cuts a sequence into 8 chunks: 8 does not divide 100."""
    cfg = configured("llama_tiny_dp8", **{"mesh.shape": "data:2,context:4", "layout": "dp_cp", "model.seq_len": 100})
    (f,) = [f for f in lint.lint(cfg) if f.code == "sequence-indivisible"]
    assert f.severity == "error" and "2 x 4 = 8 equal chunks" in f.what and "model.seq_len=100" in f.what
    assert lint.fix_overrides(f.fix) == [("model.seq_len", "104")]
    config_lib.override(cfg, "model.seq_len", "104")
    assert not [f for f in lint.lint(cfg) if f.code == "sequence-indivisible"]
    sp_cfg = configured("llama_tiny_dp8", **{"mesh.shape": "data:2,tensor:4", "layout": "dp_tp_sp", "model.seq_len": 100})
    assert not [f for f in lint.lint(sp_cfg) if f.code == "sequence-indivisible"]  # attention sees whole sequences


def test_context_on_dcn():
    """context:4 over 2 nodes of a 16-device data:4,context:4 mesh: k and v of every layer
    cross the NICs, of the K = 2 kv heads alone (not the 4 query heads): forward and backward
    x 2 layers x k and v x (n-1)/n x [16 rows, 128, 2 x 16] float32 a device (planner/context.py)."""
    cfg = configured("llama_tiny_dp8", **{"mesh.shape": "data:4,context:4", "layout": "dp_cp",
                                    "mesh.dcn": "context:2", "train.batch_size": 64})
    (f,) = [f for f in lint.lint(cfg) if f.code == "context-on-dcn"]
    wire = 2 * 2 * 2 * 3 / 4 * 16 * 128 * 2 * 16 * 4
    assert f"{wire / 2**20:,.1f} MiB" == "1.5 MiB"
    assert f.severity == "warning" and "across 2 nodes" in f.what and f"about {wire / 2**20:,.1f} MiB" in f.cost
    assert lint.fix_overrides(f.fix) == [("mesh.dcn", "data:2")]
    config_lib.override(cfg, "mesh.dcn", "data:2")
    assert not [f for f in lint.lint(cfg) if f.code == "context-on-dcn"]


def test_search_enumerates_context_only_for_long_sequences():
    short, _ = search.enumerate_candidates(8, 4, None, remats=("none",), seq_len=1024)
    long, _ = search.enumerate_candidates(8, 4, None, remats=("none",), seq_len=search.CONTEXT_MIN_SEQ)
    has_context = lambda cands: {c.layout for c in cands if dict(c.mesh)["context"] > 1}  # noqa: E731
    assert has_context(short) == set()
    assert has_context(long) == {"dp_cp", "fsdp_cp", "dp_tp_cp", "fsdp_tp_cp", "dp_pp_cp"}
    for cands in (short, long):  # the SP presets, always: they add no axis
        assert {"dp_tp_sp", "fsdp_tp_sp"} <= {c.layout for c in cands}
    assert len(long) > len(short) == len([c for c in long if dict(c.mesh)["context"] == 1])
