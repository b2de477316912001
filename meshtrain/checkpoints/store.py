"""Checkpoints: Orbax saves (async by default), atomic commit, restore into the current layout.

    DIR/step_N/state   the TrainState (step, rng, params, opt_state, stats): OCDBT arrays
    DIR/step_N/comm    TrainState.comm where it holds arrays (train.grad_compression's
                       error feedback: one row a device); a run whose buffers differ in
                       shape (another device count) or that saved none starts them at zero
    DIR/step_N/meta    JSON: the data iterator state, the skipped-step count, and what
                       the run was (layout, mesh, pipeline, model dims), for messages

Which steps are committed, and what is set aside (uncommitted, foreign or damaged
entries): checkpoints/steps.py.

Restore reads into the current run's ShapeDtypeStructs, shardings included, so a
checkpoint moves to another layout or mesh and every restored array carries the
requested sharding. Shapes and dtypes are compared first, so a mismatch names
the leaf and both shapes.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from meshtrain import tree_paths
from meshtrain.checkpoints import integrity, orbax_log, restage, save_failure
from meshtrain.checkpoints.lock import LOCK_NAME
from meshtrain.checkpoints.steps import (IGNORED, STEP_PREFIX, committed_steps, set_aside, set_aside_damaged,
                                         set_aside_uncommitted)
from meshtrain.errors import RunFailed, UserError, warn
from meshtrain.step import state as state_lib
from meshtrain.step.state import TrainState

def describe(leaf) -> str:
    return f"{tuple(leaf.shape)} {np.dtype(leaf.dtype).name}"


def saved_fields(state) -> dict:
    """A TrainState (or its ShapeDtypeStructs) as its "state" item holds it: every field
    but comm, which has an item of its own (the same layout as before comm existed)."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "comm"}


def _zeros(shapes):
    """Zeros in the shardings of a pytree of ShapeDtypeStructs (state.zeros, placed)."""
    return jax.jit(lambda: state_lib.zeros(shapes), out_shardings=jax.tree.map(lambda s: s.sharding, shapes))()


def other_optimizer(meta: dict, exp) -> bool:
    """Whether the checkpoint's run and `exp` differ in having DiLoCo (meta["run"]["diloco"]):
    their optimizer states are then of different kinds (DiLoCo's is the outer one)."""
    return bool((meta.get("run") or {}).get("diloco")) != (getattr(exp, "diloco", None) is not None)


def check_fits(saved_tree, target, where: str, saved_run: dict | None) -> None:
    """Raises a UserError naming the first leaf whose saved shape or dtype differs from `target`."""
    saved, wanted = tree_paths.flat(saved_tree), tree_paths.flat(target)
    order = lambda k: (not k.startswith("params/"), k)  # noqa: E731 - parameters first
    problems = [f"{k}: saved {describe(saved[k])}, this run has {describe(wanted[k])}"
                for k in sorted(saved.keys() & wanted.keys(), key=order)
                if describe(saved[k]) != describe(wanted[k])]
    problems += [f"{k}: not in the checkpoint" for k in sorted(wanted.keys() - saved.keys(), key=order)]
    problems += [f"{k}: in the checkpoint, not in this run"
                 for k in sorted(saved.keys() - wanted.keys(), key=order)]
    if not problems:
        return
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    origin = ""
    if saved_run:
        origin = (f" It was saved by a run with model {saved_run.get('model')}, layout "
                  f"{saved_run.get('layout')!r}, pipeline {saved_run.get('pipeline')}"
                  f"{', diloco.every ' + str(saved_run['diloco']) if saved_run.get('diloco') else ''}.")
    raise UserError(
        f"The checkpoint {where} does not fit this run: {problems[0]}{more}.{origin} Resume with "
        f"the model settings it was saved with, or start fresh with another --workdir or "
        f"checkpoint.dir.")


def _register_array_handler() -> None:
    """Orbax's jax.Array handler, with replica-parallel saves (each replica of a replicated
    array writes a slice of it, so that hosts share the writing) on only where there are
    hosts to share it. In one process they save nothing (that process writes every slice)
    and cost an eager slice program per leaf and replica on the first save: 2.6 s of a
    0.2 s save for GPT-2 tiny on 8 CPU devices, in every run. The files are the same."""
    from orbax.checkpoint._src.metadata import array_metadata_store  # Orbax's default's own
    ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
        use_replica_parallel=jax.process_count() > 1, array_metadata_store=array_metadata_store.Store()),
        override=True)


