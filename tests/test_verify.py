"""`meshtrain plan --verify`: a layout against one device, on a shrunk model.

Each check compiles two tiny train steps (the layout's and the one-device reference) on
the 8 fake CPU devices conftest.py gives every test process.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain import config as config_lib, mesh as mesh_lib, plan
from meshtrain.errors import UserError
from meshtrain.parallel import grad_reduce
from meshtrain.run import verify
from meshtrain.run.experiment import abstract_mesh, validate, read_inputs

STEPS = 2


def _verify(make_config, name, **overrides):
    return verify.run(name, make_config(name, **overrides), steps=STEPS, say=lambda *a: None)


def _assert_agrees(r):
    assert r["ok"], verify.render(r)
    assert len(r["steps"]) == STEPS and r["mismatched_params"] == [] and r["mismatched_steps"] == []
    assert r["max_loss_rel_diff"] <= verify.TOLERANCE and r["max_grad_rel_error"] <= verify.TOLERANCE
    # every parameter is compared, and the gradients are not all zero
    assert {g["param"] for g in r["gradients"]} >= {"wte", "blocks/attn/w_qkv", "blocks/mlp/w_fc"}
    assert all(g["reference_max_abs"] > 0 for g in r["gradients"])


def test_cli_passes_tensor_parallelism(capsys, monkeypatch):
    """The command: progress, the loss table, a line per parameter, the verdict, status 0.
    Its compile flags go into XLA_FLAGS, which later tests' subprocesses would inherit:
    restored after."""
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    assert plan.main(["--config=gpt2_tiny_dp2_tp4", "--verify", f"--steps={STEPS}"]) == 0
    out = capsys.readouterr().out
    assert "compiling the one-device reference" in out and "compiling the layout's train step on 8" in out
    assert "shrunk to 2 layers, 4 heads" in out  # heads stay divisible by tensor=4
    assert "blocks/attn/w_qkv" in out and "verify: PASS" in out and "differs" not in out


def test_pipeline_passes(make_config):
    r = _verify(make_config, "gpt2_tiny_pp2_dp4")
    _assert_agrees(r)
    assert r["shrunk"]["num_layers"] % 2 == 0 and r["devices"] == 8


def test_hand_written_layout_passes(make_config):
    """A layout string, not a preset, with the loss in chunks and accumulation: every
    hand-written reduction of the step is on the path."""
    r = _verify(make_config, "gpt2_tiny_dp2_fsdp2_tp2",
                layout="batch:data+fsdp;heads:tensor;mlp:tensor | params=embed:fsdp;heads:tensor;mlp:tensor",
                **{"train.grad_accum_steps": 2, "train.loss_chunk": 32})
    _assert_agrees(r)
    assert r["layout"].startswith("params=embed:fsdp;heads:tensor;mlp:tensor")
    assert r["shrunk"]["loss_chunk"] == r["shrunk"]["seq_len"] // 2


BROKEN = "blocks/mlp/w_fc"


def test_a_reduction_that_skips_the_data_axis_is_caught(capsys, monkeypatch):
    """A real numerical break: the by-hand gradient reduction over the data replicas
    (meshtrain/parallel/grad_reduce.py, taken with train.grad_accum_steps > 1) keeps replica 0's
    gradient of one parameter instead of the mean over all 8. One device has one replica,
    so only the layout's run is wrong; verify names that parameter alone, and the losses
    after the first update."""
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    right = grad_reduce.reduce

    def skips_data_for_one_leaf(grads_n, dtypes, params):
        out = right(grads_n, dtypes, params)
        block = grads_n["blocks"]["mlp"]["w_fc"]
        out["blocks"]["mlp"]["w_fc"] = block[0].astype(jnp.float32)  # no sum over the replicas
        return out
    monkeypatch.setattr(grad_reduce, "reduce", skips_data_for_one_leaf)
    status = plan.main(["--config=gpt2_tiny_dp8", "--config.train.grad_accum_steps=2", "--verify", "--steps=3"])
    out = capsys.readouterr().out
    assert status == 1, out
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith(f"verify: FAIL: gradients differ for {BROKEN} (largest error first)"), verdict
    assert "the loss differs at step(s) 2, 3" in verdict
    flagged = [line.split("|")[0].strip() for line in out.splitlines() if line.endswith("<- differs")]
    assert flagged == ["2", "3", BROKEN]  # the loss rows, then the one parameter


@pytest.mark.parametrize("name", config_lib.available())
def test_every_shipped_config_shrinks_to_a_model_its_layout_divides(name):
    """No devices: the shrunk config and its reference validate on their meshes, and the
    shrunk dims are no larger than the tiny model's."""
    cfg = config_lib.load(name)
    shape = mesh_lib.parse_shape(cfg.mesh.shape)
    small, dims = verify.shrink(cfg, shape)
    validate(small, abstract_mesh(shape), read_inputs(small))
    ref = verify.reference(small)
    validate(ref, abstract_mesh(mesh_lib.parse_shape(ref.mesh.shape)), read_inputs(ref))
    assert small.model.dtype == "float32"
    if "size" in dims:  # an image family runs its tiny size
        assert dims["size"] == small.model.size == "tiny"
    else:
        assert dims["embed_dim"] <= 64 and dims["seq_len"] <= 32


@pytest.mark.parametrize("overrides, says", [
    ({"layout": "batch:data;heads"}, "heads"),  # a rule without ':mesh_axis'
    ({"mesh.shape": "data:-1"}, "size -1"),
    ({"mesh.shape": "data:16"}, "needs 16 devices, but this process has 8"),
    ({"mesh.shape": "data:512"}, "simulates at most 256"),
])
def test_user_errors(make_config, overrides, says):
    with pytest.raises(UserError, match=says):
        _verify(make_config, "gpt2_tiny_dp8", **overrides)


def test_steps_go_with_verify(capsys):
    assert plan.main(["--config=gpt2_tiny_dp8", "--steps=2"]) == 2
    assert "--steps goes with --verify" in capsys.readouterr().err


def test_a_nan_gradient_fails_and_sorts_first():
    ref = {"a": np.array([1.0, -2.0]), "b": np.array([0.0, 0.0]), "c": np.array([1.0, 1.0])}
    got = {"a": np.array([1.0, -2.0 + 2e-6]), "b": np.array([0.0, 0.0]), "c": np.array([np.nan, 1.0])}
    rows = verify.compare_gradients(got, ref)
    assert [r["param"] for r in rows] == ["c", "a", "b"]
    assert rows[0]["rel_error"] > verify.TOLERANCE and rows[1]["rel_error"] == pytest.approx(1e-6)
    assert rows[2]["rel_error"] == 0.0
