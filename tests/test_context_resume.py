"""Checkpoints across context parallelism: a run saved on data:2,context:4 (dp_cp) resumes on
data:8 (dp) with the losses of an unbroken run, and a data:8 run resumes on context:4
(ring attention); `meshtrain eval` and `meshtrain sample` read a dp_cp run's checkpoint
on its own mesh and on another, with the same results.

A checkpoint holds the params and moments in model order whatever the layout: context
parallelism changes only the order activations are stored in (parallel/sequence.py), never
a weight, so restoring onto another mesh is Orbax reading each leaf into new shardings.
"""

import json

import numpy as np
import pytest

from meshtrain import eval as eval_cmd, sample
from meshtrain.run.experiment import Experiment
from meshtrain.train import main
from support.checkpoints import RUN, assert_requested_shardings, assert_same_values, build, copy, restore_both
from support.processes import losses

NAME = "gpt2_tiny_dp8"
CP = ["--config.mesh.shape=data:2,context:4", "--config.layout=dp_cp"]
CP_OVERRIDES = {"mesh.shape": "data:2,context:4", "layout": "dp_cp"}


def train(workdir, *extra):
    return main([f"--config={NAME}", *RUN, *extra, f"--workdir={workdir}"])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """20 steps on data:8, unbroken."""
    w = tmp_path_factory.mktemp("straight")
    assert train(w) == 0
    return w


@pytest.fixture(scope="module")
def cp_half(tmp_path_factory):
    """The same run on data:2,context:4 (all-gather attention), stopped after step 10."""
    w = tmp_path_factory.mktemp("cp_half")
    assert train(w, *CP, "--config.train.stop_at=10") == 0
    return w


def assert_steps_match(got, ref, steps):
    np.testing.assert_allclose([got[s] for s in steps], [ref[s] for s in steps], rtol=1e-5)


def test_context_checkpoint_resumes_on_data8_with_the_unbroken_losses(straight, cp_half, tmp_path, capsys):
    assert_steps_match(losses(cp_half), losses(straight), range(1, 11))
    w = copy(cp_half, tmp_path)
    cp, dp = Experiment.build(build(NAME, **CP_OVERRIDES)), Experiment.build(build(NAME))
    (a, _), (b, _) = restore_both(w / "checkpoints", cp, dp)
    # GPT-2's position table (length, embed) is split by rows over context under dp_cp.
    assert a.params["wpe"].sharding.spec[0] == "context" and b.params["wpe"].sharding.spec[0] is None
    assert_same_values(a, b)
    assert_requested_shardings(b, dp)

    capsys.readouterr()
    assert train(w) == 0
    out = capsys.readouterr().out
    assert "resuming from step 10" in out and "saved under layout 'dp_cp'" in out, out
    got = losses(w)
    assert sorted(got) == list(range(1, 21))
    assert_steps_match(got, losses(straight), range(11, 21))


def test_data8_checkpoint_resumes_under_ring_context_with_the_unbroken_losses(straight, tmp_path, capsys):
    w = tmp_path / "dp_half"
    assert train(w, "--config.train.stop_at=10") == 0
    capsys.readouterr()
    assert train(w, *CP, "--config.model.context_attention=ring") == 0
    assert "saved under layout 'dp'" in capsys.readouterr().out
    assert_steps_match(losses(w), losses(straight), range(11, 21))


def _eval(capsys, *args) -> dict:
    capsys.readouterr()
    assert eval_cmd.run([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_eval_of_a_context_checkpoint_on_its_mesh_and_on_data8(cp_half, tmp_path, capsys):
    own = _eval(capsys, f"--workdir={cp_half}", f"--dump_logits={tmp_path / 'cp.npz'}")
    assert own["layout"] == "dp_cp" and own["mesh"]["context"] == 4 and own["step"] == 10
    dp = _eval(capsys, f"--workdir={cp_half}", "--config.mesh.shape=data:8", "--config.layout=dp",
               f"--dump_logits={tmp_path / 'dp.npz'}")
    assert dp["mesh"]["context"] == 1 and dp["tokens"] == own["tokens"]
    assert dp["loss"] == pytest.approx(own["loss"], rel=1e-6)
    # The dumped logits are in position order under both (the model returns them natural).
    a, b = np.load(tmp_path / "cp.npz"), np.load(tmp_path / "dp.npz")
    np.testing.assert_array_equal(a["targets"], b["targets"])
    np.testing.assert_allclose(a["logits"], b["logits"], atol=1e-5 * np.abs(b["logits"]).max())


def _samples(capsys, *args) -> tuple[list[str], str]:
    capsys.readouterr()
    assert sample.run([*args, "--temperature=0", "--num_samples=3"]) == 0
    out = capsys.readouterr()
    return out.out.split(sample.SEPARATOR + "\n")[:-1], out.err


def test_sample_from_a_context_checkpoint_on_its_mesh_and_on_one_device(cp_half, capsys):
    """End to end through the CLI (decoding itself is checked against recompute with peaky
    params in test_context_decode.py)."""
    # 3 + 20 = 23 positions: the cache is rounded up to 24, 6 on each context device.
    args = [f"--workdir={cp_half}", "--prompt=3,17,42", "--max_new_tokens=20"]
    own, err = _samples(capsys, *args)
    assert "mesh data:2,context:4" in err and "layout dp_cp" in err, err
    one, err = _samples(capsys, *args, "--mesh=data:1", "--layout=dp")
    assert "mesh data:1" in err, err
    assert len(own) == 3 and own == one
