"""Layouts change how the step is split over devices, never what it computes.

Each tiny layout on 8 fake devices is compared with the same config on one device.
"""

import jax
import numpy as np
import pytest

from meshtrain import pipeline, step as step_lib
from meshtrain.experiment import Experiment

LAYOUTS = ["gpt2_tiny_dp8", "gpt2_tiny_fsdp8", "gpt2_tiny_dp8_zero1", "gpt2_tiny_dp8_zero2", "gpt2_tiny_dp2_tp4",
           "gpt2_tiny_dp2_fsdp2_tp2", "gpt2_tiny_dp2_pp2_tp2", "gpt2_tiny_pp2_dp4"]
STEPS = 20


def losses_and_grads(cfg, devices=None, mesh_shape=None, steps=STEPS):
    """Loss of each of `steps` steps, and the gradients at step 1 (gathered to host)."""
    exp = Experiment.build(cfg, devices=devices, mesh_shape=mesh_shape)
    state = exp.init_state()
    batches = exp.train_batches()
    first = exp.put_batch(next(batches))
    loss_fn = step_lib.make_loss_fn(exp.model, exp.layout, exp.mesh)
    grad_fn = jax.jit(jax.grad(lambda p, b: loss_fn(p, b, None)),
                      in_shardings=(exp.shardings.params, exp.batch_sharding))
    grads = jax.device_get(grad_fn(state.params, first))
    if exp.model.pipeline is not None:  # compare in model layer order
        grads[exp.model.stacked] = pipeline.from_stages(grads[exp.model.stacked], exp.model.pipeline)
    losses = []
    state, metrics = exp.train_step(state, first)
    losses.append(float(metrics["loss"]))
    for _ in range(steps - 1):
        state, metrics = exp.train_step(state, exp.put_batch(next(batches)))
        losses.append(float(metrics["loss"]))
    return np.array(losses), grads


def assert_same_training(name, result, reference):
    """Losses of every step within 1e-4 (relative), the model learning, and the first
    step's gradients within float tolerance, of a layout against one device."""
    (losses, grads), (ref_losses, ref_grads) = result, reference
    rel = np.abs(losses - ref_losses) / np.abs(ref_losses)
    assert rel.max() < 1e-4, f"{name}: loss sequence differs, max rel diff {rel.max():.2e}"
    assert losses[-1] < losses[0] - 0.5, f"{name}: the model should be learning over 20 steps"
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6), grads, ref_grads)


@pytest.fixture(scope="module")
def reference(request):
    from meshtrain import config as config_lib
    cfg = config_lib.load("gpt2_tiny_dp8")
    return losses_and_grads(cfg, devices=jax.devices()[:1], mesh_shape="data:1")


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_device(name, make_config, reference):
    assert_same_training(name, losses_and_grads(make_config(name)), reference)


def test_microbatches_match_full_batch(make_config, reference):
    """Gradient accumulation over 4 microbatches gives the full-batch result."""
    ref_losses, _ = reference
    losses, _ = losses_and_grads(make_config("gpt2_tiny_dp2_tp4", **{"train.grad_accum_steps": 4}), steps=5)
    np.testing.assert_allclose(losses, ref_losses[:5], rtol=1e-4)


@pytest.mark.parametrize("name, overrides", [
    ("gpt2_tiny_pp2_dp4", {"layout": "zero2_pp"}),
    ("gpt2_tiny_pp2_dp4", {"layout": "zero2_pp", "model.scan_layers": "false", "model.remat": "full"}),
    ("gpt2_tiny_dp8_zero2", {"model.scan_layers": "false", "model.remat": "save_dots"}),
])
def test_zero2_variants_match_one_device(name, overrides, make_config, reference):
    """ZeRO-2's in-scan reduce-scatter under the pipeline's stage runner, unrolled layers
    and remat."""
    assert_same_training(f"{name} {overrides}", losses_and_grads(make_config(name, **overrides)), reference)


def test_zero2_microbatches_match_full_batch(make_config, reference):
    """ZeRO-2 accumulates split gradients over 4 microbatches: the full-batch result."""
    ref_losses, _ = reference
    losses, _ = losses_and_grads(make_config("gpt2_tiny_dp8_zero2", **{"train.grad_accum_steps": 4}), steps=5)
    np.testing.assert_allclose(losses, ref_losses[:5], rtol=1e-4)
