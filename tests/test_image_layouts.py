"""Image classifiers under every layout compute what one device computes: 20 steps of
VGG tiny and ResNet tiny (BatchNorm included, its statistics synchronised over the
data replicas) under data, ZeRO-1, FSDP, channel tensor parallelism and spatial
partitioning, against the same config on one device, in float32.

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
# (config, overrides): each layout family on 8 simulated devices.
LAYOUTS = [
    ("dp8", {}),
    ("dp8", {"layout": "zero1"}),
    ("dp8", {"layout": "fsdp", "mesh.shape": "fsdp:8"}),
    ("dp8", {"layout": "dp_tp", "mesh.shape": "data:2,tensor:4"}),
    ("dp8", {"layout": "fsdp_tp", "mesh.shape": "fsdp:2,tensor:4"}),
    ("dp8", {"layout": "dp_spatial", "mesh.shape": "data:2,tensor:4"}),
]
MODELS = ["vgg_tiny", "resnet_tiny"]
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


@pytest.fixture(scope="module", params=MODELS)
def reference(request):
    name = f"{request.param}_dp8"
    return name, run(configured(name, **FAST[request.param]), devices=jax.devices()[:1], mesh_shape="data:1")


@pytest.mark.parametrize("suffix, overrides", LAYOUTS, ids=[o.get("layout", "dp") for _, o in LAYOUTS])
def test_layout_matches_one_device(suffix, overrides, reference, make_config):
    name, (ref_losses, ref_stats, ref_exp) = reference
    assert ref_exp.model.stats_shapes, "the tiny models have BatchNorm"
    losses, stats, exp = run(make_config(name, **FAST[name.removesuffix("_dp8")], **overrides))
    rel = np.abs(losses - ref_losses) / np.abs(ref_losses)
    assert rel.max() < 1e-5, f"{name} {overrides}: losses differ from one device, max rel {rel.max():.2e}"
    assert losses[-1] < losses[0] - 0.05, f"{name}: should be learning, {losses[0]:.3f} -> {losses[-1]:.3f}"
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), stats, ref_stats)
