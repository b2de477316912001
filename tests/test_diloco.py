"""DiLoCo (diloco.every, parallel/diloco.py, step/rounds.py): a round a step with outer SGD
at lr 1 is data parallelism; an inner step sends nothing across nodes and a round sends
what the formula says; a resume mid-round is exact, and one that cannot take the round
starts a new one from the outer params; what cannot train apart is refused with the fix."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.checkpoints import store
from meshtrain.errors import UserError
from meshtrain.parallel import compression, diloco
from meshtrain.planner import hlo, roofline
from meshtrain.run.experiment import Experiment
from support.configs import configured
from support.training import TOKENS, devices_for, stepped

STEPS = 4
# Inner momentum SGD, no clipping or decay: linear in the gradients, so a round a step
# averages what data parallelism's one step does.
SGD = {"optim.name": "sgd", "optim.momentum": "0.9", "optim.grad_clip": "0", "optim.weight_decay": "0",
       "optim.lr": "0.1", "optim.warmup_steps": "0", "model.dropout": "0", "mesh.dcn": "data:2"}


def build(name="gpt2_tiny_dp8", devices=None, **overrides):
    cfg = configured(name, **{"train.steps": str(STEPS), **TOKENS, **SGD, **overrides})
    return Experiment.build(cfg, devices=devices)


@pytest.fixture(scope="module")
def rounds():
    """(data parallelism's, a round a step's, a round every 2 steps', and the same with the
    pseudo-gradient in int8) experiment, compiled step and STEPS steps' (state, metrics)."""
    out = []
    for over in ({}, {"diloco.every": "1", "diloco.outer_lr": "1.0", "diloco.outer_momentum": "0"},
                 {"diloco.every": "2"}, {"diloco.every": "2", "train.grad_compression": "int8"}):
        exp = build(**over)
        compiled = exp.compile(analysis=True)
        # On the host as they come: the next step donates each state's arrays.
        out.append((exp, compiled, [jax.device_get(step) for step in stepped(exp, STEPS, step=compiled)]))
    return out


def test_a_round_a_step_with_outer_sgd_at_lr_1_is_data_parallelism(rounds):
    (_, _, plain), (_, _, local), *_ = rounds
    np.testing.assert_allclose([float(m["loss"]) for _, m in local], [float(m["loss"]) for _, m in plain], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(local[-1][0].params), jax.tree.leaves(plain[-1][0].params)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_an_island_keeps_its_fsdp_and_tensor_splits_and_a_round_a_step_is_still_data_parallelism():
    """llama_tiny_dp2_fsdp2_tp2: each of the 2 data replicas (an island each, no mesh.dcn)
    is FSDP x tensor inside, as in the run without DiLoCo."""
    runs = []
    for over in ({}, {"diloco.every": "1", "diloco.outer_lr": "1.0", "diloco.outer_momentum": "0"}):
        exp = build("llama_tiny_dp2_fsdp2_tp2", **{"mesh.dcn": "", **over})
        runs.append([jax.device_get(step) for step in stepped(exp, 2, step=exp.compile(analysis=True))])
    assert exp.diloco.islands == 2 and exp.diloco.per_island == 1
    np.testing.assert_allclose([float(m["loss"]) for _, m in runs[1]], [float(m["loss"]) for _, m in runs[0]],
                               rtol=1e-6)
    for a, b in zip(jax.tree.leaves(runs[1][-1][0].params), jax.tree.leaves(runs[0][-1][0].params)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_an_inner_step_sends_nothing_across_nodes_and_a_round_what_the_formula_says(rounds):
    exp, compiled, history = rounds[2]
    node_of = roofline.node_of_position(exp.mesh, 4, exp.dcn)
    inner = hlo.collective_table(compiled.inner, exp.mesh, node_of)
    assert [r for r in inner if r["nodes"] > 1] == []
    assert any(r["mesh_axes"] == ("data",) and r["kind"] == "all-reduce" for r in inner)  # the island's mean
    # ... which the plan report times on the node's links, not the network
    assert not any(r["crosses_nodes"] for r in roofline.place(inner, exp.mesh, node_of))
    outer = hlo.collective_table(compiled.outer[0], exp.mesh, node_of)
    local = diloco.local_values(exp.model.shapes, exp.shardings.params, exp.mesh)
    for kind, axes, nbytes, _, in_node in diloco.wire(exp.diloco, local):
        got = sum(r["bytes"] for r in outer if (r["kind"], r["mesh_axes"], r["nodes"] == 1) == (kind, axes, in_node))
        assert got == pytest.approx(nbytes, rel=0.01), (kind, got, nbytes)
    assert sum(r["bytes"] for r in outer) == pytest.approx(sum(w[2] for w in diloco.wire(exp.diloco, local)), rel=0.01)
    # `meshtrain train`'s start-up line says the bytes a round sends between the islands.
    said = re.search(r": ([\d,]+) bytes a device a round between islands \(([\d,]+) a step\)$", exp.gradients_line())
    between = [int(said[i].replace(",", "")) for i in (1, 2)]
    assert between[0] == pytest.approx(sum(r["bytes"] for r in outer if r["nodes"] > 1), rel=0.01)
    assert between[1] == round(between[0] / 2)
    # Between rounds the islands part; at a round's end every replica holds the outer params.
    state = history[-1][0]
    for outer_p, rows in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.comm["params"])):
        np.testing.assert_array_equal(rows, np.broadcast_to(outer_p, rows.shape))
    parted = history[-2][0].comm["params"]
    assert any(not np.array_equal(rows[0], rows[-1]) for rows in jax.tree.leaves(parted))
    assert all(np.array_equal(rows[0], rows[3]) for rows in jax.tree.leaves(parted))  # one island, one copy


