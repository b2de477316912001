"""DiLoCo (diloco.every, parallel/diloco.py, step/rounds.py): a round a step with outer SGD
at lr 1 is data parallelism; an inner step sends nothing across nodes and a round sends
what the formula says; a resume mid-round is exact, and one that cannot take the round
starts a new one from the outer params; what cannot train apart is refused with the fix."""

import jax
import numpy as np
import pytest

from meshtrain.checkpoints import store
from meshtrain.errors import UserError
from meshtrain.parallel import compression, diloco
from meshtrain.planner import hlo, roofline
from meshtrain.run.experiment import Experiment
from support.configs import configured
from support.training import ROWS, devices_for, stepped

STEPS = 4
# Inner momentum SGD, no clipping or decay: linear in the gradients, so a round a step
# averages what data parallelism's one step does.
SGD = {"optim.name": "sgd", "optim.momentum": "0.9", "optim.grad_clip": "0", "optim.weight_decay": "0",
       "optim.lr": "0.1", "optim.warmup_steps": "0", "model.dropout": "0", "mesh.dcn": "data:2"}


def build(name="gpt2_tiny_dp8", devices=None, **overrides):
    cfg = configured(name, **{"train.steps": str(STEPS), **ROWS, **SGD, **overrides})
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
    outer = hlo.collective_table(compiled.outer, exp.mesh, node_of)
    local = compression.local_size([s.shape for s in jax.tree.leaves(exp.model.shapes)],
                                   [s.spec for s in jax.tree.leaves(exp.shardings.params)], exp.mesh)
    for kind, axes, nbytes, _, in_node in diloco.wire(exp.diloco, local):
        got = sum(r["bytes"] for r in outer if (r["kind"], r["mesh_axes"], r["nodes"] == 1) == (kind, axes, in_node))
        assert got == pytest.approx(nbytes, rel=0.01), (kind, got, nbytes)
    assert sum(r["bytes"] for r in outer) == pytest.approx(sum(w[2] for w in diloco.wire(exp.diloco, local)), rel=0.01)
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
    ck.save(1, first, {})  # step 1 of a 2-step round
    ck.wait()
    resumed, _ = ck.restore(1, exp)
    batches = exp.train_batches(1)
    for _ in range(STEPS - 1):
        resumed, _ = compiled(resumed, exp.put_batch(next(batches)))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), history[-1][0])
    smaller = build(devices=devices_for("data:4"), **{"mesh.shape": "data:4", "diloco.every": "2"})
    fresh, _ = ck.restore(1, smaller)
    ck.close()
    assert "DiLoCo starts a new round from the outer params at step 1" in capsys.readouterr().err
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
    across = [sum(r["bytes"] for r in hlo.collective_table(c.outer, e.mesh, node_of) if r["nodes"] > 1)
              for e, c in ((exp, compiled), (exp8, compiled8))]
    local = compression.local_size([s.shape for s in jax.tree.leaves(exp.model.shapes)],
                                   [s.spec for s in jax.tree.leaves(exp.shardings.params)], exp.mesh)
    assert across[1] == pytest.approx(sum(w[2] for w in diloco.wire(exp8.diloco, local) if not w[4]), rel=0.01)
    assert 0.24 < across[1] / across[0] <= 0.27
    assert [r for r in hlo.collective_table(compiled8.inner, exp8.mesh, node_of) if r["nodes"] > 1] == []
    np.testing.assert_allclose([float(m["loss"]) for _, m in int8], [float(m["loss"]) for _, m in f32], rtol=1e-3)
    assert not np.array_equal(jax.tree.leaves(int8[-1][0].params)[0], jax.tree.leaves(f32[-1][0].params)[0])


@pytest.mark.parametrize("name,overrides,words", [
    ("gpt2_tiny_dp8_zero1", {}, ["splits the optimizer state over data", "Use dp"]),
    ("gpt2_tiny_dp8", {"train.grad_dtype": "bfloat16"}, ["train.grad_dtype", "DiLoCo replaces"]),
    ("gpt2_tiny_pp2_dp4", {"mesh.dcn": ""}, ["pipeline"]),
    ("vgg_tiny_digits_dp2", {"mesh.dcn": ""}, ["BatchNorm", "batch_norm=false"]),
    ("gpt2_tiny_dp8", {"diloco.every": "-1"}, ["integer >= 1", "0: off"]),
    ("gpt2_tiny_dp8", {"diloco.outer_momentum": "1.0"}, ["0 <= momentum < 1"]),
])
def test_what_cannot_train_apart_is_refused_with_the_fix(name, overrides, words):
    cfg = configured(name, **{"diloco.every": "4", "mesh.dcn": "data:2", **overrides})
    with pytest.raises(UserError) as e:
        Experiment.build(cfg, devices=devices_for(cfg.mesh.shape))
    for w in words:
        assert w in str(e.value), (w, str(e.value))
