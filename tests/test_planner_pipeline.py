"""The planner's pipeline formulas per schedule (planner/pipeline_memory.py, analytic.py):
activations against hand arithmetic, the items each stage keeps, the report's pipeline
line, the linter's 1F1B suggestion and the search's schedules. Formulas only, on abstract
meshes, but for one compile of a tiny pipeline for the report."""

import dataclasses

import jax
import pytest

from meshtrain import config as config_lib
from meshtrain.parallel.pipeline import ticks as pipeline_ticks
from meshtrain.parallel.pipeline.scan import Pipeline
from meshtrain.pictures import text
from meshtrain.planner import analytic, hardware, lint, pipeline_memory, report as report_lib, search
from meshtrain.run.experiment import Experiment
from support.configs import configured

H100 = hardware.get("h100")
ACCEPTANCE = "gpt2_medium_dp2_pp4_tp4"  # S = 4, M = 16, data 2, tensor 4, 24 layers


def experiment(name=ACCEPTANCE, **overrides):
    return analytic.abstract_experiment(configured(name, **overrides))


def by_hand(exp):
    """The pieces of the formulas for `exp`, from its config's dims: GPT-2 at no remat or
    full, XLA attention (no hardware given), the loss in chunks of train.loss_chunk."""
    c, p = exp.model.cfg, exp.cfg.pipeline
    data, stages, tensor = (int(x.split(":")[1]) for x in exp.cfg.mesh.shape.split(","))
    d, f, h, t, v = c.embed_dim, c.mlp_dim, c.num_heads, c.seq_len, c.padded_vocab_size
    width = 2 if c.dtype == "bfloat16" else 4
    mb = exp.cfg.train.batch_size // p.microbatches // data  # a microbatch's rows on a device

    def layer(rows, remat):  # Korthikanti: whole 4D, split 4D + 2F and the H x T probabilities
        per_token = d if remat == "full" else 4 * d + (4 * d + 2 * f + h * t) / tensor
        return rows * t * width * per_token

    chunks = t // exp.cfg.train.loss_chunk

    def head(rows, vocab):  # logits and their gradient in the compute dtype; projection gradient
        return rows * t // chunks * vocab * 2 * width + vocab * d * 4

    return dict(mb=mb, layer=layer, stream=mb * t * d * width, stages=stages,
                head_after=head(exp.cfg.train.batch_size // data // stages, v / tensor),
                head_per_tick=head(mb, v / (tensor * stages)))


def test_items_kept_follow_the_lockstep_count():
    """1F1B in lockstep: stage s keeps min(M, 2(S-1-s)+1), 2S-1 on stage 0, not S-s;
    gpipe and circular keep every item; interleaved what pipeline_ticks counts."""
    for s, m in ((4, 16), (4, 5), (2, 8), (8, 4)):
        pipe = Pipeline(stages=s, microbatches=m, schedule="1f1b")
        assert pipeline_memory.items_kept(pipe) == tuple(min(m, 2 * (s - 1 - i) + 1) for i in range(s))
        assert pipeline_memory.items_kept(dataclasses.replace(pipe, schedule="gpipe")) == (m,) * s
    circular = Pipeline(stages=4, microbatches=8, repeats=2, schedule="circular")
    assert pipeline_memory.items_kept(circular) == (16,) * 4
    inter = dataclasses.replace(circular, schedule="interleaved")
    assert pipeline_memory.items_kept(inter) == tuple(pipeline_ticks.in_flight(inter))
    assert max(pipeline_memory.items_kept(inter)) < 16


def test_gpipe_and_circular_keep_every_microbatch():
    exp = experiment(**{"model.dtype": "float32"})
    n = by_hand(exp)
    layers = 24 // n["stages"]
    want = layers * 16 * n["layer"](n["mb"], "none") + n["head_after"]
    assert analytic.activations(exp) == pytest.approx(want)
    circular = experiment(**{"model.dtype": "float32", "pipeline.schedule": "circular", "pipeline.repeats": 2})
    assert analytic.activations(circular) == pytest.approx(want)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_one_f_one_b_by_hand(remat):
    """S=4, M=16: stage 0 keeps 7 = 2S-1 items. stash=inputs: 7 chunk inputs, one item's
    residuals (6 layers of one microbatch), 4 send buffers, the 16 embedded microbatches
    and their gradient, the per-tick head; with remat one layer's full activations more.
    stash=residuals: 7 items' residuals."""
    base = {"model.dtype": "float32", "model.remat": remat, "pipeline.schedule": "1f1b"}
    exp = experiment(**base)
    n = by_hand(exp)
    item = 6 * n["layer"](n["mb"], remat)
    extra = n["layer"](n["mb"], "none") if remat != "none" else 0
    common = extra + 4 * n["stream"] + 2 * 16 * n["stream"] + n["head_per_tick"]
    acct = analytic.pipeline_activations(exp)
    assert acct.kept[0] == 7 == 2 * 4 - 1 == acct.slots and acct.item_layers == 6
    assert acct.total == pytest.approx(7 * n["stream"] + item + common)
    assert analytic.activations(exp) == acct.total
    lean = experiment(**base, **{"pipeline.stash": "residuals"})
    assert analytic.activations(lean) == pytest.approx(7 * item + common)


def test_interleaved_keeps_chunks_of_l_over_v_s_layers():
    """The stash is allocated as v x K slots (K: the most items of one repeat alive at
    once), more than the items alive at once on stage 0."""
    exp = experiment(**{"model.dtype": "float32", "pipeline.schedule": "interleaved", "pipeline.repeats": 2})
    n = by_hand(exp)
    pipe = exp.model.pipeline
    slots = 2 * pipeline_ticks.stash_slots(pipe)
    acct = analytic.pipeline_activations(exp)
    assert acct.item_layers == 3 and acct.kept[0] == max(pipeline_ticks.in_flight(pipe)) < slots == acct.slots
    want = (slots * n["stream"] + 3 * n["layer"](n["mb"], "none") + 4 * n["stream"] + 2 * 16 * n["stream"]
            + n["head_per_tick"])
    assert acct.total == pytest.approx(want)
    assert acct.bubble == pytest.approx(3 / (2 * 16 + 3)) == exp.model.pipeline.bubble


def test_acceptance_one_f_one_b_against_gpipe():
    """The acceptance bar: 1f1b's activations at most 0.35 of gpipe's for
    gpt2_medium_dp2_pp4_tp4 in float32 without remat; the same bubble and the same
    activations written (the roofline's traffic)."""
    gpipe = experiment(**{"model.dtype": "float32"})
    ofob = experiment(**{"model.dtype": "float32", "pipeline.schedule": "1f1b"})
    a, b = analytic.memory(gpipe, H100), analytic.memory(ofob, H100)
    assert b["activations"] / a["activations"] <= 0.35
    assert {k: a[k] for k in ("params", "optimizer", "gradients")} == {k: b[k] for k in ("params", "optimizer",
                                                                                          "gradients")}
    assert analytic.activation_traffic(ofob) == pytest.approx(analytic.activation_traffic(gpipe))
    assert ofob.model.pipeline.bubble == gpipe.model.pipeline.bubble


def test_report_shows_the_schedule_and_what_is_kept():
    """The one compile: a tiny pipeline, planned under 1f1b."""
    cfg = configured("gpt2_tiny_pp2_dp4", **{"pipeline.schedule": "1f1b"})
    exp = Experiment.build(cfg, devices=jax.devices()[:8])
    r = report_lib.plan(exp, H100)
    p = r["pipeline"]
    assert (p["schedule"], p["stash"], p["stages"], p["microbatches"]) == ("1f1b", "inputs", 2, 4)
    assert p["items_kept_per_stage"] == [3, 1] and p["items_per_stage"] == 4 and p["layers_per_item"] == 1
    assert p["stash_slots"] == 3
    assert p["activations_bytes"] == r["analytic_memory_per_device_bytes"]["activations"]
    assert p["bubble"] == pytest.approx(1 / 5)
    line = next(x for x in text.render(r).splitlines() if "pipeline 1f1b" in x)
    assert "items kept per stage 3, 1 of 4" in line and "bubble 20.0%" in line


def test_lint_suggests_1f1b_where_gpipe_does_not_fit():
    """At batch 512 gpipe keeps 16 microbatches of 16 rows on each stage: more than an
    h100 holds by the formulas, and 1f1b fits. At the config's own batch 64 it fits and
    saves too little of the device to be flagged; under 1f1b there is nothing to say."""
    cfg = configured(ACCEPTANCE, **{"model.dtype": "float32", "train.batch_size": 512})
    exp = analytic.abstract_experiment(cfg)
    findings = lint.lint(cfg, model=exp.model, hw=H100)
    (f,) = [f for f in findings if f.code == "pipeline-activations"]
    assert f.severity == "warning" and "does not fit on h100" in f.what
    gib = lambda b: f"{b / 2**30:,.2f} GiB"  # noqa: E731
    after = analytic.abstract_experiment(configured(ACCEPTANCE, **{"model.dtype": "float32", "train.batch_size": 512,
                                                             "pipeline.schedule": "1f1b"}))
    now, then = analytic.memory(exp, H100), analytic.memory(after, H100)
    assert sum(then.values()) <= H100.hbm_bytes * H100.usable_memory < sum(now.values())
    assert f"{gib(now['activations'])} under gpipe against {gib(then['activations'])} under 1f1b" in f.cost
    assert lint.fix_overrides(f.fix) == [("pipeline.schedule", "1f1b")]
    config_lib.override(cfg, "pipeline.schedule", "1f1b")
    assert "pipeline-activations" not in [g.code for g in lint.lint(cfg, model=after.model, hw=H100)]
    small = configured(ACCEPTANCE, **{"model.dtype": "float32"})
    model = analytic.abstract_experiment(small).model
    assert "pipeline-activations" not in [g.code for g in lint.lint(small, model=model, hw=H100)]


def test_lint_suggests_1f1b_where_it_saves_a_quarter_of_the_device():
    """At batch 256 gpipe fits an h100 by the formulas, but 1f1b saves more than a quarter
    of its usable memory: flagged, saying it fits; at 64 it saves less and is not."""
    usable = H100.hbm_bytes * H100.usable_memory
    for batch, flagged in ((256, True), (64, False)):
        cfg = configured(ACCEPTANCE, **{"model.dtype": "float32", "train.batch_size": batch})
        gpipe = analytic.abstract_experiment(cfg)
        ofob = analytic.abstract_experiment(configured(ACCEPTANCE, **{"model.dtype": "float32", "train.batch_size": batch,
                                                                "pipeline.schedule": "1f1b"}))
        saved = analytic.activations(gpipe) - analytic.activations(ofob)
        assert sum(analytic.memory(gpipe, H100).values()) <= usable
        assert (saved >= lint.SAVES_A_LOT * usable) == flagged
        found = [f for f in lint.lint(cfg, model=gpipe.model, hw=H100) if f.code == "pipeline-activations"]
        assert len(found) == flagged and all("the step fits on h100" in f.what for f in found)


def test_search_lists_the_schedules():
    """Each M under gpipe, 1f1b (both stashes), zb and, where v S divides the layers, circular
    and interleaved with v = 2; a plain mesh has no schedule."""
    cands, _ = search.enumerate_candidates(8, 4, None, layouts=("dp_pp", "dp"), remats=("none",))
    on = {}
    for c in cands:
        stages = dict(c.mesh)["stage"]
        on.setdefault(stages, set()).add((c.microbatches, c.schedule, c.repeats, c.stash))
    assert on[1] == {(0, "gpipe", 1, "")}
    plain = {("gpipe", 1, ""), ("1f1b", 1, "inputs"), ("1f1b", 1, "residuals"), ("zb", 1, "residuals")}
    chunked = {("circular", 2, ""), ("interleaved", 2, "inputs"), ("interleaved", 2, "residuals")}
    assert on[2] == {(m, *s) for m in (2, 4, 8) for s in plain | chunked}  # 4 layers: 2 x 2 chunks
    assert on[4] == {(m, *s) for m in (4, 8, 16) for s in plain}  # 8 chunks of 4 layers: no
    c = next(c for c in cands if c.schedule == "interleaved" and c.stash == "residuals")
    assert dict(c.overrides())["pipeline.schedule"] == "interleaved" and dict(c.overrides())["pipeline.repeats"] == "2"
    assert "interleaved v=2 stash=residuals" in c.describe()
    entries = [{"candidate": c} for c in cands if c.microbatches in (0, 8)]
    assert len(search.one_schedule_each(entries)) == 1 + 1 + 1  # plain; stage 2; stage 4, M = 8


def test_search_predicts_the_recompute_of_stash_inputs():
    """stash=inputs runs each chunk's forward again: 4/3 of the layers' matmuls, the head's
    unchanged; stash=residuals costs what gpipe does. The memory term reads what the step
    writes, the same for all three."""
    def predict(**overrides):
        exp = Experiment.build(configured("gpt2_tiny_pp2_dp4", **overrides), devices=jax.devices()[:8])
        return search._estimate(exp, H100, analytic.memory(exp, H100))[0], exp
    gpipe, exp = predict()
    c = exp.model.cfg
    inputs, _ = predict(**{"pipeline.schedule": "1f1b"})
    residuals, _ = predict(**{"pipeline.schedule": "1f1b", "pipeline.stash": "residuals"})
    from meshtrain.runlog import metrics
    tokens = exp.cfg.train.batch_size * c.seq_len
    total = (metrics.flops_per_token(c) + 6.0 * c.num_layers * c.embed_dim * c.seq_len) * tokens  # with the square
    layers = total - 6.0 * c.padded_vocab_size * c.embed_dim * tokens  # less the output projection
    assert inputs["matmul_s"] / gpipe["matmul_s"] == pytest.approx((total + layers / 3) / total)
    assert residuals["matmul_s"] == gpipe["matmul_s"]
    assert residuals["memory_s"] == gpipe["memory_s"] == inputs["memory_s"]