def test_a_resume_mid_round_is_exact_and_one_on_another_data_size_starts_a_round(rounds, tmp_path, capsys):
    exp, compiled, history = rounds[2]
    ck = store.Checkpointer(tmp_path / "ck", every=0, keep=2, use_async=False)
    first = next(stepped(exp, 1, step=compiled))[0]
    ck.save(1, first, {"run": {"diloco": 2}})  # step 1 of a 2-step round; meta["run"] as a run writes it
    ck.wait()
    resumed, _ = ck.restore(1, exp)
    batches = exp.train_batches(1)
    for _ in range(STEPS - 1):
        resumed, _ = compiled(resumed, exp.put_batch(next(batches)))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), history[-1][0])
    smaller = build(devices=devices_for("data:4"), **{"mesh.shape": "data:4", "diloco.every": "2"})
    fresh, _ = ck.restore(1, smaller)
    ck.close()
    assert "DiLoCo starts a new round from the outer params at step 1, its outer momentum at zero" in \
        capsys.readouterr().err
    for outer_p, rows in zip(jax.tree.leaves(jax.device_get(fresh.params)),
                             jax.tree.leaves(jax.device_get(fresh.comm["params"]))):
        assert rows.shape[0] == 4
        np.testing.assert_array_equal(rows, np.broadcast_to(outer_p, rows.shape))


def test_the_pseudo_gradient_in_int8_sends_a_quarter_across_nodes_and_trains_alike(rounds):
    """train.grad_compression=int8 under DiLoCo compresses the outer step's chunks across
    nodes (compression's two phases, no feedback), as the formula says; the inner steps
    are untouched."""
    (_, _, plain), (_, _, _), (exp, compiled, f32), (exp8, compiled8, int8) = rounds
    node_of = roofline.node_of_position(exp.mesh, 4, exp.dcn)
    across = [sum(r["bytes"] for r in hlo.collective_table(c.outer[0], e.mesh, node_of) if r["nodes"] > 1)
              for e, c in ((exp, compiled), (exp8, compiled8))]
    local = diloco.local_values(exp.model.shapes, exp.shardings.params, exp.mesh)
    assert across[1] == pytest.approx(sum(w[2] for w in diloco.wire(exp8.diloco, local) if not w[4]), rel=0.01)
    assert 0.24 < across[1] / across[0] <= 0.27
    assert [r for r in hlo.collective_table(compiled8.inner, exp8.mesh, node_of) if r["nodes"] > 1] == []
    np.testing.assert_allclose([float(m["loss"]) for _, m in int8], [float(m["loss"]) for _, m in f32], rtol=1e-3)
    assert not np.array_equal(jax.tree.leaves(int8[-1][0].params)[0], jax.tree.leaves(f32[-1][0].params)[0])


