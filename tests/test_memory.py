"""Compiled per-device state bytes against the ZeRO formulas.

With fp32 params and Adam, the live state is 12 bytes per parameter (param, mu, nu):
  dp8    12 Psi per device
  zero1  4 Psi + 8 Psi / 8  (moments sharded over data, params replicated)
  zero2  4 Psi + 8 Psi / 8  (as zero1: ZeRO-2 splits the gradients, which live in the step)
  fsdp8  12 Psi / 8         (everything sharded)
The compiled step's argument bytes are that state, plus the batch shard and two
int32 counters (the step, Adam's and the schedule's). ZeRO-2's split gradients show in
XLA's temp bytes, against zero1's (test_zero2_gradient_buffer_is_split).
Every step is compiled only to be read, with the planner's analysis options
(Experiment.compile(analysis=True): the same HLO and buffers, 3x faster to compile).
"""

import math
import re

import jax
import pytest

from meshtrain.models.stack import is_matrix
from meshtrain.parallel.layouts.rules import mesh_axes_of
from meshtrain.run.experiment import Experiment
from support.configs import configured


def state_bytes(exp):
    """Per-device bytes of params + optimizer state in the compiled step's arguments."""
    compiled = exp.compile(analysis=True)
    args = compiled.memory_analysis().argument_size_in_bytes
    batch = math.prod(exp.batch_shape) * 4 // exp.mesh.shape["data"] // exp.mesh.shape["fsdp"]
    # Replicated: the int32 counters (TrainState.step, Adam's count, the lr schedule's
    # count) and the [2] uint32 PRNG key data.
    state = exp.abstract_state()
    small = sum(4 for leaf in jax.tree.leaves(state) if leaf.shape == ()) + state.rng.size * 4
    return args - batch - small


@pytest.fixture(scope="module")
def psi():
    from meshtrain import config as config_lib
    exp = Experiment.build(config_lib.load("gpt2_tiny_dp8"))
    return exp.num_stored_params()


@pytest.mark.parametrize("name, formula", [
    ("gpt2_tiny_dp8", lambda psi: 12 * psi),
    ("gpt2_tiny_dp8_zero1", lambda psi: 4 * psi + 8 * psi // 8),
    ("gpt2_tiny_dp8_zero2", lambda psi: 4 * psi + 8 * psi // 8),
    ("gpt2_tiny_fsdp8", lambda psi: 12 * psi // 8),
])
def test_state_bytes_match_zero_formulas(name, formula, make_config, psi):
    exp = Experiment.build(make_config(name))
    assert state_bytes(exp) == formula(psi)


def test_fsdp8_is_one_eighth_of_dp8(make_config):
    dp = state_bytes(Experiment.build(make_config("gpt2_tiny_dp8")))
    fsdp = state_bytes(Experiment.build(make_config("gpt2_tiny_fsdp8")))
    assert fsdp * 8 == dp


def test_tensor_parallel_state_matches_sharded_leaves(make_config):
    """dp2 x tp4: each leaf divided by the shards its spec names, times 3 (param, mu, nu)."""
    exp = Experiment.build(make_config("gpt2_tiny_dp2_tp4"))
    expected = 0
    for shape, sharding in zip(jax.tree.leaves(exp.model.shapes), jax.tree.leaves(exp.shardings.params)):
        shards = math.prod(exp.mesh.shape[a] for s in sharding.spec for a in mesh_axes_of(s))
        expected += 3 * 4 * math.prod(shape.shape) // shards
    assert state_bytes(exp) == expected


# Wide enough that the stacked gradient outweighs the activations' share of temp; bf16
# compute, whose cast to the compute dtype (step.make_cast) pins zero1's matrix gradients
# whole (with fp32 compute nothing does, and XLA propagates the optimizer's split into the
# layer scan for zero1 too: the two compile to the same temp bytes).
WIDE = {"model.embed_dim": 256, "model.mlp_dim": 1024, "model.num_layers": 4, "model.seq_len": 32,
        "train.batch_size": 8, "model.dtype": "bfloat16"}


def backward_scan_writes(compiled) -> set[tuple[int, ...]]:
    """Shapes of the arrays the backward layer scan writes each layer's gradient into (the
    dynamic-update-slices of its transposed while body): the stacked gradient buffers."""
    shapes = set()
    for line in compiled.as_text().splitlines():
        if " dynamic-update-slice(" in line and "transpose(jvp())/while/body" in line:
            dims = re.search(r"= [a-z0-9]+\[([0-9,]*)\]", line).group(1)
            shapes.add(tuple(int(d) for d in dims.split(",") if d))
    return shapes


@pytest.fixture(scope="module")
def wide(request):
    out = {}
    for layout in ("zero1", "zero2"):
        exp = Experiment.build(configured("gpt2_tiny_dp8", **{**WIDE, "layout": layout}))
        out[layout] = (exp, exp.compile(analysis=True))
    return out


def test_zero2_gradient_buffer_is_split(wide):
    """zero1 keeps every stacked matrix gradient [layers, ...] whole until the backward pass
    ends; zero2 writes each layer's gradient split 8 ways inside the scan, so its temp is
    (1 - 1/8) x the matrices' stacked gradient bytes (compute dtype) below zero1's."""
    exp = wide["zero2"][0]
    blocks = exp.model.shapes[exp.model.stacked]
    axes = exp.model.axes[exp.model.stacked]
    matrices = [(s.shape, a) for s, a in zip(jax.tree.leaves(blocks),
                                             jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)))
                if is_matrix(a)]
    whole = {shape for shape, _ in matrices}
    split = {tuple(d // 8 if e else d for d, e in zip(shape, exp.layout.spec(a, "grads"))) for shape, a in matrices}
    assert whole <= backward_scan_writes(wide["zero1"][1])
    writes = backward_scan_writes(wide["zero2"][1])
    assert split <= writes and not whole & writes
    matrix_bytes = sum(math.prod(shape) for shape, _ in matrices) * 2  # bfloat16
    temp = {k: c.memory_analysis().temp_size_in_bytes for k, (_, c) in wide.items()}
    assert temp["zero1"] - temp["zero2"] == pytest.approx((1 - 1 / 8) * matrix_bytes, rel=0.01)