class Checkpointer:
    """An Orbax CheckpointManager with meshtrain's rules: commit checks, errors that surface."""

    def __init__(self, directory: str | os.PathLike, *, every: int, keep: int, use_async: bool,
                 every_minutes: float = 0.0):
        # Orbax wants absolute paths; a relative checkpoint.dir is relative to where we start.
        self.dir = pathlib.Path(directory).absolute()
        self.every = every
        self.every_s = 60 * every_minutes
        self.saved_at = time.monotonic()  # the clock of checkpoint.every_minutes
        found = []
        if jax.process_index() == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            found = sorted(e.name for e in self.dir.iterdir()
                           if e.name not in (LOCK_NAME, IGNORED) and not orbax_log.is_log(e.name))
            moved = set_aside_uncommitted(self.dir)
            if moved:
                warn(f"{self.dir} held {', '.join(moved)}, named like checkpoints but not committed "
                     f"ones (a partial copy or foreign files); moved to {self.dir / IGNORED}.")
            damaged = set_aside_damaged(self.dir, keep)  # no intact step: UserError, the others are told
            if damaged:
                warn(damaged)
        if jax.process_count() > 1:  # nobody lists steps before process 0 has set junk aside
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("meshtrain checkpoint directory checked")
        orbax_log.quiet_absl()  # Orbax logs every save at INFO
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep or None, step_prefix=STEP_PREFIX, cleanup_tmp_directories=True,
            enable_async_checkpointing=use_async, create=True)
        _register_array_handler()
        # Handlers named up front, so a fresh process can read a checkpoint's metadata.
        handlers = {"state": ocp.StandardCheckpointHandler(), "comm": ocp.StandardCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.dir, options=options, item_handlers=handlers)
        self.log = orbax_log.OrbaxLog(self.dir)  # Orbax's errors and tracebacks, off the console
        self.pending = self.failure = False  # a save not yet waited for; a failure reported
        self.last_saved = self.manager.latest_step()
        if jax.process_count() > 1:
            self._agree(self.last_saved)
        if found and self.last_saved is None:
            shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
            warn(f"{self.dir} holds no committed checkpoint (found {shown}: unfinished saves or "
                 f"foreign files); starting fresh. Unfinished saves are removed, the rest is left alone.")

    def _agree(self, latest: int | None) -> None:
        """Every process resumes from process 0's step, or the run stops: steps listed
        differently mean the processes do not see one shared checkpoint directory."""
        from jax.experimental import multihost_utils
        mine = -1 if latest is None else latest
        chosen = int(multihost_utils.broadcast_one_to_all(np.int32(mine)))
        if chosen != mine:
            self.manager.close()
            self.log.close(said=True)
            raise UserError(
                f"Process {jax.process_index()} finds {'no step' if mine < 0 else f'step {mine}'} "
                f"as the latest checkpoint in {self.dir}, process 0 finds "
                f"{'none' if chosen < 0 else f'step {chosen}'}: the processes do not see the same "
                f"directory. Put checkpoint.dir (or --workdir) on a file system every node shares.")

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def where(self, step: int) -> str:
        return str(self.dir / f"{STEP_PREFIX}_{step}")

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def target(self, step: int, exp) -> tuple:
        """(abstract TrainState to read step into, saved arrangement, current arrangement,
        meta). The target is exp's state, with block stacks in the saved pipeline
        arrangement if it differs."""
        meta = self.read_meta(step)
        saved = restage.arrangement((meta.get("run") or {}).get("pipeline"))
        current = restage.arrangement(exp.model.pipeline)
        target = saved_fields(exp.abstract_state())
        if saved != current:
            target = restage.saved_target(target, current, saved, exp.model.stacked)
        return target, saved, current, meta

    def check_fits(self, step: int, exp) -> dict:
        """Compares the saved shapes and dtypes with what `exp` would read; returns meta.
        Across DiLoCo and not (`other_optimizer`) the optimizer states differ by design."""
        target, _, _, meta = self.target(step, exp)
        saved = self.manager.item_metadata(step)["state"]
        saved = getattr(saved, "tree", saved)
        if other_optimizer(meta, exp):
            saved, target = ({k: v for k, v in t.items() if k != "opt_state"} for t in (saved, target))
        check_fits(saved, target, self.where(step), meta.get("run"))
        return meta

    def _restore_params(self, step: int, exp, target: dict, saved, current, meta: dict):
        """(TrainState, meta) of a checkpoint whose optimizer is another kind (DiLoCo's outer
        Nesterov against optim.*'s): its params (the outer params under DiLoCo), step, rng
        and statistics, read without its optimizer state (Orbax's partial restore); the
        optimizer state and the round start afresh, said in one line."""
        part = {k: v for k, v in target.items() if k != "opt_state"}
        args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype),
                            part)
        with ocp.PyTreeCheckpointer() as reader:
            got = reader.restore(pathlib.Path(self.where(step)) / "state",
                                 args=ocp.args.PyTreeRestore(item=part, restore_args=args, partial_restore=True))
        if saved != current:
            got = restage.restack(got, current, saved, {k: getattr(exp.shardings, k) for k in got}, exp.model.stacked)
        was = (meta.get("run") or {}).get("diloco")
        warn(f"step {step} was saved {f'with diloco.every={was}' if was else 'without DiLoCo'} and this run has "
             f"{f'diloco.every={exp.diloco.every}' if exp.diloco else 'none'}: it takes the checkpoint's "
             f"{'outer ' if was else ''}params, step and data position, and starts its optimizer state"
             f"{' and round' if exp.diloco else ''} afresh.")
        opt_state = jax.jit(exp.tx.init, out_shardings=exp.shardings.opt_state)(got["params"])
        return TrainState(step=got["step"], rng=got["rng"], params=got["params"], opt_state=opt_state,
                          stats=got["stats"], comm=exp.fresh_comm(got["params"])), meta

    def _comm_fits(self, step: int, comm) -> bool:
        """Whether step's comm item holds arrays of `comm`'s shapes and dtypes."""
        if not comm or not (pathlib.Path(self.where(step)) / "comm").exists():
            return False
        saved = self.manager.item_metadata(step)["comm"]
        saved = tree_paths.flat(getattr(saved, "tree", saved))
        wanted = tree_paths.flat(comm)
        return saved.keys() == wanted.keys() and all(describe(saved[k]) == describe(wanted[k]) for k in wanted)

    def restore(self, step: int, exp):
        """(TrainState in exp's shardings, meta), from any layout, mesh or pipeline arrangement.
        A read that fails is a UserError naming the step and, where it can, the file; the
        step is then moved to DIR/ignored/ if an older one is left to resume from."""
        with integrity.reading(pathlib.Path(self.where(step)), lambda: self._unreadable(step)):
            target, saved, current, meta = self.target(step, exp)
            if other_optimizer(meta, exp):
                return self._restore_params(step, exp, target, saved, current, meta)
            comm = exp.abstract_state().comm
            fits = self._comm_fits(step, comm)
            items = dict(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
            restored = self.manager.restore(step, args=ocp.args.Composite(
                **items, **({"comm": ocp.args.StandardRestore(comm)} if fits else {})))
        state = TrainState(**restored.state)
        if saved != current:
            state = restage.restack(state, current, saved, exp.shardings.replace(comm={}), exp.model.stacked)
        if comm and not fits and exp.diloco is not None:
            warn(f"DiLoCo starts a new round from the outer params at step {step}, its outer momentum at zero: "
                 f"the checkpoint holds no round of this run's shapes (saved on another data axis size or device "
                 f"count, or with other diloco.fragments).")
            return state.replace(comm=exp.fresh_comm(state.params)), restored.meta
        if comm and not fits:
            warn(f"train.grad_compression's error feedback starts from zero at step {step}: the checkpoint "
                 f"holds no buffers of this run's shapes (saved without error feedback, or on another "
                 f"number of devices).")
        return state.replace(comm=restored.comm if fits else _zeros(comm)), restored.meta

    def _unreadable(self, step: int) -> str:
        """What to do about step `step`, which failed to read: moved aside when an older
        intact step is left, so that rerunning resumes from that one."""
        older = [s for s in committed_steps(self.dir) if s < step]
        good = integrity.newest_intact(self.dir, older, STEP_PREFIX)[0]
        if good is None:
            return (f"There is no older intact step to resume from: put back a good copy of the "
                    f"step, or move {self.where(step)} away to start over from step 0.")
        try:
            moved = f"Moved it to {set_aside(pathlib.Path(self.where(step)))}"
        except FileNotFoundError:  # another process of the run moved it first
            moved = f"It was moved to {self.dir / IGNORED}"
        return f"{moved}; rerunning the same command resumes from step {good}."


    def due(self, step: int, log_step: bool = False) -> bool:
        """Whether to save at `step`: every checkpoint.every steps, and at the first log step
        after checkpoint.every_minutes since the last save. Time is decided at log steps
        only, by process 0's clock, so every process saves the same step; the loop already
        waits for the device at log steps, so asking the others costs no overlap."""
        if self.every > 0 and step % self.every == 0:
            return True
        if not (self.every_s and log_step):
            return False
        late = time.monotonic() - self.saved_at >= self.every_s
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            late = bool(multihost_utils.broadcast_one_to_all(np.int32(late)))
        return late

    def last_committed(self) -> int | None:
        """The newest step committed on disk (Orbax lists a step as soon as its save starts)."""
        try:
            return max(committed_steps(self.dir), default=None)
        except OSError:
            return None

    def save(self, step: int, state, meta: dict) -> None:
        """Starts saving `state` as step `step` (returns once the arrays are copied off the
        device when async); raises RunFailed if this or an earlier async save failed."""
        if step == self.last_saved:
            return
        # Orbax's save waits for the previous one anyway; waiting here first lets a failure
        # of that save be reported under its own step.
        self.wait(step)
        try:
            comm = {"comm": ocp.args.StandardSave(state.comm)} if jax.tree.leaves(state.comm) else {}
            started = self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(saved_fields(state)), meta=ocp.args.JsonSave(meta), **comm))
        except Exception as e:  # noqa: BLE001 - any failure to write is the same story
            raise self.failed(step, e) from e
        if not started:
            raise RunFailed(f"Orbax declined to save step {step} in {self.dir} (its latest step is "
                            f"{self.manager.latest_step()}); nothing was written.")
        self.last_saved, self.pending = step, True
        self.saved_at = time.monotonic()

    def check_errors(self, step: int | None = None) -> None:
        """Raises RunFailed if the last save failed (`step`: where the run is). Orbax's
        check_for_errors misses it: its finalize thread takes a failed write's error and holds
        it for whoever waits. That thread ends with the failure, so once no save is in
        progress, waiting costs nothing and raises it; a save being written is not waited for."""
        if self.pending and not self.manager.is_saving_in_progress():
            self.wait(step)

    def wait(self, step: int | None = None) -> None:
        """Blocks until the last save is committed; raises RunFailed if it failed."""
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001 - any failure to write is the same story
            raise self.failed(self.last_saved, e, step) from e
        self.pending = False

    def failed(self, step: int, error: Exception, stopped_at: int | None = None) -> RunFailed:
        """The paragraph a failed save of `step` stops the run with (save_failure.py; `stopped_at`:
        the step the run had reached), once its unfinished step is removed (process 0)."""
        self.failure, self.pending = True, False
        removed = jax.process_index() == 0 and save_failure.remove_unfinished(pathlib.Path(self.where(step)))
        self.log.flush()  # now that there may be room for it
        return RunFailed(save_failure.paragraph(self.dir, step, error, stopped_at, self.last_committed(),
                                                removed, self.log.path if self.log.reports else None))

    def close(self) -> None:
        """Waits for the last save, then releases Orbax's threads and hooks; raises RunFailed
        on a failure not reported yet."""
        try:
            if not self.failure:
                self.wait()
        finally:
            try:
                # Orbax removes old tmp directories in a thread it waits for only in its first
                # save; a run stopped before saving (a refused start) would exit under it.
                cleanup = getattr(self.manager, "_cleanup_tmp_directory_future", None)
                if cleanup is not None:
                    cleanup.result()
                self.manager.close()
            except Exception:  # noqa: BLE001 - after a failure, Orbax repeats it
                if not self.failure:
                    raise
            finally:
                self.log.close(said=self.failure)


