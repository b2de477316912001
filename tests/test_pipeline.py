"""Pipeline parallelism: the schedule, the storage order, and equivalence with the
unpipelined model (loss and gradients) for S in {1, 2, 4}, r in {1, 2}, with tensor
and FSDP layouts and remat; FSDP weights gathered and gradients reduced once per step.

The programs the tests build are only read (their HLO) or run once on a tiny model, so they
compile with the planner's analysis options (compile_options.ANALYSIS_OPTIONS: the same HLO,
LLVM's optimisations and XLA:CPU's fusion emitters off, 3x faster to compile)."""

import itertools

import jax
import numpy as np
import pytest

from meshtrain.parallel.pipeline import scan as pipeline
from meshtrain.parallel.pipeline.scan import Pipeline
from meshtrain.planner import hlo, hlo_flops
from meshtrain.run.compile_options import analysis_options
from meshtrain.run.experiment import Experiment
from meshtrain.step import train_step as step_lib

from support.training import loss_and_grads


def items(pipe):
    """{(stage, tick): (microbatch, repeat)} for every non-bubble cell of the schedule."""
    out = {}
    for t in range(pipe.ticks):
        valid, i, m = pipeline.schedule(pipe, t, np)
        for s in range(pipe.stages):
            if valid[s]:
                out[s, t] = (int(m[s]), int(i[s]))
    return out


@pytest.mark.parametrize("s, r, m", [(1, 1, 3), (2, 1, 5), (4, 1, 4), (4, 1, 8), (2, 2, 4),
                                     (4, 2, 8), (4, 3, 4)])
def test_schedule_runs_every_item_once_in_dependency_order(s, r, m):
    pipe = Pipeline(stages=s, microbatches=m, repeats=r)
    cells = items(pipe)
    when = {(stage, mb, rep): t for (stage, t), (mb, rep) in cells.items()}
    # Every stage runs every (microbatch, repeat) exactly once; the rest are bubbles.
    assert len(cells) == len(when) == s * r * m
    assert pipe.ticks * s - len(cells) == s * (s - 1)
    for stage, mb, rep in when:
        t = when[stage, mb, rep]
        if stage > 0:  # the input is the previous stage's output of the tick before
            assert when[stage - 1, mb, rep] == t - 1
        elif rep > 0:  # wrapped round from the last stage, previous repeat
            assert when[s - 1, mb, rep - 1] == t - 1
    # The outputs are read where the last stage finishes the last repeat.
    assert [when[s - 1, mb, r - 1] for mb in range(m)] == list(pipeline.output_ticks(pipe))
    assert pipe.bubble == pytest.approx((s - 1) / (r * m + s - 1))


def test_schedule_table_gpipe():
    table = pipeline.schedule_table(Pipeline(stages=2, microbatches=3)).splitlines()
    assert [row.split("|")[1].split() for row in table[1:]] == [
        ["0", "."], ["1", "0"], ["2", "1"], [".", "2"]]


def test_storage_order_round_trips_and_places_circular_chunks():
    pipe = Pipeline(stages=2, microbatches=2, repeats=2)
    layers = np.arange(8 * 3).reshape(8, 3)  # 8 layers, row l = layer l
    staged = pipeline.to_stages(layers, pipe)
    assert staged.shape == (2, 4, 3)
    # Stage 0 holds chunks 0 and 2 (layers 0-1 and 4-5), stage 1 chunks 1 and 3.
    assert staged[:, :, 0].tolist() == [[0, 3, 12, 15], [6, 9, 18, 21]]
    np.testing.assert_array_equal(pipeline.from_stages(staged, pipe), layers)


