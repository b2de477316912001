"""Checkpoints through the CLI, in this process: exact resume, restore onto another layout
or mesh, shape and dtype mismatches, unfinished or foreign files, the workdir lock, a
checkpoint disk that fills.

The kill and signal tests, which need their own processes, are in test_preemption.py.

Where a test reads a checkpoint back (restore onto 4 devices, a circular pipeline's
restacking) rather than resumes it through the command, the run that writes it is the
training loop itself (train_loop and the Checkpointer, as meshtrain train runs them) with
its step compiled with the planner's analysis options (Experiment.compile(analysis=True):
the same partitioned HLO, LLVM's optimisations and XLA:CPU's fusion emitters off, 3-4x
faster to compile; a few tiny steps run no slower that matters).
"""


import re

import jax
import numpy as np
import pytest

from meshtrain.checkpoints import init_from, store as checkpoint_lib
from meshtrain.checkpoints.lock import DirectoryLock
from meshtrain.parallel.pipeline.scan import from_stages
from meshtrain.run.experiment import Experiment
from meshtrain.run.loop import train_loop
from meshtrain.runlog import metrics
from support.checkpoints import (assert_requested_shardings, assert_same_values, build, copy, restore_both,
                                 small_disk, train)
from support.processes import exact_losses, losses, steps_on_disk


def committed(workdir) -> list[str]:
    return sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.startswith("step_"))


def loop_checkpoint(exp, ckpt_dir):
    """exp trained from scratch by the training loop to its train.stop_at, its checkpoint
    saved in ckpt_dir as meshtrain train saves it; the step compiled for analysis."""
    ck = checkpoint_lib.Checkpointer(ckpt_dir, every=0, keep=3, use_async=False)
    try:
        train_loop(exp, exp.compile(analysis=True), metrics.RunLog(None, exp.cfg.train.steps, 1, 1.0, None, 8),
                   checkpointer=ck, run_summary=init_from.run_summary(exp))
    finally:
        ck.close()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """20 steps of gpt2_tiny_dp8 in one go."""
    w = tmp_path_factory.mktemp("straight")
    assert train("gpt2_tiny_dp8", w) == 0
    return w


@pytest.fixture(scope="module")
def half(tmp_path_factory):
    """The same run stopped after step 10 (train.stop_at keeps the 20-step lr schedule)."""
    w = tmp_path_factory.mktemp("half")
    assert train("gpt2_tiny_dp8", w, "--config.train.stop_at=10") == 0
    return w


def test_ten_steps_exit_ten_more_equal_twenty_straight_bitwise(straight, half, tmp_path, capsys):
    assert committed(half) == ["step_10"] and sorted(losses(half)) == list(range(1, 11))
    w = copy(half, tmp_path)
    capsys.readouterr()
    assert train("gpt2_tiny_dp8", w) == 0
    assert "resuming from step 10" in capsys.readouterr().out
    a, b = losses(straight), losses(w)
    assert sorted(b) == list(range(1, 21))  # one run's rows: no duplicates, nothing lost
    assert {s: x.hex() for s, x in a.items()} == {s: x.hex() for s, x in b.items()}
    # The final states agree bit for bit too: params, moments, counters, PRNG key.
    exp = Experiment.build(build("gpt2_tiny_dp8"))
    finals = []
    for d in (straight, w):
        ck = checkpoint_lib.Checkpointer(d / "checkpoints", every=0, keep=3, use_async=False)
        state, meta = ck.restore(20, exp)
        ck.close()
        finals.append((jax.device_get(state), meta["data"]))
    jax.tree.map(np.testing.assert_array_equal, finals[0][0], finals[1][0])
    assert finals[0][1] == finals[1][1]


def test_dp8_checkpoint_continues_under_dp2_tp4(straight, half, tmp_path, capsys):
    w = copy(half, tmp_path)
    dp8, tp = Experiment.build(build("gpt2_tiny_dp8")), Experiment.build(build("gpt2_tiny_dp2_tp4"))
    (a, _), (b, _) = restore_both(w / "checkpoints", dp8, tp)
    assert b.params["blocks"]["mlp"]["w_fc"].sharding.spec != a.params["blocks"]["mlp"]["w_fc"].sharding.spec
    assert_same_values(a, b)
    assert_requested_shardings(b, tp)

    capsys.readouterr()
    assert train("gpt2_tiny_dp2_tp4", w) == 0
    assert "saved under layout 'dp'" in capsys.readouterr().out
    ref, got = losses(straight), losses(w)
    np.testing.assert_allclose([got[s] for s in range(11, 21)], [ref[s] for s in range(11, 21)], rtol=1e-5)


