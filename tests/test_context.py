"""Long sequences: sequence parallelism (length:tensor outside attention and MLP) and context
parallelism (length:context everywhere, attention by all-gather or a load-balanced ring)
change how a step is split, never what it computes: float32 steps (support.training.STEPS)
equal one device.
"""

import jax
import numpy as np
import pytest

from meshtrain.errors import UserError
from meshtrain.parallel import sequence
from meshtrain.parallel.layouts import get
from meshtrain.run.experiment import Experiment, check_config
from support.configs import configured
from support.training import COMPARED, FULL_LR, ROWS, assert_equal_training, devices_for, run

# Llama tiny at its own 128 positions (the issue that added this test asked for 512; the
# split does not depend on the length): under context:4 the ring's zigzag still cuts each
# sequence into 8 chunks of 16, two a device, and 4 chunks of the loss (32 positions, 8
# from each context device) keep the chunked loss's share-per-piece exercised.
LLAMA = {"model.seq_len": 128, "train.loss_chunk": 32, **ROWS, **FULL_LR}


@pytest.fixture(scope="module")
def gpt2_reference(gpt2_tiny_one_device):
    return gpt2_tiny_one_device


@pytest.fixture(scope="module")
def llama_reference():
    return run("llama_tiny_dp8", LLAMA, "data:1")


# GPT-2's ring (its learned positions read in the zigzag order) is test_context_beside_fsdp's,
# on context:4, losses and gradients alike, and the pipeline's.
@pytest.mark.parametrize("layout, mesh, kind", [
    ("dp_tp_sp", "data:2,tensor:4", "allgather"),   # sequence parallelism
    ("dp_cp", "context:2", "allgather"),
])
def test_gpt2_tiny_matches_one_device(layout, mesh, kind, gpt2_reference):
    got = run("gpt2_tiny_dp8", {**COMPARED, "layout": layout, "model.context_attention": kind}, mesh)
    assert_equal_training(f"gpt2 {layout} {mesh} {kind}", got, gpt2_reference)


# Grouped-query attention (4 query heads, 2 kv heads): only the kv heads travel, and each
# device repeats them to its query heads, whether it holds all kv heads (dp_tp_cp: kv_heads
# whole) or its share of them (kv_heads split over tensor as heads are).
KV_SPLIT = "batch:data;heads:tensor;kv_heads:tensor;mlp:tensor;vocab:tensor;length:context"


@pytest.mark.parametrize("layout, mesh, kind", [
    ("dp_tp_sp", "data:2,tensor:4", "allgather"),   # sequence parallelism
    ("dp_cp", "data:2,context:4", "allgather"),
    ("dp_tp_cp", "context:4,tensor:2", "ring"),
    (KV_SPLIT, "context:4,tensor:2", "ring"),
])
def test_llama_tiny_matches_one_device(layout, mesh, kind, llama_reference):
    got = run("llama_tiny_dp8", {**LLAMA, "layout": layout, "model.context_attention": kind}, mesh)
    assert_equal_training(f"llama {layout} {mesh} {kind}", got, llama_reference)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_context_inside_pipeline_stages(schedule, gpt2_reference):
    """`context` and `stage` combine: the stages' attention runs the ring per stage, and
    1F1B's loss reads its targets in the layout's order (5 steps)."""
    over = {**COMPARED, "layout": "dp_pp_cp", "model.context_attention": "ring", "pipeline.schedule": schedule,
            "pipeline.microbatches": 2, "train.loss_chunk": 32}
    got = run("gpt2_tiny_dp8", over, "stage:2,context:2,data:2", steps=5)
    ref_losses, _ = gpt2_reference
    np.testing.assert_allclose(got[0], ref_losses[:5], rtol=1e-5)


def test_context_beside_fsdp(gpt2_reference):
    """fsdp_cp: weights stored over fsdp, gathered per layer, sequences split over context
    by the ring."""
    got = run("gpt2_tiny_dp8", {**COMPARED, "layout": "fsdp_cp", "model.context_attention": "ring"}, "fsdp:2,context:4")
    assert_equal_training("gpt2 fsdp_cp fsdp:2,context:4 ring", got, gpt2_reference)


def test_zigzag_order_balances_the_causal_work():
    """Device i holds chunks i and 2n-1-i: every device's rows see the same number of keys."""
    order = sequence.balanced(16, 4)
    assert order.tolist()[:4] == [0, 1, 14, 15] and order.tolist()[-4:] == [6, 7, 8, 9]
    visible = [(rows[:, None] >= np.arange(16)[None]).sum() for rows in order.reshape(4, 4)]
    assert len(set(visible)) == 1, visible
    assert sorted(order.tolist()) == list(range(16))


def test_an_indivisible_sequence_is_refused_with_the_fix():
    cfg = configured("gpt2_tiny_dp8", **{"layout": "dp_cp", "model.seq_len": 100})
    mesh = jax.sharding.AbstractMesh((1, 1, 1, 4, 1, 1), ("data", "stage", "fsdp", "context", "expert", "tensor"))
    with pytest.raises(UserError, match=r"seq_len=100 cannot be split over context=4: .* 8 does not divide "
                                        r"100. Use a seq_len divisible by 8"):
        check_config(cfg, mesh)
    cfg = configured("gpt2_tiny_dp8", **{"layout": "dp_cp", "train.loss_chunk": 2})
    with pytest.raises(UserError, match=r"loss_chunk must be a multiple of 4"):
        check_config(cfg, mesh)


def test_an_unknown_context_attention_is_refused_with_the_choices():
    cfg = configured("gpt2_tiny_dp8", **{"layout": "dp_cp", "model.context_attention": "rign"})
    mesh = jax.sharding.AbstractMesh((1, 1, 1, 4, 1, 1), ("data", "stage", "fsdp", "context", "expert", "tensor"))
    with pytest.raises(UserError, match=r"model.context_attention='rign' is not a way to attend across a "
                                        r"split sequence. Choose one of: allgather, ring"):
        check_config(cfg, mesh)


@pytest.mark.parametrize("layout, mesh, message", [
    ("batch:data;length:context;head_dim:tensor", "context:2,tensor:2",
     r"splits heads and positions, not the head width; this layout splits head_dim"),
    ("batch:data;length:context;heads:tensor;kv_heads:fsdp", "fsdp:2,context:2,tensor:2",
     r"needs kv_heads split as heads are, or not at all; this layout splits heads by tensor and "
     r"kv_heads by fsdp"),
])
def test_context_attention_refuses_splits_it_cannot_run(layout, mesh, message):
    """Refused when the step is traced, before anything runs (Llama tiny: 4 heads, 2 kv)."""
    cfg = configured("llama_tiny_dp8", **{"layout": layout, "mesh.shape": mesh})
    exp = Experiment.build(cfg, devices=devices_for(mesh))
    with pytest.raises(UserError, match=message):
        exp.compile()


def test_sequence_parallelism_leaves_attention_whole():
    """dp_tp_sp's `length:tensor` splits the residual stream, never attention's positions."""
    shape = {"data": 2, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 4}
    sp = get("dp_tp_sp")
    assert sp.spec(("batch", "length", "embed"), "activations")[1] == "tensor"
    assert sequence.split(sp, shape) == (1, ())
    assert sequence.split(get("dp_tp_cp"), {**shape, "context": 2}) == (2, ("context",))
