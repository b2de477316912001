"""The start-up check of the checkpoint disk (meshtrain/checkpoints/disk_space.py): a disk
too small for the checkpoints the run keeps is refused before compiling, with the
arithmetic; the counts behind it; the estimate against a saved step; a filesystem that
cannot say is a warning.

The command-line test fakes the free space (`disk_space.free_space`, the one place the
check reads it); a real small filesystem fills in test_checkpoint.py, where a run started
anyway stops at the save that fails.
"""

import subprocess

import jax
import numpy as np
import pytest

from meshtrain import train
from meshtrain.checkpoints import disk_space, init_from, store
from meshtrain.errors import UserError, gib
from meshtrain.run.experiment import Experiment
from support.configs import configured

MIB = 2**20
TINY = ["--config=gpt2_tiny_dp8", "--config.train.steps=20", "--config.train.eval_every=0",
        "--config.checkpoint.every=5"]


@pytest.fixture(scope="module")
def tiny():
    """gpt2_tiny_dp8 built (nothing compiled or allocated)."""
    return Experiment.build(configured("gpt2_tiny_dp8", **{"train.steps": 20}))


def fake_free(monkeypatch, free):
    monkeypatch.setattr(disk_space, "free_space", lambda directory: free)


def test_a_disk_too_small_for_what_the_run_keeps_is_refused_before_compiling(tiny, tmp_path, monkeypatch, capsys):
    fake_free(monkeypatch, int(2.5 * MIB))

    def boom(self, analysis=False):
        raise AssertionError("compiled: the disk check should stop the run before")
    monkeypatch.setattr(Experiment, "compile", boom)
    assert train.main([*TINY, f"--workdir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    one, arrays, state = disk_space.checkpoint_bytes(tiny)
    assert err.count("meshtrain train: error:") == 1 and "Traceback" not in err
    assert (f"has 2.5 MiB free, but this run needs {gib(4 * one)} more there: 4 checkpoints at once "
            f"(checkpoint.keep=3 and the one being written) x {gib(one)} = {gib(4 * one)} (one checkpoint: "
            f"the train state's {arrays} arrays, {gib(state)}, and up to {gib(one - state)} of Orbax's "
            f"metadata)") in err, err
    assert "--config.checkpoint.skip_disk_check=true starts anyway" in err
    assert list((tmp_path / "checkpoints").iterdir()) == []  # nothing written


def check(exp, tmp_path, present=0, start=0, end=20, **checkpoint):
    """disk_space.check on exp's config with checkpoint.* overrides; lines it says are returned."""
    c = configured("gpt2_tiny_dp8", **{f"checkpoint.{k}": v for k, v in checkpoint.items()}).checkpoint
    said = []
    disk_space.check(tmp_path, exp, c, present=present, start=start, end=end, say=said.append)
    return said


def test_what_fits_is_one_line_and_a_smaller_keep_that_fits_is_offered(tiny, tmp_path, monkeypatch):
    one = disk_space.checkpoint_bytes(tiny)[0]
    fake_free(monkeypatch, 5 * one)
    (line,) = check(tiny, tmp_path, present=1, start=5, every=5)  # a resumed run, step 5 there
    assert line == (f"disk check: fits; 4 checkpoints at once (checkpoint.keep=3 and the one being written), "
                    f"1 there already: 3 more x {gib(one)} = {gib(3 * one)}, against {gib(5 * one)} free "
                    f"in {tmp_path}")
    fake_free(monkeypatch, int(2.5 * one))
    with pytest.raises(UserError, match=rf"--config.checkpoint.keep=1 needs {gib(2 * one)} \(but one step "
                                        rf"kept has none to fall back to if it is damaged\)"):
        check(tiny, tmp_path, every=5)


def test_a_filesystem_that_cannot_say_is_a_warning(tiny, tmp_path, monkeypatch, capsys):
    fake_free(monkeypatch, None)
    assert check(tiny, tmp_path, every=5) == []
    err = capsys.readouterr().err
    assert f"disk check: the filesystem of {tmp_path} does not say how much space is free" in err


def test_skip_disk_check_starts_anyway_with_the_arithmetic(tiny, tmp_path, monkeypatch, capsys):
    fake_free(monkeypatch, 1)
    assert check(tiny, tmp_path, every=5, skip_disk_check=True) == []
    assert "Starting anyway (checkpoint.skip_disk_check=true)" in capsys.readouterr().err


@pytest.mark.parametrize("keep, every, every_minutes, present, start, end, most", [
    (3, 40, 30.0, 0, 0, 120, 4),    # keep + the one being written
    (3, 40, 0.0, 0, 0, 120, 3),     # only 3 saves (40, 80, 120), none by the clock
    (3, 40, 0.0, 1, 40, 120, 3),    # resumed from 40: 80 and 120 join it
    (0, 40, 30.0, 0, 0, 100, 3),    # keep all: 40, 80 and the last, 100 (the clock's not counted)
    (0, 0, 30.0, 2, 50, 100, 3),    # every=0: the last step only
    (3, 40, 30.0, 5, 0, 120, 4),    # more there than kept: Orbax deletes down to keep after a save
])
def test_checkpoints_at_once(keep, every, every_minutes, present, start, end, most):
    saves = disk_space.scheduled_saves(every, start, end)
    assert disk_space.at_once(keep, every_minutes, present, saves) == most
    assert disk_space.scheduled_saves(every, end, end) == 0  # nothing left to train: nothing to check


def test_the_estimate_bounds_a_saved_step_closely(tiny, tmp_path):
    """A state that hardly compresses (random normals, as trained floats are) saved as meshtrain
    saves it: the disk it takes (du) is at most the estimate, and not far below it."""
    rng = np.random.default_rng(0)

    def noise(leaf):  # made on the host: no program to compile per shape
        values = rng.standard_normal(leaf.shape) if np.issubdtype(leaf.dtype, np.floating) else np.zeros(leaf.shape)
        return jax.device_put(values.astype(leaf.dtype), leaf.sharding)
    ck = store.Checkpointer(tmp_path, every=0, keep=3, use_async=False)
    try:
        ck.save(1, jax.tree.map(noise, tiny.abstract_state()), {"step": 1, "data": {}, "skipped": 0,
                                                                "run": init_from.run_summary(tiny)})
    finally:
        ck.close()
    used = int(subprocess.run(["du", "-sB1", str(tmp_path / "step_1")], capture_output=True, text=True,
                              check=True).stdout.split()[0])
    assert used == disk_space.used_space(tmp_path / "step_1")
    estimate = disk_space.checkpoint_bytes(tiny)[0]
    assert 0.85 * estimate < used <= estimate, (used, estimate)
