"""ZB-H1 (pipeline.schedule=zb): the tick table with its weight slot, the idle share, W's
stash, one GPT-2 layer's backward split into B and W, and a whole step's matmuls against
1F1B's. Layouts' losses and gradients against the unpipelined model are in
test_pipeline_1f1b.py (its CASES), which shares their references, and so are the golden
tick tables."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.configs import configured as config
from meshtrain.models import family_of
from meshtrain.models.stack import layer_maker
from meshtrain.parallel.hook import Constrain
from meshtrain.parallel.pipeline import split_backward, ticks
from meshtrain.parallel.pipeline.scan import Pipeline
from meshtrain.planner import hlo_flops
from meshtrain.run.experiment import Experiment

def slots(pipe):
    """{(stage, repeat, microbatch): {"f", "b", "w": tick}} read off the schedule."""
    out = {}
    for t in range(sum(ticks.phases(pipe))):
        for kind, items in (("f", ticks.forward_items), ("b", ticks.backward_items), ("w", ticks.weight_items)):
            valid, i, m = items(pipe, t)
            for s in np.flatnonzero(valid):
                assert kind not in out.setdefault((s, int(i[s]), int(m[s])), {}), (kind, s, t)
                out[(s, int(i[s]), int(m[s]))][kind] = t
    return out


def idle_share(pipe) -> float:
    """The share of a stage's step that is idle, counted tick by tick with F = B = W: a
    forward slot 1, a backward slot 2 (B and W) under 1f1b/interleaved, 1 (B) under zb, a
    weight slot 1."""
    cost = {"f": 1, "b": 1 if pipe.schedule == "zb" else 2, "w": 1}
    total = sum((b - a) * sum(cost[k] for k in kinds) for a, b, kinds in ticks.segments(pipe))
    return 1 - 3 * pipe.repeats * pipe.microbatches / total


CONSTANTS = [(s, m, v) for s, m, v in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16), (1, 2, 3))
             if v == 1 or m % s == 0]


@pytest.mark.parametrize("s, m, v", CONSTANTS)
def test_w_runs_once_after_b_on_every_stage_at_once(s, m, v):
    """F and B as 1F1B's; each item's W once, on its stage, no earlier than its B, in the
    same tick on every stage; W's stash (slot u mod K_w) never holds two items at once."""
    zb, one = Pipeline(s, m, v, schedule="zb"), Pipeline(s, m, v, schedule="1f1b" if v == 1 else "interleaved")
    got, ref = slots(zb), slots(one)
    assert {k: (t["f"], t["b"]) for k, t in got.items()} == {k: (t["f"], t["b"]) for k, t in ref.items()}
    for (st, i, mb), t in got.items():
        assert t["b"] <= t["w"] == got[(0, i, mb)]["w"], (st, i, mb)
        assert t["w"] - t["b"] == st  # stage s keeps W's inputs s ticks
    k = ticks.weight_stash_slots(zb)
    for t in range(sum(ticks.phases(zb))):
        for st in range(s):
            alive = [(ticks.backward_u(zb, tt["b"])[st]) % k for (x, _, _), tt in got.items()
                     if x == st and tt["b"] <= t <= tt["w"]]
            assert len(alive) == len(set(alive)), (s, m, v, t, st)


@pytest.mark.parametrize("s, m, v", CONSTANTS)
def test_idle_share_by_tick_is_the_formula(s, m, v):
    """Counting F = B = W a slot, tick by tick, against 2(S-1)/(3vM + 2(S-1)); 1F1B's
    backward slot (B and W) against its (S-1)/(vM + S-1)."""
    zb, one = Pipeline(s, m, v, schedule="zb"), Pipeline(s, m, v, schedule="1f1b" if v == 1 else "interleaved")
    assert idle_share(zb) == pytest.approx(2 * (s - 1) / (3 * v * m + 2 * (s - 1)), abs=1e-12)
    assert idle_share(one) == pytest.approx(one.bubble, abs=1e-12)
    assert zb.bubble == pytest.approx(idle_share(zb), abs=1e-12)
    # The lockstep lower bound for any placement of the chunks (docs/pipeline.md, ZBV): the
    # (S-1)th hop's stage starts its vM forwards S-1 ticks late, the backwards end S-1
    # ticks apart likewise, and W takes vM ticks; zb's ticks with each slot are exactly those.
    with_slot = {k: sum(b - a for a, b, kinds in ticks.segments(zb) if k in kinds) for k in "fbw"}
    assert with_slot == {"f": v * m + s - 1, "b": v * m + s - 1, "w": v * m}


def test_the_issue_figures():
    """A third of the lockstep bubble: 27.3% -> 20.0% at S=4, M=8 (a step 30/33 = 0.909 of
    1F1B's), 30.4% -> 22.6% at S=8, M=16."""
    for (s, m), (before, after) in {(4, 8): (0.273, 0.200), (8, 16): (0.304, 0.226)}.items():
        one, zb = Pipeline(s, m, schedule="1f1b"), Pipeline(s, m, schedule="zb")
        assert (round(one.bubble, 3), round(zb.bubble, 3)) == (before, after)
    assert (1 - Pipeline(4, 8, schedule="1f1b").bubble) / (1 - Pipeline(4, 8, schedule="zb").bubble) == \
        pytest.approx(30 / 33)


WIDE = {"model.embed_dim": 256, "model.mlp_dim": 1024, "model.seq_len": 32, "pipeline.microbatches": 8,
        "train.batch_size": 32, "pipeline.stash": "residuals"}  # matmuls wide enough to be the step's


