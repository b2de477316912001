"""1F1B and interleaved 1F1B: the tick tables, and the tick loop's losses and gradients
against the unpipelined model, across layouts, stash modes, keys and checkpoints.

Programs run once or only read compile with the planner's analysis options
(compile_options.ANALYSIS_OPTIONS, as test_pipeline's loss_and_grads does): the same HLO, 3x
faster to compile."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import jax
import numpy as np
import pytest

from support.configs import configured as config
from support.processes import losses
from support.training import ROWS, loss_and_grads
from meshtrain import config as config_lib
from meshtrain.parallel.pipeline import ticks
from meshtrain.parallel.pipeline.scan import Pipeline
from meshtrain.run.compile_options import analysis_options
from meshtrain.run.experiment import Experiment
from meshtrain.step import train_step as step_lib
from meshtrain.train import main

GOLDEN = Path(__file__).parent / "golden"
TABLES = {"ticks_1f1b.txt": Pipeline(4, 6, schedule="1f1b"),
          "ticks_interleaved.txt": Pipeline(4, 4, 2, schedule="interleaved"),
          "ticks_zb.txt": Pipeline(4, 6, schedule="zb"), "ticks_zb_v2.txt": Pipeline(2, 4, 2, schedule="zb")}


@pytest.mark.parametrize("name", TABLES)
def test_golden_tick_tables(name):
    table = ticks.tick_table(TABLES[name]) + "\n"
    if os.environ.get("UPDATE_GOLDEN"):
        (GOLDEN / name).write_text(table)
    assert table == (GOLDEN / name).read_text(), f"UPDATE_GOLDEN=1 pytest {__file__} rewrites it"


def slots(pipe):
    """{(stage, repeat, microbatch): (forward tick, backward tick)} read off the schedule."""
    out = {}
    for t in range(sum(ticks.phases(pipe))):
        for kind, (valid, i, m) in (("f", ticks.forward_items(pipe, t)), ("b", ticks.backward_items(pipe, t))):
            for s in np.flatnonzero(valid):
                out.setdefault((s, int(i[s]), int(m[s])), {})[kind] = t
    return out


CONSTANTS = [(s, m, v) for s, m, v in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16), (1, 2, 3))
             if v == 1 or m % s == 0]


@pytest.mark.parametrize("s, m, v", CONSTANTS)
def test_every_item_runs_once_each_way_after_what_it_needs(s, m, v):
    pipe = Pipeline(s, m, v, schedule="1f1b" if v == 1 else "interleaved")
    got = slots(pipe)
    assert set(got) == {(st, i, mb) for st in range(s) for i in range(v) for mb in range(m)}
    for (st, i, mb), t in got.items():
        # forward: from the previous stage one tick earlier, or round the ring from the last
        if (st, i) != (0, 0):
            prev = (st - 1, i, mb) if st else (s - 1, i - 1, mb)
            assert t["f"] == got[prev]["f"] + 1
        # backward: the last chunk starts on its forward tick (the head sits between the
        # slots); the rest take the gradient from the next stage one tick later
        if (st, i) == (s - 1, v - 1):
            assert t["b"] == t["f"]
        else:
            nxt = (st + 1, i, mb) if st < s - 1 else (0, i + 1, mb)
            assert t["b"] == got[nxt]["b"] + 1


@pytest.mark.parametrize("s, m, v", CONSTANTS)
def test_tick_tables_give_the_bubble_formula(s, m, v):
    """Counting a forward slot as F/v and a backward slot as 2F/v, a stage is idle
    (S-1)/(vM+S-1) of the step: GPipe's bubble divided by v for interleaved."""
    pipe = Pipeline(s, m, v, schedule="1f1b" if v == 1 else "interleaved")
    warm, steady, cool = ticks.phases(pipe)
    assert warm + steady + cool == v * m + v * s + s - 2
    busy = sum(1 + 2 for _ in slots(pipe)) / s            # per stage, in F/v units
    total = warm * 1 + steady * 3 + cool * 2
    assert 1 - busy / total == pytest.approx((s - 1) / (v * m + s - 1), abs=1e-12)