def test_fsdp8_checkpoint_restores_onto_a_4_device_mesh(straight, tmp_path):
    w = tmp_path / "fsdp8"
    fsdp8 = Experiment.build(build("gpt2_tiny_fsdp8", **{"train.stop_at": 10}))
    loop_checkpoint(fsdp8, w / "checkpoints")
    fsdp4 = Experiment.build(build("gpt2_tiny_fsdp8", **{"mesh.shape": "fsdp:4", "train.log_every": 1}),
                             devices=jax.devices()[:4])
    (a, _), (b, meta) = restore_both(w / "checkpoints", fsdp8, fsdp4)
    assert_same_values(a, b)
    assert_requested_shardings(b, fsdp4)
    wte = b.params["wte"]
    assert len(wte.sharding.device_set) == 4 and {s.data.shape for s in wte.addressable_shards} == {(256, 16)}

    fsdp4.cfg.unlock()
    fsdp4.cfg.train.stop_at = 13
    log = metrics.RunLog(None, 20, 1, 1.0, None, 4)
    rows = train_loop(fsdp4, fsdp4.compile(analysis=True), log, b, resume_meta=meta)
    ref = losses(straight)
    np.testing.assert_allclose([r["loss"] for r in rows], [ref[s] for s in (11, 12, 13)], rtol=1e-5)


def test_dp8_checkpoint_continues_in_a_pipeline(straight, half, tmp_path):
    """Blocks saved as [L, ...] are restacked into [stage, L/stage, ...], moments too."""
    w = copy(half, tmp_path)
    dp8, pp = Experiment.build(build("gpt2_tiny_dp8")), Experiment.build(build("gpt2_tiny_pp2_dp4"))
    (a, _), (b, _) = restore_both(w / "checkpoints", dp8, pp)
    assert b.params["blocks"]["mlp"]["w_fc"].shape == (2, 1, 64, 256)
    unstaged = jax.tree_util.tree_map_with_path(
        lambda p, x: from_stages(x, pp.model.pipeline) if "'blocks'" in jax.tree_util.keystr(p) else x,
        jax.device_get(b))
    assert_same_values(a, unstaged)
    assert_requested_shardings(b, pp)

    assert train("gpt2_tiny_pp2_dp4", w) == 0
    ref, got = losses(straight), losses(w)
    np.testing.assert_allclose([got[s] for s in range(11, 21)], [ref[s] for s in range(11, 21)], rtol=1e-4)


def test_circular_pipeline_checkpoint_restores_unpipelined(tmp_path):
    w = tmp_path / "circular"
    circ = Experiment.build(build("gpt2_tiny_pp4_dp2_circular", **{"train.stop_at": 2}))
    loop_checkpoint(circ, w / "checkpoints")
    flat = Experiment.build(build("gpt2_tiny_pp4_dp2_circular", **{
        "mesh.shape": "data:8", "layout": "dp", "pipeline.microbatches": 0}))
    (a, _), (b, _) = restore_both(w / "checkpoints", circ, flat, step=2)
    assert b.opt_state[1][0].mu["blocks"]["attn"]["w_qkv"].shape[0] == 8  # layers in model order
    restacked = jax.tree_util.tree_map_with_path(
        lambda p, x: from_stages(x, circ.model.pipeline) if "'blocks'" in jax.tree_util.keystr(p) else x,
        jax.device_get(a))
    assert_same_values(restacked, b)
    assert_requested_shardings(b, flat)


@pytest.mark.parametrize("override, first", [
    ("--config.model.embed_dim=128", "params/blocks/attn/b_out: saved (2, 64) float32, this run has (2, 128) float32"),
    ("--config.model.param_dtype=bfloat16", "params/blocks/attn/b_out: saved (2, 64) float32, this run has (2, 64) bfloat16"),
])
def test_checkpoint_that_does_not_fit_names_the_leaf_and_both_shapes(half, tmp_path, capsys, override, first):
    w = copy(half, tmp_path)
    assert train("gpt2_tiny_dp8", w, override) == 2
    err = capsys.readouterr().err
    assert f"step_10 does not fit this run: {first} (and " in err, err
    assert "layout 'dp'" in err and "Traceback" not in err


