"""Image classifiers under every layout compute what one device computes: 20 steps of
VGG tiny and ResNet tiny (BatchNorm included, its statistics synchronised over the
data replicas) under data, ZeRO-1, FSDP, channel tensor parallelism and spatial
partitioning (each on one model or both: CASES), against the same config on one device,
in float32.

Each layout's train step compiles with the planner's analysis options
(compile_options.ANALYSIS_OPTIONS): the same partitioned HLO, collectives included, with
LLVM's optimisations and XLA:CPU's fusion emitters off. Compiling is most of each test
(3.3 -> 0.5 s of CPU for VGG tiny under fsdp_tp); the 20 tiny steps run 0.7 s slower."""

import jax
import numpy as np
import pytest

from meshtrain.run.experiment import Experiment
from support.configs import configured
from support.training import ROWS, stepped

STEPS = 20
LAYOUTS = {  # each layout family on 8 simulated devices
    "dp": {},
    "zero1": {"layout": "zero1"},
    "fsdp": {"layout": "fsdp", "mesh.shape": "fsdp:8"},
    "dp_tp": {"layout": "dp_tp", "mesh.shape": "data:2,tensor:4"},
    "fsdp_tp": {"layout": "fsdp_tp", "mesh.shape": "fsdp:2,tensor:4"},
    "dp_spatial": {"layout": "dp_spatial", "mesh.shape": "data:2,tensor:4"},
}
# (model, layout): every layout once, and on both models what is the model's own, not
# every pair. Spatial partitioning on both (VGG halves its maps by pooling, ResNet by
# strided convolutions: different halos); channel tensor parallelism on both (VGG's plain
# stack and dense head, ResNet's residual adds and projections), once beside data and once
# beside FSDP; data parallelism, ZeRO-1 and FSDP shard the batch, the optimizer state and
# the parameters whatever the model computes, so each runs on one (VGG's ZeRO-1 is its
# data-parallel step with a sharded update). Every case splits the batch, so BatchNorm
# synchronises its statistics in each.
CASES = [("vgg_tiny", "zero1"), ("vgg_tiny", "fsdp_tp"), ("vgg_tiny", "dp_spatial"),
         ("resnet_tiny", "dp"), ("resnet_tiny", "fsdp"), ("resnet_tiny", "dp_tp"), ("resnet_tiny", "dp_spatial")]
# SGD with momentum at a constant lr 0.2, no warm-up: both tiny models learn within 20
# steps (VGG's small-init classifier slowly, ResNet fast). Not Adam: its m / sqrt(v) turns
# float32 rounding in near-zero gradients into whole-size updates, so any two summation
# orders (one device against eight) drift apart to ~1e-4 in 20 steps whatever the layout.
# ResNet learns at 0.05 already; at 0.2 its steps are large enough that rounding grows
# to ~1e-3 in 20 steps even between one device and eight-way data parallelism.
FAST = {"vgg_tiny": {"optim.lr": 0.2, "optim.warmup_steps": 0, "optim.schedule": "constant", **ROWS},
        "resnet_tiny": {"optim.lr": 0.05, "optim.warmup_steps": 0, "optim.schedule": "constant"}}


def run(cfg, devices=None, mesh_shape=None):
    """The loss and top-1 of each step, and the BatchNorm statistics after the last."""
    exp = Experiment.build(cfg, devices=devices, mesh_shape=mesh_shape)
    losses = []
    for state, metrics in stepped(exp, STEPS, step=exp.compile(analysis=True)):
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state.stats), exp


@pytest.fixture(scope="module")
def reference():
    """model -> its one-device run, each run once and only for the cases that use it."""
    runs = {}

    def get(model):
        if model not in runs:
            runs[model] = run(configured(f"{model}_dp8", **FAST[model]), devices=jax.devices()[:1],
                              mesh_shape="data:1")
        return runs[model]
    return get


@pytest.mark.parametrize("model, layout", CASES, ids=[f"{m}-{l}" for m, l in CASES])
def test_layout_matches_one_device(model, layout, reference, make_config):
    ref_losses, ref_stats, ref_exp = reference(model)
    assert ref_exp.model.stats_shapes, "the tiny models have BatchNorm"
    name, overrides = f"{model}_dp8", LAYOUTS[layout]
    losses, stats, exp = run(make_config(name, **FAST[model], **overrides))
    rel = np.abs(losses - ref_losses) / np.abs(ref_losses)
    assert rel.max() < 1e-5, f"{name} {overrides}: losses differ from one device, max rel {rel.max():.2e}"
    assert losses[-1] < losses[0] - 0.05, f"{name}: should be learning, {losses[0]:.3f} -> {losses[-1]:.3f}"
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), stats, ref_stats)
