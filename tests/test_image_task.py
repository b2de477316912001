"""The classify task through the commands: exact resume with BatchNorm statistics in the
checkpoint (also onto another layout), meshtrain eval of an image run, and the refusals
(pipelines over unlike layers, a per-replica gradient reduction with BatchNorm)."""

import json

import pytest

from meshtrain.errors import UserError
from meshtrain.eval import main as eval_main
from meshtrain.run.experiment import Experiment
from meshtrain.train import main

STEPS = "--config.train.steps=8"
COMMON = [STEPS, "--config.train.log_every=1", "--config.train.eval_every=4", "--config.train.eval_steps=1"]


def train(workdir, *extra, name="resnet_tiny_dp8"):
    return main([f"--config={name}", f"--workdir={workdir}", *COMMON, *extra])


def rows(workdir) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    w = tmp_path_factory.mktemp("straight")
    assert train(w) == 0
    return w


def test_resume_with_batchnorm_statistics_is_exact(straight, tmp_path, capsys):
    """Stopped at step 4 and resumed (on dp_spatial: the statistics restore onto any
    layout), the losses and accuracies of steps 5-8 and the eval at step 8 are the
    unbroken run's. Without the running statistics in the checkpoint, the eval (which
    normalises with them) would differ."""
    assert train(tmp_path, "--config.train.stop_at=4") == 0
    assert train(tmp_path, "--config.layout=dp_spatial", "--config.mesh.shape=data:2,tensor:4") == 0
    a, b = rows(straight), rows(tmp_path)
    for step in range(5, 9):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5)
        assert b[step]["top1"] == a[step]["top1"]
    evals_a = [json.loads(r) for r in (straight / "metrics.jsonl").read_text().splitlines() if "eval_loss" in r]
    evals_b = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines() if "eval_loss" in r]
    assert evals_b[-1]["step"] == 8
    assert evals_b[-1]["eval_loss"] == pytest.approx(evals_a[-1]["eval_loss"], rel=1e-5)
    assert "images_per_s" in b[8] and "tokens_per_s" not in b[8]
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["task"] == "classify" and run["images_per_step"] == 32 and run["flops_per_image"] > 0


def test_eval_reads_the_statistics_and_reports_accuracy(straight, capsys):
    capsys.readouterr()
    assert eval_main([f"--workdir={straight}", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    last = [json.loads(r) for r in (straight / "metrics.jsonl").read_text().splitlines() if "eval_loss" in r][-1]
    assert out["loss"] == pytest.approx(last["eval_loss"], rel=1e-5)  # the training eval's batch
    assert 0.0 <= out["top1"] <= out["top5"] <= 1.0


def test_dump_logits_is_refused_for_a_classifier(straight, tmp_path, capsys):
    capsys.readouterr()
    assert eval_main([f"--workdir={straight}", f"--dump_logits={tmp_path / 'l.npz'}"]) == 2
    err = capsys.readouterr().err
    assert "--dump_logits writes a language model's logits; resnet is a classify model" in err
    assert "Leave --dump_logits out" in err and "Traceback" not in err


def test_pipelines_are_refused_for_unlike_layers(make_config):
    cfg = make_config("vgg_tiny_dp8", **{"layout": "dp_pp", "mesh.shape": "data:4,stage:2",
                                         "pipeline.microbatches": 4})
    with pytest.raises(UserError, match=r"model.name='vgg' cannot be pipelined: .* no such stack"):
        Experiment.build(cfg)


def test_grad_dtype_is_refused_with_batchnorm(make_config):
    with pytest.raises(UserError, match=r"train.grad_dtype='bfloat16' with model.name='resnet'.*BatchNorm"):
        Experiment.build(make_config("resnet_tiny_dp8", **{"train.grad_dtype": "bfloat16"}))


def test_accumulation_with_batchnorm_matches_one_device(make_config):
    """grad_accum_steps=2 with BatchNorm: XLA reduces each microbatch's gradients (no
    per-replica statistics), so eight devices equal one."""
    import jax
    import numpy as np

    from support.training import ROWS, loss_curve

    def losses(cfg, **kw):  # four steps, compiled with the planner's analysis options (3-4x faster)
        exp = Experiment.build(cfg, **kw)
        return loss_curve(exp, 4, exp.compile(analysis=True))
    over = {"train.grad_accum_steps": 2, "optim.warmup_steps": 0, **ROWS}  # a row a replica a microbatch
    many = losses(make_config("resnet_tiny_dp8", **over))
    one = losses(make_config("resnet_tiny_dp8", **over), devices=jax.devices()[:1], mesh_shape="data:1")
    np.testing.assert_allclose(many, one, rtol=1e-5)


def test_eval_scores_every_digit_once(tmp_path, capsys):
    """The digits' 359 test images in 6 batches of 64: the 25 padding rows are not scored,
    and the eval says 359 images."""
    assert main(["--config=vgg_tiny_digits_dp2", f"--workdir={tmp_path}", "--config.train.steps=2",
                 "--config.train.eval_every=0", "--config.mesh.shape=data:8"]) == 0
    capsys.readouterr()
    assert eval_main([f"--workdir={tmp_path}", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["images"] == 359 and out["batches"] == 6
    assert "359 images in 6 batches" in captured.err