CASES = {  # name: (mesh, layout, layers, overrides)
    "S1_dp": ("data:8", "dp_pp", 2, {"pipeline.microbatches": 2}),
    "S2_dp_tp": ("data:2,stage:2,tensor:2", "dp_pp_tp", 2, {"pipeline.microbatches": 4}),
    "S2_r2_fsdp": ("stage:2,fsdp:4", "fsdp_pp", 4,
                   {"pipeline.microbatches": 4, "pipeline.schedule": "circular", "pipeline.repeats": 2}),
    "S4_dp": ("data:2,stage:4", "dp_pp", 4, {"pipeline.microbatches": 8}),
    "S4_r2_tp": ("stage:4,tensor:2", "dp_pp_tp", 8,
                 {"pipeline.microbatches": 4, "pipeline.schedule": "circular", "pipeline.repeats": 2}),
    "S2_fsdp_tp_remat": ("stage:2,fsdp:2,tensor:2", "fsdp_pp_tp", 4,
                         {"pipeline.microbatches": 4, "model.remat": "full"}),
    "S2_unrolled_layers": ("data:4,stage:2", "dp_pp", 4,
                           {"pipeline.microbatches": 2, "model.scan_layers": "false"}),
}


@pytest.fixture(scope="module")
def references():
    """The unpipelined model on one device, per layer count."""
    from meshtrain import config as config_lib
    out = {}
    for layers in sorted({c[2] for c in CASES.values()}):
        cfg = config_lib.load("gpt2_tiny_dp8")
        config_lib.override(cfg, "model.num_layers", str(layers))
        out[layers] = loss_and_grads(cfg, devices=jax.devices()[:1], mesh_shape="data:1")
    return out


@pytest.mark.parametrize("case", CASES)
def test_pipelined_loss_and_grads_match_unpipelined(case, make_config, references):
    mesh, layout, layers, overrides = CASES[case]
    cfg = make_config("gpt2_tiny_dp8", **{"mesh.shape": mesh, "layout": layout,
                                          "model.num_layers": layers, **overrides})
    loss, grads = loss_and_grads(cfg)
    ref_loss, ref_grads = references[layers]
    assert abs(loss - ref_loss) / ref_loss < 1e-5, (loss, ref_loss)
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6), grads, ref_grads)


def collectives_for(make_config, microbatches, **overrides):
    """(collectives by kind, {(kind, mesh axes): count}) of the compiled train step."""
    exp = Experiment.build(make_config("gpt2_tiny_dp8", **{"pipeline.microbatches": microbatches, **overrides}))
    compiled = exp.compile(analysis=True)
    return hlo.collectives(compiled), {(r["kind"], r["mesh_axes"]): r["count"]
                                       for r in hlo.collective_table(compiled, exp.mesh)}


def test_weights_gathered_and_grads_reduced_once_per_step(make_config):
    """Gathers and reductions do not grow with the number of microbatches (ticks);
    only the stage-to-stage collective-permutes do: one per tick forward, two back. On
    data:2 x stage:2 x fsdp:2 one step holds what dp_pp and fsdp_pp each do: FSDP's weights
    gathered, and the gradients reduced over data and over fsdp."""
    (small, by_axes), (large, _) = (collectives_for(make_config, m, **{
        "mesh.shape": "data:2,stage:2,fsdp:2", "layout": "fsdp_pp", "model.num_layers": 4}) for m in (2, 4))
    for kind in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all"):
        assert (small[kind].count, small[kind].bytes) == (large[kind].count, large[kind].bytes), kind
    assert small["all-gather"].count > 0
    reduced = {axis for (kind, axes), n in by_axes.items() if kind in ("all-reduce", "reduce-scatter") and n
               for axis in axes}
    assert {"data", "fsdp"} <= reduced, by_axes
    assert large["collective-permute"].count - small["collective-permute"].count == 3 * (4 - 2)


def test_stage_params_live_on_their_stage(make_config):
    exp = Experiment.build(make_config("gpt2_tiny_pp4_dp2"))
    w = exp.init_state().params["blocks"]["mlp"]["w_fc"]
    assert w.shape == (4, 1, 64, 256)
    assert exp.shardings.params["blocks"]["mlp"]["w_fc"].spec[0] == "stage"
    for shard in w.addressable_shards:
        assert shard.data.shape == (1, 1, 64, 256)


@pytest.mark.parametrize("name, tables", [("gpt2_tiny_pp4_dp2", {"wte": 0, "wpe": 0}),
                                          ("llama_tiny_pp2_dp4", {"embed": 0, "lm_head": 1})])
