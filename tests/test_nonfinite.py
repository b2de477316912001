"""train.nonfinite: a NaN in a batch (an id past the vocabulary reads NaN from the
embedding) either stops the run naming the step and the first bad gradient leaf, or is
skipped with params and optimizer state unchanged bit for bit, up to train.max_skips in a row.

The steps compile with the planner's analysis options (Experiment.compile(analysis=True):
the same partitioned HLO, LLVM's optimisations and XLA:CPU's fusion emitters off, 3-4x
faster to compile): the tests run eight tiny steps at most.
"""

import jax
import numpy as np
import pytest

from meshtrain.checkpoints.store import Checkpointer
from meshtrain.errors import RunFailed
from meshtrain.run.experiment import Experiment
from meshtrain.run.loop import train_loop
from meshtrain.runlog import metrics


def experiment(make_config, **overrides):
    return Experiment.build(make_config("gpt2_tiny_dp8", **{
        "train.steps": 8, "train.log_every": 1, "train.eval_every": 0, **overrides}))


def poison(batch: np.ndarray, vocab: int) -> np.ndarray:
    batch = batch.copy()
    batch[0, 0] = vocab  # one token past the table: jnp.take fills NaN
    return batch


def poison_steps(exp, steps):
    """Makes exp.train_batches() poison the batches of the given steps (1-based)."""
    make = exp.train_batches
    vocab = exp.model.cfg.padded_vocab_size

    class Poisoned:
        def __init__(self, start_step):
            self.inner, self.step = make(start_step), start_step

        def __next__(self):
            self.step += 1
            batch = next(self.inner)
            return poison(batch, vocab) if self.step in steps else batch

        def get_state(self):
            return self.inner.get_state()

    exp.train_batches = lambda start_step=0: Poisoned(start_step)


def test_skip_leaves_params_and_optimizer_state_unchanged_bitwise(make_config):
    exp = experiment(make_config, **{"train.nonfinite": "skip"})
    batches, step = exp.train_batches(), exp.compile(analysis=True)
    state, _ = step(exp.init_state(), exp.put_batch(next(batches)))
    before = jax.device_get((state.params, state.opt_state))
    bad = poison(next(batches), exp.model.cfg.padded_vocab_size)
    state, metrics = step(state, exp.put_batch(bad))
    assert np.isnan(metrics["loss"]) and int(metrics["nonfinite_grads"]) == len(jax.tree.leaves(before[0]))
    assert int(metrics["first_nonfinite"]) == 0 and int(state.step) == 2
    jax.tree.map(np.testing.assert_array_equal, before, jax.device_get((state.params, state.opt_state)))
    state, metrics = step(state, exp.put_batch(next(batches)))  # and training goes on
    assert np.isfinite(metrics["loss"]) and int(metrics["nonfinite_grads"]) == 0
    assert not np.array_equal(before[0]["wte"], jax.device_get(state.params["wte"]))


def test_crash_stops_with_the_step_and_first_bad_leaf_and_saves_nothing_past_it(make_config, tmp_path):
    exp = experiment(make_config, **{"train.nonfinite": "crash"})
    poison_steps(exp, {3})
    ck = Checkpointer(tmp_path, every=1, keep=0, use_async=True)
    log = metrics.RunLog(None, 8, 1, 1.0, None, 8)
    with pytest.raises(RunFailed, match=r"^step 3: loss nan, 16 of 16 gradient leaves non-finite "
                                        r"\(first: blocks/attn/b_out\)\. Stopped \(train.nonfinite=crash\)"):
        train_loop(exp, exp.compile(analysis=True), log, checkpointer=ck)
    ck.close()
    assert ck.manager.all_steps() == [1, 2]


def test_skip_counts_in_metrics_and_stops_after_max_skips_in_a_row(make_config, capsys):
    exp = experiment(make_config, **{"train.nonfinite": "skip", "train.max_skips": 3})
    poison_steps(exp, {2, 4, 5})  # never 3 in a row
    rows = train_loop(exp, exp.compile(analysis=True), metrics.RunLog(None, 8, 1, 1.0, None, 8))
    assert [r["skipped"] for r in rows] == [0, 1, 1, 2, 3, 3, 3, 3]
    assert np.isfinite(rows[-1]["loss"]) and rows[-1]["loss"] < rows[0]["loss"]
    assert "step 4: loss nan, 16 of 16 gradient leaves non-finite (first: blocks/attn/b_out); " \
           "skipped, params and optimizer state unchanged (1 in a row, 2 in all)" in capsys.readouterr().err

    exp = experiment(make_config, **{"train.nonfinite": "skip", "train.max_skips": 3})
    poison_steps(exp, {4, 5, 6})
    with pytest.raises(RunFailed, match=r"3 steps in a row were non-finite, the last step 6: .* "
                                        r"\(train.max_skips=3\); params are those of step 3\."):
        train_loop(exp, exp.compile(analysis=True), metrics.RunLog(None, 8, 1, 1.0, None, 8))