@pytest.mark.parametrize("s, m", [(s, m) for s, m in itertools.product((1, 2, 4, 8), (1, 4, 16, 32))])
def test_1f1b_keeps_2_s_minus_1_microbatches_on_stage_0_never_m(s, m):
    pipe = Pipeline(s, m, schedule="1f1b")
    want = [min(m, 2 * (s - 1 - st) + 1) for st in range(s)]
    assert ticks.in_flight(pipe).tolist() == want
    assert ticks.stash_slots(pipe) == want[0]


def test_interleaved_stash_slots_never_collide():
    """Items alive at once on a stage never share a slot (repeat i, m mod K)."""
    for s, m, v in [(2, 4, 2), (4, 8, 2), (4, 16, 3), (8, 16, 2)]:
        pipe = Pipeline(s, m, v, schedule="interleaved")
        k, got = ticks.stash_slots(pipe), slots(pipe)
        for t in range(sum(ticks.phases(pipe))):
            for st in range(s):
                alive = [(i, mb % k) for (x, i, mb), tt in got.items() if x == st and tt["f"] <= t <= tt["b"]]
                assert len(alive) == len(set(alive)), (s, m, v, t, st)


CASES = {  # name: (config, overrides, layers)
    # Each schedule, stash, split, layout and family in some case, not every combination.
    # gpt2_tiny_pp2_dp4 under 1f1b and zb is test_dropout_masks_are_gpipes' (GPipe's loss and
    # gradients, which test_pipeline matches to the unpipelined model's); S = 4 at one chunk
    # a stage is gpt2_pp4_dp2_zb_residuals' (zb's F and B slots are 1f1b's); tensor
    # parallelism and Llama at v = 2 are llama_dp2_pp2_tp2_zb_v2's.
    "gpt2_pp4_dp2_interleaved": ("gpt2_tiny_pp4_dp2_circular", {"pipeline.schedule": "interleaved"}, 8),
    "gpt2_dp2_pp2_tp2_residuals": ("gpt2_tiny_dp2_pp2_tp2", {"pipeline.stash": "residuals"}, 2),
    "gpt2_fsdp_in_stages": ("gpt2_tiny_pp2_dp4", {"mesh.shape": "stage:2,fsdp:4", "layout": "fsdp_pp",
                                                  "train.loss_chunk": 64}, 2),
    "llama_zero2_residuals": ("llama_tiny_pp2_dp4", {"layout": "zero2_pp", "pipeline.stash": "residuals"}, 2),
    # ZB-H1 (test_pipeline_zb.py): each layout, stash, split and family, ZeRO-2 and v = 2
    # among four cases
    "gpt2_pp4_dp2_zb_residuals": ("gpt2_tiny_pp4_dp2", {"pipeline.schedule": "zb", "pipeline.stash": "residuals"}, 4),
    "gpt2_dp2_pp2_tp2_zb_two_vjps": ("gpt2_tiny_dp2_pp2_tp2", {"pipeline.schedule": "zb", "pipeline.split": "two_vjps"},
                                     2),
    "llama_zero2_zb_two_vjps_residuals": ("llama_tiny_pp2_dp4", {
        "layout": "zero2_pp", "pipeline.schedule": "zb", "pipeline.split": "two_vjps", "pipeline.stash": "residuals"}, 2),
    # ring attention's custom VJP inside each layer's pullback: B and W split around it
    "llama_dp2_pp2_cp2_ring_zb": ("llama_tiny_pp2_dp4", {
        "mesh.shape": "data:2,stage:2,context:2", "layout": "dp_pp_cp", "model.context_attention": "ring",
        "pipeline.schedule": "zb"}, 2),
    "llama_dp2_pp2_tp2_zb_v2": ("llama_tiny_pp2_dp4", {
        "mesh.shape": "data:2,stage:2,tensor:2", "layout": "dp_pp_tp", "model.num_layers": 4,
        "pipeline.schedule": "zb", "pipeline.repeats": 2, "pipeline.microbatches": 4}, 4),
}


@pytest.fixture(scope="module")
def reference():
    """reference(config name, layers): the unpipelined model on one device, computed when a
    case first asks for its (family, layer count)."""
    out = {}

    def get(name, layers):
        key = (config_lib.load(name).model.name, layers)
        if key not in out:
            out[key] = loss_and_grads(config(name, **{"model.num_layers": layers, "layout": "dp",
                                                      "pipeline.microbatches": 0, "train.loss_chunk": 256}),
                                      devices=jax.devices()[:1], mesh_shape="data:1")
        return out[key]
    return get


