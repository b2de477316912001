"""Compiled per-device state bytes against the ZeRO formulas.

With fp32 params and Adam, the live state is 12 bytes per parameter (param, mu, nu):
  dp8    12 Psi per device
  zero1  4 Psi + 8 Psi / 8  (moments sharded over data, params replicated)
  fsdp8  12 Psi / 8         (everything sharded)
The compiled step's argument bytes are that state, plus the batch shard and two
int32 counters (the step, Adam's and the schedule's).
"""

import math

import jax
import pytest

from meshtrain.experiment import Experiment
from meshtrain.layouts.rules import mesh_axes_of


def state_bytes(exp):
    """Per-device bytes of params + optimizer state in the compiled step's arguments."""
    compiled = exp.compile()
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
