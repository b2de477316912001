"""Layouts change how the step is split over devices, never what it computes.

Each tiny layout on 8 fake devices is compared with the same config on one device: the
losses of support.training.STEPS steps at the full learning rate and step 1's gradients,
which the layout's side reads off its train step (`trained`) against one device's plain
jax.grad (the session fixture gpt2_tiny_one_device).
"""

import numpy as np
import pytest

from support.training import COMPARED, assert_same_training, trained


LAYOUTS = ["gpt2_tiny_dp8", "gpt2_tiny_fsdp8", "gpt2_tiny_dp8_zero1", "gpt2_tiny_dp8_zero2", "gpt2_tiny_dp2_tp4",
           "gpt2_tiny_dp2_fsdp2_tp2", "gpt2_tiny_dp2_pp2_tp2", "gpt2_tiny_pp2_dp4"]


@pytest.fixture(scope="module")
def reference(gpt2_tiny_one_device):
    return gpt2_tiny_one_device


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_device(name, make_config, reference):
    assert_same_training(name, trained(make_config(name, **COMPARED)), reference)


def test_microbatches_match_full_batch(make_config, reference):
    """Gradient accumulation over 4 microbatches gives the full-batch result."""
    ref_losses, _ = reference
    losses, _ = trained(make_config("gpt2_tiny_dp2_tp4", **COMPARED, **{"train.grad_accum_steps": 4}), steps=5)
    np.testing.assert_allclose(losses, ref_losses[:5], rtol=1e-4)


@pytest.mark.parametrize("name, overrides", [
    ("gpt2_tiny_pp2_dp4", {"layout": "zero2_pp"}),
    ("gpt2_tiny_pp2_dp4", {"layout": "zero2_pp", "model.scan_layers": "false", "model.remat": "full"}),
    ("gpt2_tiny_dp8_zero2", {"model.scan_layers": "false", "model.remat": "save_dots"}),
])
def test_zero2_variants_match_one_device(name, overrides, make_config, reference):
    """ZeRO-2's in-scan reduce-scatter under the pipeline's stage runner, unrolled layers
    and remat."""
    assert_same_training(f"{name} {overrides}", trained(make_config(name, **COMPARED, **overrides)), reference)


def test_zero2_microbatches_match_full_batch(make_config, reference):
    """ZeRO-2 accumulates split gradients over 2 microbatches (of 1 row a replica): the
    full-batch result."""
    ref_losses, _ = reference
    losses, _ = trained(make_config("gpt2_tiny_dp8_zero2", **COMPARED, **{"train.grad_accum_steps": 2}), steps=5)
    np.testing.assert_allclose(losses, ref_losses[:5], rtol=1e-4)
