"""Sharded init creates every array in its shards; the step donates the old state."""

import jax
import numpy as np

from meshtrain.run.experiment import Experiment


def test_init_creates_arrays_in_their_shards(make_config):
    exp = Experiment.build(make_config("gpt2_tiny_fsdp8"))
    state = exp.init_state()
    wte = state.params["wte"]
    assert wte.sharding == exp.shardings.params["wte"]
    assert {s.data.shape for s in wte.addressable_shards} == {(256, 64 // 8)}
    mu = state.opt_state[1][0].mu["blocks"]["mlp"]["w_fc"]
    assert mu.sharding.spec == exp.shardings.params["blocks"]["mlp"]["w_fc"].spec


def test_init_is_deterministic_and_layout_independent(make_config):
    """On CPU a model this small inits from a program compiled with the analysis options
    (compile_options.QUICK_INIT_PARAMS), on one device as on eight."""
    exps = [Experiment.build(make_config(name)) for name in ("gpt2_tiny_dp2_tp4", "gpt2_tiny_dp8")]
    exps.append(Experiment.build(make_config("gpt2_tiny_dp8", **{"mesh.shape": "data:1"}), devices=jax.devices()[:1]))
    assert all(exp._quick_init() for exp in exps)
    a, *others = (exp.init_state().params for exp in exps)
    for b in others:
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))


def test_step_donates_the_old_state(make_config):
    exp = Experiment.build(make_config("gpt2_tiny_dp8"))
    state = exp.init_state()
    old = state.params["wte"]
    new, metrics = exp.train_step(state, exp.put_batch(next(exp.train_batches())))
    assert old.is_deleted(), "the step should reuse the old state's buffers"
    assert int(new.step) == 1 and np.isfinite(float(metrics["loss"]))