def test_a_resume_across_diloco_and_not_takes_the_params_and_starts_the_optimizer_afresh(rounds, tmp_path, capsys):
    """A DiLoCo checkpoint resumed without DiLoCo takes its outer params (and step); a plain
    one resumed with DiLoCo starts a round from its params; each says so in one line."""
    (plain_exp, _, plain), _, (exp, _, local), _ = rounds
    ck = store.Checkpointer(tmp_path / "ck", every=0, keep=3, use_async=False)
    for step, (e, history) in ((2, (exp, local)), (3, (plain_exp, plain))):
        state = jax.tree.map(jax.device_put, history[step - 1][0], e.shardings)
        ck.save(step, state, {"run": {"diloco": e.cfg.diloco.every}})
    ck.wait()
    ck.check_fits(2, plain_exp)
    into_plain, _ = ck.restore(2, plain_exp)
    into_local, _ = ck.restore(3, exp)
    ck.close()
    err = capsys.readouterr().err
    assert "step 2 was saved with diloco.every=2 and this run has none: it takes the checkpoint's outer params" in err
    assert "step 3 was saved without DiLoCo and this run has diloco.every=2" in err and "and round afresh" in err
    for got, want in ((into_plain, local[1][0]), (into_local, plain[2][0])):
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(got.params), want.params)
        assert int(got.step) == int(want.step)
    assert all(float(abs(x).max()) == 0 for x in jax.tree.leaves(into_plain.opt_state))
    for outer_p, rows in zip(jax.tree.leaves(jax.device_get(into_local.params)),
                             jax.tree.leaves(jax.device_get(into_local.comm["params"]))):
        np.testing.assert_array_equal(rows, np.broadcast_to(outer_p, rows.shape))


@pytest.mark.parametrize("fragment", [0, 1])
def test_outer_steps_are_nesterov_sgd_on_the_pseudo_gradient_of_their_fragment_alone(fragment):
    """Two of diloco.outer_update's steps against optax.sgd(0.7, 0.9, nesterov) on outer
    params - the islands' mean, on a toy: 2 islands of 4 replicas, a stack of 4 layers in 2
    fragments (the rest rides with the first), the momentum a piece a device. Fragment 1
    moves layers 2-3 only."""
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8, 1), ("data", "tensor"))
    dil = diloco.Diloco(every=4, outer_lr=0.7, outer_momentum=0.9, islands=2, per_island=4, fragments=2)
    rng = np.random.default_rng(0)
    params = {"blocks": {"w": rng.normal(size=(4, 3)).astype(np.float32)}, "head": rng.normal(size=(5,)).astype(np.float32)}
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
    comm = diloco.state_shapes(dil, optax.identity(), jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params),
                               replicated, replicated, "blocks")
    step = jax.jit(lambda p, c: diloco.outer_update(dil, p, c, mesh, replicated, "blocks", fragment))
    tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
    got, want, opt = params, params, tx.init(params)
    moments = [jnp.zeros(m.shape) for m in comm["momentum"]]
    for _ in range(2):
        island = [jax.tree.map(lambda p: p + rng.normal(size=p.shape).astype(np.float32), got) for _ in range(2)]
        rows = jax.tree.map(lambda a, b: np.stack([a] * 4 + [b] * 4), *island)
        got, out = step(got, {"params": rows, "momentum": moments})
        moments = out["momentum"]
        delta = jax.tree.map(lambda p, a, b: p - (a + b) / 2, want, *island)
        updates, opt = tx.update(delta, opt, want)
        want = optax.apply_updates(want, updates)
    moved = {"blocks": np.s_[2:4] if fragment else np.s_[0:2], "head": np.s_[:] if fragment == 0 else np.s_[0:0]}
    for key, got_p, want_p, old, rows_p in zip(["blocks", "head"], jax.tree.leaves(got), jax.tree.leaves(want),
                                               jax.tree.leaves(params), jax.tree.leaves(out["params"])):
        mask = np.zeros(old.shape, bool)
        mask[moved[key]] = True
        np.testing.assert_array_equal(np.asarray(rows_p)[:, mask], np.broadcast_to(np.asarray(got_p)[mask],
                                                                                  (8, mask.sum())))
        np.testing.assert_allclose(np.asarray(got_p)[mask], want_p[mask], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(got_p)[~mask], old[~mask])