def test_unfinished_and_foreign_files_mean_a_fresh_start_with_a_warning(tmp_path, capsys):
    ckpt = tmp_path / "checkpoints"
    (ckpt / "step_5.orbax-checkpoint-tmp-1700000000").mkdir(parents=True)  # killed mid-save
    (ckpt / "step_5.orbax-checkpoint-tmp-1700000000" / "state").mkdir()
    (ckpt / "step_7").mkdir()  # named like a step, never committed (a partial copy)
    (ckpt / "step_7" / "state").mkdir()
    (ckpt / "notes.txt").write_text("not ours")
    (ckpt / "step_3.orbax-checkpoint-tmp-1").mkdir()  # a stale tmp of the step we will save
    (tmp_path / "metrics.jsonl").write_text('{"step": 7, "loss": 1.0}\n')  # an older run's rows
    # stop_at (not steps=3): the 20-step run's program, which `straight` compiled
    assert train("gpt2_tiny_dp8", tmp_path, "--config.train.stop_at=3") == 0
    err = capsys.readouterr().err
    assert "holds no committed checkpoint" in err and "step_7" in err
    assert sorted(losses(tmp_path)) == [1, 2, 3]  # started at step 1, in a metrics file of its own
    (old,) = tmp_path.glob("metrics.*.jsonl")
    assert old.read_text() == '{"step": 7, "loss": 1.0}\n'

    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["ignored", "notes.txt", "step_3"], names  # tmp dirs gone, step_7 set aside
    assert [p.name.split("-")[0] for p in (ckpt / "ignored").iterdir()] == ["step_7"]


def test_a_second_run_on_a_locked_workdir_refuses_to_start(tmp_path, capsys):
    holder = DirectoryLock(tmp_path, "workdir")
    try:
        assert train("gpt2_tiny_dp8", tmp_path) == 2
    finally:
        holder.release()
    err = capsys.readouterr().err
    assert "is in use by another run (pid" in err and "another --workdir" in err
    assert not (tmp_path / "checkpoints").exists()


class FailingWrite:
    """An Orbax future whose background write fails, as a full disk does."""

    def result(self, timeout=None):
        raise OSError(28, "No space left on device (injected)")


def fail_second_save(monkeypatch):
    """Orbax's commit of the second save fails as a full disk's does: in its background thread."""
    import orbax.checkpoint as ocp
    write, saves = ocp.StandardCheckpointHandler.async_save, []

    async def failing(self, directory, *args, **kwargs):
        futures = await write(self, directory, *args, **kwargs)
        saves.append(directory)
        return [*(futures or []), FailingWrite()] if len(saves) == 2 else futures

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", failing)


def test_a_checkpoint_disk_that_fills_stops_the_run_at_once_and_a_larger_disk_resumes(
        straight, tmp_path, capfd, monkeypatch):
    """On a 2.5 MiB tmpfs one checkpoint of gpt2_tiny (1.5 MiB) fits and a second does not;
    where no tmpfs may be mounted, the second save's write fails by injection instead."""
    with small_disk(tmp_path / "disk") as disk:
        if disk is None:
            fail_second_save(monkeypatch)
        w = (disk or tmp_path) / "run"
        capfd.readouterr()
        assert train("gpt2_tiny_dp8", w, "--config.train.log_every=5", "--config.checkpoint.every=5",
                     "--config.checkpoint.skip_disk_check=true") == 1  # the start-up check would refuse the tmpfs
        out, err = capfd.readouterr()
        assert "Traceback" not in out + err, out + err
        assert err.count("meshtrain train: error: Saving checkpoint step 10 in") == 1, err
        assert "No space left on device" in err and "The last committed step is 5 (" in err
        assert "the unfinished step 10 was removed" in err and "resumes from step 5" in err
        stopped = int(re.search(r"The run stopped at step (\d+)\.", err).group(1))
        assert 10 < stopped < 20 and max(losses(w)) <= 10 + 5  # within one log interval, not at the end
        assert steps_on_disk(w) == [5]
        assert "No space left on device" in (w / "checkpoints" / "orbax.log").read_text()  # Orbax's tracebacks
        w = copy(w, tmp_path)  # to a larger disk
    monkeypatch.undo()
    assert train("gpt2_tiny_dp8", w) == 0
    assert "resuming from step 5" in capfd.readouterr().out
    assert sorted(losses(w)) == list(range(5, 21))
    assert exact_losses(w) == {s: x for s, x in exact_losses(straight).items() if s >= 5}
