"""Context parallelism in the planner (planner/context.py): the ring's collective-permutes
and the all-gather's gathers and reduce-scatters against their formulas, the load-balanced
ring's equal matmul work from the HLO, the activation formula's split, and the long-
sequence Llama config. Llama tiny at 512 positions, each config compiled once."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain import config as config_lib
from meshtrain.models import family
from meshtrain.planner import analytic, context, hardware, hlo, hlo_flops, report as report_lib
from meshtrain.run.experiment import Experiment
from support.configs import configured

H100 = hardware.get("h100")
RUNS = {  # name: (mesh, layout, context_attention, remat)
    "ring": ("data:2,context:4", "dp_cp", "ring", "none"),
    "ring_tp_full": ("context:4,tensor:2", "dp_tp_cp", "ring", "full"),
    "allgather": ("data:2,context:4", "dp_cp", "allgather", "none"),
    # kv heads split as the query heads are (as llama3_8b's layouts do): 1 of 2 travels a device
    "ring_kv_split": ("context:4,tensor:2", "batch:data;heads:tensor;kv_heads:tensor;mlp:tensor;vocab:tensor;length:context",
                      "ring", "none"),
    # the ring's rows per device with sequences whole (context left unused: each row repeated there)
    "whole": ("data:2,context:4", "dp", "allgather", "none"),
}


def _config(mesh, layout, kind, remat):
    return configured("llama_tiny_dp8", **{"mesh.shape": mesh, "layout": layout, "model.context_attention": kind,
                                            "model.remat": remat, "model.seq_len": 512, "train.batch_size": 8})


@pytest.fixture(scope="module")
def planned():
    out = {}
    for name, run in RUNS.items():
        exp = Experiment.build(_config(*run))
        compiled = exp.compile(analysis=True)  # as `meshtrain plan` compiles: same HLO and buffers, faster
        out[name] = (exp, compiled, report_lib.plan(exp, H100, compiled, 0.0))
    return out


@pytest.mark.parametrize("name", ["ring", "ring_tp_full", "allgather", "ring_kv_split"])
def test_compiled_context_traffic_equals_the_formula(name, planned):
    """Every byte and op the compiled step sends over `context` for attention is the
    formula's: per layer 2 (n-1) blocks forward, again under remat, and back (ring), or
    2 gathers and 2 reduce-scatters of (n-1) blocks (allgather) and the positions once."""
    exp, _, r = planned[name]
    c = r["context"]
    assert c["split"] == 4 and c["mesh_axes"] == ["context"]
    assert c["compiled_count"] == c["count"]
    assert c["compiled_bytes"] == pytest.approx(c["bytes"], rel=1e-9)
    cfg = exp.model.cfg
    kv_heads = cfg.num_kv_heads // exp.layout.shards("kv_heads", exp.mesh.shape)[0]  # only they travel
    rows = 8 // exp.layout.shards("batch", exp.mesh.shape)[0]
    block = rows * 512 // 4 * kv_heads * cfg.head_dim * 4
    passes = 3 if cfg.remat == "full" else 2
    assert ("positions" in c["terms"]) == (c["kind"] == "allgather")  # the ring sends none
    assert c["bytes"] - c["terms"].get("positions", 0.0) == passes * cfg.num_layers * 2 * 3 * block
    if c["kind"] == "ring":
        assert c["count"] == passes * cfg.num_layers * 2 * 3


def test_the_recompute_is_named_and_the_bound_met(planned):
    """The bound counts forward and backward; remat's second forward is known excess. The
    bound is met over all axes together: the gradient reduction the bound splits into a
    context part and a data part, XLA may run as one all-reduce over both (the chunked
    loss's copies of w, meshtrain/step/loss.py), which sends the same bytes on a row of its own."""
    for name in ("ring", "ring_tp_full"):
        r = planned[name][2]
        rows = r["collectives_by_axes"]
        assert sum(x["bytes"] for x in rows) >= sum(x["lower_bound_bytes"] for x in rows)
        [row] = [x for x in rows if x["mesh_axes"] == ["context"]]
        recompute = r["context"]["terms"]["recompute"]
        assert (recompute > 0) == (name == "ring_tp_full")
        assert any("recomputes attention" in e for e in row["excess"]) == (recompute > 0)


@pytest.mark.parametrize("name, ratio", [("ring", 5 / 4), ("ring_tp_full", 5 / 4), ("allgather", 2.0)])
def test_ring_branches_do_equal_work_and_attention_flops_vs_ideal(name, ratio, planned):
    """Each ring step's conditional has two branches of equal matmul FLOPs, so every
    device runs the same; attention's matmuls per device are (n+1)/n of the causal
    triangle split n ways for the ring, 2x for the all-gather (its masked half)."""
    _, compiled, r = planned[name]
    c = r["context"]
    assert c["branches_equal"]
    if c["kind"] == "ring":  # n-1 steps in each pass (forward, remat's forward, backward) of the layer scan
        assert len(c["branch_flops"]) == 3 * (3 if name == "ring_tp_full" else 2)
    assert c["compiled_attention_flops"] == pytest.approx(c["attention_flops"], rel=1e-9)
    assert c["attention_flops_ratio"] == pytest.approx(ratio, rel=1e-9)


def test_dot_flops_count_a_conditionals_costliest_branch_once():
    """lax.cond runs one branch: a 2x bigger matmul in one branch is what counts."""
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)

    def f(p, a):
        return jax.lax.cond(p, lambda a: (a @ a) @ a, lambda a: a @ a, a)
    compiled = jax.jit(f).lower(jax.ShapeDtypeStruct((), jnp.bool_), x).compile()
    one = 2 * 64**3
    [cond] = hlo_flops.conditionals(compiled)
    assert sorted(cond["branch_flops"]) == [one, 2 * one]
    assert hlo_flops.dot_flops(compiled) == 2 * one