def one_layer(name: str, **overrides):
    """One block of config `name` on one device: (its model config, layer(w, k, x) as the
    tick loop splits it, its weights, an input [2, T, D])."""
    exp = Experiment.build(config(name, **overrides), devices=jax.devices()[:1], mesh_shape="data:1")
    bound = exp.model.bind(exp.init_state().params)
    make_layer, stacked = layer_maker(getattr(bound, exp.model.stacked), "none")
    layer = make_layer(Constrain(exp.layout.without("data"), exp.mesh))
    ws = jax.tree.map(lambda a: a[:1], stacked)
    x = jax.random.normal(jax.random.key(0), (2, exp.model.cfg.seq_len, exp.model.cfg.embed_dim))
    return exp.model.cfg, (lambda w, k, x: layer(x, w, k)), ws, x


@pytest.fixture(scope="module")
def gpt2_layer():
    """One GPT-2 block of the WIDE config (model config, layer, weights, input)."""
    return one_layer("gpt2_tiny_dp8", **{k: v for k, v in WIDE.items() if k.startswith("model.")})


def dot_shapes(jaxpr) -> list[tuple]:
    """The output shape of every matmul in a jaxpr, the bodies of its loops and calls too."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            out.append(e.outvars[0].aval.shape)
        for v in e.params.values():
            for sub in v if isinstance(v, (tuple, list)) else [v]:
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    out += dot_shapes(getattr(sub, "jaxpr", sub))
    return out


def test_a_gpt2_layer_splits_into_b_without_weight_dots_and_w(gpt2_layer):
    """B and W of one block have the fused pullback's matmul FLOPs (within 1%); W is the four
    weight matrices' gradients, 2 x tokens x their size, and B holds none of them."""
    _, layer, ws, x = gpt2_layer
    split = split_backward.LayerSplit(layer, ws, None, x)
    _, res = split.forward(ws, None, x)
    g = jnp.ones_like(x)

    def flops(fn, *args):
        return hlo_flops.dot_flops(jax.jit(fn).lower(*args).compile())
    fused = flops(lambda res, g: jax.tree.leaves(split.backward(ws, res, g)), res, g)
    dx, dw_b, kept = split.input_grads(ws, res, g)
    b, w = flops(lambda res, g: split.input_grads(ws, res, g), res, g), flops(lambda kept: split.weight_grads(ws, kept),
                                                                             kept)
    assert b + w == pytest.approx(fused, rel=0.01)
    matrices = sum(ws[part][name].size for part, name in (("attn", "w_qkv"), ("attn", "w_out"), ("mlp", "w_fc"),
                                                          ("mlp", "w_proj")))
    assert w == 2 * x.shape[0] * x.shape[1] * matrices
    weight_shapes = {a.shape[1:] for a in jax.tree.leaves(ws)}
    outs = dot_shapes(jax.make_jaxpr(lambda res, g: split.input_grads(ws, res, g))(res, g).jaxpr)
    assert len(outs) == 8 and not weight_shapes & set(outs)  # dx through the 4 matrices; attention's 4
    want_dw, want_dx = jax.vjp(lambda ws, x: jax.lax.scan(lambda h, w: (layer(w, None, h), None), x, ws)[0], ws, x)[1](g)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 split.tree(dw_b, split.weight_grads(ws, kept)), want_dw)
    # B makes the gradients no matmul needs (the biases and the norms' scales, a reduction
    # each of values W would otherwise keep), W the four weight matrices'.
    in_w = {"/".join(str(k.key) for k in path) for (path, _), b in
            zip(jax.tree_util.tree_flatten_with_path(ws)[0], split.in_b) if not b}
    assert in_w == {"attn/w_qkv", "attn/w_out", "mlp/w_fc", "mlp/w_proj"}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_w_stash_holds_what_the_familys_formula_counts(name, gpt2_layer):
    """What B hands W for one layer (the traced split's kept values) is the family's
    weight_input_bytes to the byte: GPT-2's 8D + 2F a token, Llama's 6D + 3F + 2KE (the
    planner's zb weight stash; a family the zb schedule can run must give one to register)."""
    cfg, layer, ws, x = gpt2_layer if name == "gpt2" else one_layer("llama_tiny_fsdp8", **{"model.seq_len": 32})
    split = split_backward.LayerSplit(layer, ws, None, x)
    _, res = split.forward(ws, None, x)
    kept = jax.eval_shape(lambda res, g: split.input_grads(ws, res, g)[2], res, jnp.ones_like(x))
    traced = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(kept))
    assert traced == family_of(cfg).weight_input_bytes(cfg, x.shape[0] * x.shape[1], 1)


def test_a_step_runs_s_minus_1_fewer_w_than_1f1b():
    """The whole step's matmul FLOPs per device (every tick, the bubble's included), S=4,
    M=8, v=1: 1F1B runs W in each of its vM + S - 1 backward ticks, zb in vM, so zb runs
    (S-1) items' W fewer: 2 x a microbatch's tokens on a device x the stage's weight
    matrices, exactly; with these wide layers 0.912 of 1F1B's (F = B = W: 30/33 = 0.909)."""
    figures = {}
    for schedule in ("1f1b", "zb"):
        exp = Experiment.build(config("gpt2_tiny_pp4_dp2", **{**WIDE, "pipeline.schedule": schedule}))
        figures[schedule] = hlo_flops.dot_flops(exp.compile(analysis=True))
    d, f = WIDE["model.embed_dim"], WIDE["model.mlp_dim"]
    tokens = 32 // 8 // 2 * WIDE["model.seq_len"]  # a microbatch's rows on a device (data 2), all positions
    w_item = 2 * tokens * (4 * d * d + 2 * d * f)  # one layer a stage
    assert figures["1f1b"] - figures["zb"] == 3 * w_item
    assert figures["zb"] / figures["1f1b"] <= 0.92