def check_config(c) -> None:
    """checkpoint.* keys: every, every_minutes, keep and skip_disk_check."""
    if not isinstance(c.skip_disk_check, bool):
        raise UserError(f"checkpoint.skip_disk_check={c.skip_disk_check!r}: must be true or false.")
    if c.every < 0 or c.keep < 0 or c.every_minutes < 0:
        raise UserError(f"checkpoint.every={c.every}, checkpoint.every_minutes={c.every_minutes}, "
                        f"checkpoint.keep={c.keep}: all must be >= 0 (every=0 and every_minutes=0 "
                        f"save only at the end, at train.stop_at and on SIGTERM or Ctrl-C; keep=0 "
                        f"keeps every checkpoint).")


def checkpoint_dir(cfg, workdir: str | None) -> str | None:
    """checkpoint.dir, else WORKDIR/checkpoints, else None (no checkpoints)."""
    if cfg.checkpoint.dir:
        return cfg.checkpoint.dir
    return os.path.join(workdir, "checkpoints") if workdir else None


def safe_on_disk(directory: pathlib.Path) -> str:
    """One sentence on what a crash now would keep, for the message of a lost process."""
    try:
        steps = committed_steps(directory)
    except OSError:
        return ""
    if not steps:
        return f"No checkpoint was committed yet in {directory}."
    return (f"Committed checkpoints are kept; the latest is step {steps[-1]} in {directory}, "
            f"and rerunning the same command (or resubmitting the job) resumes from it.")