def test_embedding_tables_and_their_moments_are_split_over_stage(make_config, name, tables):
    """The tables used outside the pipeline hold 1/S of their rows (vocab, or positions)
    on each device, and so do their Adam moments: no stage keeps a whole copy."""
    exp = Experiment.build(make_config(name))
    state = exp.init_state()
    stages = exp.mesh.shape["stage"]
    mu = state.opt_state[1][0].mu
    for table, dim in tables.items():
        for arr in (state.params[table], mu[table]):
            assert arr.sharding.spec[dim] == "stage"
            for shard in arr.addressable_shards:
                assert shard.data.shape[dim] == arr.shape[dim] // stages


def test_every_combination_of_schedule_constants_is_consistent():
    for s, r, m in itertools.product((1, 2, 4), (1, 2), (4, 8, 16, 32)):
        pipe = Pipeline(stages=s, microbatches=m, repeats=r)
        assert pipe.ticks == r * m + s - 1
        assert max(pipeline.output_ticks(pipe)) == pipe.ticks - 1


def test_hlo_collectives_count_loop_iterations():
    """A psum inside a 5-step scan runs 5 times per call; one outside runs once."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from meshtrain import mesh as mesh_lib
    mesh = mesh_lib.make_mesh({"data": 8, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1})

    def f(x):  # x [8, 4] sharded over data: each sum over rows is an all-reduce
        def body(c, _):
            return c + jax.numpy.sum(x * c, axis=0), None
        c, _ = jax.lax.scan(body, jax.numpy.ones(4), None, length=5)
        return c + x.sum(0)
    x = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("data")))
    stats = hlo.collectives(jax.jit(f).lower(x).compile())
    assert stats["all-reduce"].count == 6
    assert stats["all-reduce"].bytes == 6 * 4 * 4
    assert stats["all-reduce"].wire == pytest.approx(6 * 2 * 7 / 8 * 16)


def test_dropout_inside_the_pipeline_is_deterministic_per_key(make_config):
    exp = Experiment.build(make_config("gpt2_tiny_pp2_dp4", **{"model.dropout": 0.2}))
    params = exp.init_state().params
    batch = exp.put_batch(next(exp.train_batches()))
    objective = step_lib.make_objective(exp.model, exp.layout, exp.mesh)
    loss_fn = jax.jit(lambda p, b, k: objective(p, {}, b, k)[0], compiler_options=analysis_options())
    k1, k2 = jax.random.key(1), jax.random.key(2)
    losses = [float(loss_fn(params, batch, k)) for k in (k1, k1, k2, None)]
    assert np.isfinite(losses).all()
    assert losses[0] == losses[1]           # same key, same masks
    assert len(set(losses[1:])) == 3        # another key, or none, changes the loss


def test_wasted_matmul_flops_equal_the_bubble_formula(make_config):
    """The SPMD bubble is wasted work: the matmul FLOPs all stages execute exceed the
    useful ones (the one-stage program) by exactly (S-1)/(r*M+S-1) of the layer work."""
    def matmuls(mesh, layout, layers, m=0, r=1, devices=1):
        cfg = make_config("gpt2_tiny_dp8", **{
            "mesh.shape": mesh, "layout": layout, "model.num_layers": layers,
            "pipeline.microbatches": m, "pipeline.repeats": r,
            "pipeline.schedule": "circular" if r > 1 else "gpipe"})
        exp = Experiment.build(cfg, devices=jax.devices()[:devices])
        return hlo_flops.dot_flops(exp.compile(analysis=True)) * devices
    full, half = matmuls("data:1", "dp", 4), matmuls("data:1", "dp", 2)
    head = full - 2 * (full - half)
    useful = matmuls("data:1", "dp_pp", 4, m=2, r=2)
    executed = matmuls("stage:2", "dp_pp", 4, m=2, r=2, devices=2)
    assert useful == full  # microbatching adds no matmul work
    assert (executed - useful) / (executed - head) == pytest.approx(Pipeline(2, 2, 2).bubble, rel=1e-6)