def test_batched_dots_are_attentions(planned):
    """dot_flops(batched=True) keeps the dots with batch dims: under the whole-sequence
    layout, XLA attention's QK and PV over the T x T square, 3 x 2 x 2 b H E T^2 a layer."""
    exp, compiled, _ = planned["whole"]
    c = exp.model.cfg
    assert hlo_flops.dot_flops(compiled, batched=True) == 3 * 2 * 2 * 4 * c.num_heads * c.head_dim * 512**2 * c.num_layers


def test_a_16_bit_sum_sent_on_counts_at_16_bits():
    """The ring's backward sends dk, a sum of bf16 pieces: the CPU compiler adds them in
    float32, rounds, and widens the result for the send; an accelerator sends bf16."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    args = [jax.ShapeDtypeStruct((4, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))] * 2
    shift = [(i, (i + 1) % 4) for i in range(4)]
    f = jax.jit(jax.shard_map(lambda a, b: jax.lax.ppermute(a + b, "data", shift), mesh=mesh,
                              in_specs=(P("data"),) * 2, out_specs=P("data"), check_vma=False))
    [row] = hlo.collective_table(f.lower(*args).compile(), mesh)
    assert (row["kind"], row["result_bytes"]) == ("collective-permute", 1024 * 2)


def test_activation_formula_splits_with_the_context(planned):
    """Per device, the layer formula at T/n tokens with the other devices' k and v and the
    context attention's scores: the ring keeps (n+1)/(2n) of the all-gather's; n = 1 is
    the formula without a split. Compiled, the ring's activations are below the same rows
    with whole sequences, as the formula says."""
    cfg = planned["ring"][0].model.cfg
    scores, kv = family.context_elements("ring", 4, 16, 512, 4)
    assert (scores, kv) == (4 * 512 * 5 / 8, 2 * 3 * 4 * 16)
    assert family.context_elements("allgather", 4, 16, 512, 1) == (4 * 512, 0)
    per_layer = planned["ring"][0].model.family.layer_activation_bytes
    assert per_layer(cfg, 100, 1, "none", context=1) == per_layer(cfg, 100, 1, "none")
    gather_cfg = dataclasses.replace(cfg, context_attention="allgather")
    saved = per_layer(gather_cfg, 100, 2, "none", context=4) - per_layer(cfg, 100, 2, "none", context=4)
    assert saved == pytest.approx(100 * 4 * cfg.num_heads * 512 * (1 - 5 / 8) / 2)  # float32, heads over 2
    formula = {n: analytic.activations(planned[n][0]) for n in ("ring", "allgather", "whole")}
    compiled = {n: planned[n][2]["memory_per_device_bytes"]["activations"] for n in formula}
    assert formula["ring"] < formula["allgather"] < formula["whole"]
    assert compiled["ring"] < compiled["whole"] and compiled["allgather"] < compiled["whole"]


def test_the_long_sequence_llama_config_builds_abstractly():
    """llama3_8b_fsdp4_cp8_tp4_seq32k on an abstract mesh of 128 devices: 32,768 positions
    in 8 pieces of 4,096, the ring's traffic and its memory by formula, without compiling."""
    cfg = config_lib.load("llama3_8b_fsdp4_cp8_tp4_seq32k")
    exp = analytic.abstract_experiment(cfg)
    assert exp.model.cfg.seq_len == 32_768 and context.split(exp) == (8, ("context",))
    mem = analytic.memory(exp)
    assert mem["params"] == pytest.approx(exp.model.family.num_params(exp.model.cfg) * 4 / 16, rel=0.01)
    whole = analytic.abstract_experiment(cfg, shape="fsdp:4,tensor:4")
    assert analytic.activations(whole) > analytic.activations(exp)
