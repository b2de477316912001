"""Expert parallelism changes where experts run, never what they compute: Mixtral tiny
trains float32 steps (support.training.STEPS) equal to one device under expert, expert x
data x tensor and fsdp layouts, dropless and with capacity buffers (which drop per
sequence, so a layout never changes which tokens drop).

Every run here is 16 rows of 32 positions (the tiny config's 32 of 128): still two rows
a device on 8 devices and 512 tokens routed over 4 experts a step, an eighth of the
config's work, so the runs cost their compiles, not their steps."""

import jax
import numpy as np
import pytest

from support.training import FULL_LR, STEPS, assert_equal_training, run as run_any

SMALL = {"model.seq_len": 32, "train.batch_size": 16, **FULL_LR}
CAPACITY = {"moe.dispatch": "capacity", "moe.capacity_factor": 2.0}  # drops nothing here
DROPPING = {"moe.dispatch": "capacity", "moe.capacity_factor": 1.0}


def run(name, overrides, mesh, steps=STEPS):
    """support.training.run at SMALL's size: (losses [steps], first-step gradients)."""
    return run_any(name, {**SMALL, **overrides}, mesh, steps=steps)


@pytest.fixture(scope="module")
def reference():
    return {"dropless": run("mixtral_tiny_dp8", {}, "data:1"),
            "capacity": run("mixtral_tiny_dp8", CAPACITY, "data:1")}


@pytest.mark.parametrize("layout, mesh", [
    ("dp_ep", "expert:4"),
    ("dp_ep_tp", "expert:2,data:2,tensor:2"),
    ("fsdp_ep", "fsdp:2,expert:4"),
    ("fsdp", "fsdp:8"),
])
def test_dropless_matches_one_device(layout, mesh, reference):
    got = run("mixtral_tiny_dp8", {"layout": layout}, mesh)
    assert_equal_training(f"dropless {layout} {mesh}", got, reference["dropless"])


@pytest.mark.parametrize("layout, mesh", [("dp_ep", "expert:4"), ("dp_ep_tp", "expert:2,data:2,tensor:2")])
def test_capacity_matches_one_device(layout, mesh, reference):
    got = run("mixtral_tiny_dp8", {"layout": layout, **CAPACITY}, mesh)
    assert_equal_training(f"capacity {layout} {mesh}", got, reference["capacity"])
    # With room for every copy, capacity computes what dropless does.
    np.testing.assert_allclose(got[0], reference["dropless"][0], rtol=1e-5)


def test_dropping_capacity_matches_one_device_and_differs_from_dropless(reference):
    one = run("mixtral_tiny_dp8", DROPPING, "data:1")
    split = run("mixtral_tiny_dp8", {"layout": "dp_ep", **DROPPING}, "expert:4,data:2")
    rel = np.abs(split[0] - one[0]) / one[0]
    assert rel.max() < 1e-5, f"dropping capacity: loss differs across layouts, max rel {rel.max():.2e}"
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6), split[1], one[1])
    assert np.abs(one[0] - reference["dropless"][0]).max() > 1e-5  # dropped copies change the loss


def test_dropless_under_gradient_accumulation():
    """Accumulation vmaps the loss over the data replicas (grad_reduce.per_replica), so the
    grouped matmul's windows run batched over them (moe_dropless.swiglu_grouped), and so
    does moe.grouped_matmul=ragged_dot (models/moe_ragged.py, whose batching JAX's own
    ragged_dot refuses). With the router losses off (theirs is a product of means over a
    microbatch) two microbatches train as one batch, windowed or ragged_dot alike."""
    off = {"layout": "dp_ep", "moe.aux_loss_coef": 0.0, "moe.z_loss_coef": 0.0}
    whole = run("mixtral_tiny_dp8", off, "data:2,expert:4")
    for mode in ("windowed", "ragged_dot"):
        split = run("mixtral_tiny_dp8", {**off, "train.grad_accum_steps": 2, "moe.grouped_matmul": mode},
                    "data:2,expert:4")
        rel = np.abs(split[0] - whole[0]) / whole[0]
        assert rel.max() < 1e-5, f"accumulated dropless, {mode}: max rel diff {rel.max():.2e}"
        jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6), split[1], whole[1])


def test_shared_experts_match_one_device():
    """An always-on shared expert (its mlp split over tensor like a dense MLP's) beside the
    routed ones."""
    shared = {"model.num_shared_experts": 1}
    one = run("mixtral_tiny_dp8", shared, "data:1")
    split = run("mixtral_tiny_dp8", {"layout": "dp_ep_tp", **shared}, "expert:2,data:2,tensor:2")
    rel = np.abs(split[0] - one[0]) / one[0]
    assert rel.max() < 1e-5, f"shared experts: max rel diff {rel.max():.2e}"
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6), split[1], one[1])
    assert "shared_gate" in split[1]["blocks"]["moe"]


def test_experts_split_where_tokens_are_not(reference):
    """A layout may split the experts over an axis that does not split the tokens: each
    device then runs its own experts on every token and the outputs are summed over that
    axis (parallel/experts.owned_experts), still one device's training."""
    got = run("mixtral_tiny_dp8", {"layout": "batch:data;experts:expert"}, "data:2,expert:4")
    ref_losses, ref_grads = reference["dropless"]
    rel = np.abs(got[0] - ref_losses) / ref_losses
    assert rel.max() < 1e-5, f"experts split, tokens not: max rel diff {rel.max():.2e}"
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6), got[1], ref_grads)