def test_streaming_fragments_meet_in_turn_and_each_sends_its_share(rounds):
    """diloco.fragments=2 on gpt2_tiny_dp8 (2 layers): fragment 1 (layer 1) meets after
    steps 1, 3, ..., fragment 0 (layer 0 and the rest) after 2, 4, ...; each outer program
    sends the formula's bytes for its values, and the two add up to the whole round's."""
    dil = diloco.Diloco(every=4, outer_lr=0.7, outer_momentum=0.9, islands=2, per_island=4, fragments=2)
    assert [dil.due(s) for s in range(1, 9)] == [[], [1], [], [0], [], [1], [], [0]]
    assert dil.layer_ranges(5) == [(0, 2), (2, 5)] and dil.layer_ranges(4) == [(0, 2), (2, 4)]
    whole, _, _ = rounds[2]
    exp = build(**{"diloco.every": "2", "diloco.fragments": "2"})
    compiled = exp.compile(analysis=True)
    node_of = roofline.node_of_position(exp.mesh, 4, exp.dcn)
    specs = [s.spec for s in jax.tree.leaves(exp.shardings.params)]
    stacked = [getattr(p[0], "key", None) == exp.model.stacked
               for p, _ in jax.tree_util.tree_flatten_with_path(exp.model.shapes)[0]]
    sent = []
    for f, program in enumerate(compiled.outer):
        shapes = [(s.shape[0] // 2, *s.shape[1:]) if st else s.shape
                  for s, st in zip(jax.tree.leaves(exp.model.shapes), stacked) if st or f == 0]
        local = compression.local_size(shapes, [sp for sp, st in zip(specs, stacked) if st or f == 0], exp.mesh)
        across = sum(r["bytes"] for r in hlo.collective_table(program, exp.mesh, node_of) if r["nodes"] > 1)
        assert across == pytest.approx(sum(w[2] for w in diloco.wire(exp.diloco, local) if not w[4]), rel=0.01)
        sent.append(across)
    full = diloco.local_values(exp.model.shapes, exp.shardings.params, exp.mesh)
    assert sum(sent) == pytest.approx(sum(w[2] for w in diloco.wire(whole.diloco, full) if not w[4]), rel=0.01)
    assert max(sent) < 0.75 * sum(sent)
    history = [jax.device_get(x) for x in stepped(exp, 2, step=compiled)]
    for k, rows in jax.tree_util.tree_flatten_with_path(history[0][0].comm["params"])[0]:
        if getattr(k[0], "key", None) == exp.model.stacked:  # after step 1: layer 1 met, layer 0 apart
            assert np.array_equal(rows[0, 1], rows[7, 1]) and not np.array_equal(rows[0, 0], rows[7, 0])


@pytest.mark.parametrize("name,overrides,words", [
    ("gpt2_tiny_dp8_zero1", {}, ["splits the optimizer state over data", "Use dp"]),
    ("gpt2_tiny_dp8", {"train.grad_dtype": "bfloat16"}, ["train.grad_dtype", "DiLoCo replaces"]),
    ("gpt2_tiny_pp2_dp4", {"mesh.dcn": ""}, ["pipeline"]),
    ("vgg_tiny_digits_dp2", {"mesh.dcn": ""}, ["BatchNorm", "batch_norm=false"]),
    ("gpt2_tiny_dp8", {"diloco.every": "-1"}, ["integer >= 1", "0: off"]),
    ("gpt2_tiny_dp8", {"diloco.outer_momentum": "1.0"}, ["0 <= momentum < 1"]),
    ("gpt2_tiny_dp8", {"diloco.fragments": "3"}, ["divides every"]),
    ("gpt2_tiny_dp8", {"diloco.fragments": "4"}, ["2 stacked layers", "at most 2"]),
    ("vgg_tiny_dp8", {"diloco.fragments": "2"}, ["no stacked layers"]),
])
def test_what_cannot_train_apart_is_refused_with_the_fix(name, overrides, words):
    cfg = configured(name, **{"diloco.every": "4", "mesh.dcn": "data:2", **overrides})
    with pytest.raises(UserError) as e:
        Experiment.build(cfg, devices=devices_for(cfg.mesh.shape))
    for w in words:
        assert w in str(e.value), (w, str(e.value))