@pytest.mark.parametrize("case", CASES)
def test_1f1b_loss_and_grads_match_unpipelined(case, reference):
    name, overrides, layers = CASES[case]
    cfg = config(name, **{"pipeline.schedule": "1f1b", "model.num_layers": layers, **overrides})
    loss, grads = loss_and_grads(cfg)
    ref_loss, ref_grads = reference(name, layers)
    assert abs(loss - ref_loss) / ref_loss < 1e-5, (loss, ref_loss)
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * np.abs(r).max()),
                 grads, ref_grads)


def test_dropout_masks_are_gpipes():
    """The tick loops fold the same keys per layer, microbatch and batch shard as the
    forward-only ticks, so with dropout 1f1b's and zb's loss and gradients are GPipe's."""
    def with_key(schedule):
        exp = Experiment.build(config("gpt2_tiny_pp2_dp4", **{"model.dropout": 0.2, "pipeline.schedule": schedule}))
        params = exp.init_state().params
        batch = exp.put_batch(next(exp.train_batches()))
        objective = step_lib.make_objective(exp.model, exp.layout, exp.mesh)
        loss_fn = jax.jit(jax.value_and_grad(lambda p, b, k: objective(p, {}, b, k)[0]),
                          compiler_options=analysis_options())
        return jax.device_get(loss_fn(params, batch, jax.random.key(3)))
    a, ga = with_key("gpipe")
    for schedule in ("1f1b", "zb"):
        b, gb = with_key(schedule)
        assert a == pytest.approx(b, rel=1e-6), schedule
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6 * np.abs(y).max()), ga, gb)


def test_1f1b_keeps_less_than_gpipe_and_residuals_recompute_nothing():
    """Compiled temp memory and matmul FLOPs of one step, S=4, M=16: 1f1b with stashed
    inputs keeps far less than GPipe; with residuals it keeps (2S-1)/M of GPipe's
    activations and runs GPipe's matmuls exactly; with inputs it runs one more forward."""
    from meshtrain.planner import hlo_flops
    figures = {}
    for label, overrides in {"gpipe": {}, "inputs": {"pipeline.schedule": "1f1b"},
                             "residuals": {"pipeline.schedule": "1f1b", "pipeline.stash": "residuals"}}.items():
        exp = Experiment.build(config("gpt2_tiny_pp4_dp2", **{"pipeline.microbatches": 16, "train.batch_size": 64,
                                                              **overrides}))
        compiled = exp.compile(analysis=True)
        figures[label] = (compiled.memory_analysis().temp_size_in_bytes, hlo_flops.dot_flops(compiled))
    assert figures["inputs"][0] < 0.35 * figures["gpipe"][0]
    assert figures["residuals"][0] < 0.6 * figures["gpipe"][0]
    assert figures["residuals"][1] == figures["gpipe"][1]
    assert figures["gpipe"][1] < figures["inputs"][1] < 4 / 3 * figures["gpipe"][1]


RUN = ["--config.train.steps=4", "--config.train.log_every=1", "--config.train.eval_every=0",
       "--config.checkpoint.every=0", *(f"--config.{k}={v}" for k, v in ROWS.items())]  # a row a replica a microbatch


def test_a_checkpoint_saved_under_one_schedule_resumes_under_another(tmp_path):
    """Saved by circular (2 chunks per stage), resumed by zb (one; its stacked blocks are
    laid out as 1f1b's): the blocks are restaged and the losses are the unbroken circular
    run's."""
    name = "gpt2_tiny_pp4_dp2_circular"
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    assert main([f"--config={name}", *RUN, f"--workdir={straight}"]) == 0
    assert main([f"--config={name}", *RUN, "--config.train.stop_at=2", f"--workdir={broken}"]) == 0
    assert main([f"--config={name}", *RUN, "--config.pipeline.schedule=zb", "--config.pipeline.repeats=1",
                 f"--workdir={broken}"]) == 0
    ref, got = losses(straight), losses(broken)
    assert sorted(got) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in (3, 4)], [ref[s] for s in (3, 4)], rtol=1e-5)
