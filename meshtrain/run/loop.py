"""The training loop: batches in, metrics out, eval and checkpoints on a schedule.

The host reads each step's results after the next step has been dispatched, so
the device is never idle waiting for Python: the non-finite check of step k and
its log line happen while step k+1 runs. A checkpoint or eval at step k first
finishes those checks, so no checkpoint holds a state past a crash-policy failure.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np

from meshtrain.checkpoints.store import Checkpointer
from meshtrain.cluster.preemption import Preemption
from meshtrain.errors import RunFailed, UserError, warn
from meshtrain.run import watchdog as watchdog_lib
from meshtrain.runlog import goodput
from meshtrain.runlog.metrics import RunLog
from meshtrain.step.train_step import NONFINITE_POLICIES, gradient_names


def check_config(t) -> None:
    """train.* keys this loop reads: steps, log_every, eval_every, eval_steps, nonfinite,
    max_skips, stop_at (batch_size and microbatches are checked against the layout)."""
    if t.steps < 0:
        raise UserError(f"train.steps={t.steps}: must be >= 0 (0 compiles and exits).")
    if t.log_every < 1 or t.eval_every < 0 or (t.eval_every and t.eval_steps < 1):
        raise UserError(
            f"train.log_every={t.log_every}, train.eval_every={t.eval_every}, train.eval_steps="
            f"{t.eval_steps}: log_every must be >= 1, eval_every >= 0 (0 turns eval off), and "
            f"eval_steps >= 1 when eval is on.")
    if t.nonfinite not in NONFINITE_POLICIES or t.max_skips < 1:
        raise UserError(
            f"train.nonfinite={t.nonfinite!r}, train.max_skips={t.max_skips}: nonfinite must be one "
            f"of {', '.join(NONFINITE_POLICIES)} and max_skips >= 1.")
    if not 0 <= t.stop_at <= t.steps:
        raise UserError(f"train.stop_at={t.stop_at}: must be between 0 (off) and train.steps={t.steps}.")
    profile_steps(t)
    watchdog_lib.check_config(t)


def profile_steps(t) -> tuple[int, int] | None:
    """train.profile "START:STOP" -> (START, STOP), the steps to trace (inclusive); None if off."""
    if not t.profile:
        return None
    first, sep, last = str(t.profile).partition(":")
    try:
        steps = (int(first), int(last)) if sep else None
    except ValueError:
        steps = None
    if steps is None or not 1 <= steps[0] <= steps[1] <= t.steps:
        raise UserError(
            f"train.profile={t.profile!r}: give the first and last step to trace as START:STOP, "
            f"1 <= START <= STOP <= train.steps={t.steps}, e.g. --config.train.profile=10:15 "
            f"(after the first steps, which include compilation).")
    return steps


class Profiler:
    """Traces steps START..STOP of train.profile into DIR/profile (jax.profiler: open it in
    TensorBoard's profile plugin or Perfetto; docs/profiling.md)."""

    def __init__(self, t, workdir, say):
        self.steps, self.say, self.on = profile_steps(t), say, False
        self.dir = None if workdir is None else workdir / "profile"

    def before(self, step: int) -> None:
        if self.steps and step == self.steps[0] and self.dir is not None:
            jax.profiler.start_trace(str(self.dir))
            self.on = True

    def after(self, step: int, state) -> None:
        if self.on and step == self.steps[1]:
            self.stop(state)

    def stop(self, state=None) -> None:
        if self.on:
            jax.block_until_ready(state)  # the traced steps' device work is in the trace
            jax.profiler.stop_trace()
            self.on = False
            self.say(f"profile of steps {self.steps[0]}-{self.steps[1]} written to {self.dir} "
                     f"(TensorBoard's profile plugin or ui.perfetto.dev; docs/profiling.md)")


def evaluate(exp, params, batches=None, each=None, stats=None) -> dict[str, float]:
    """{"loss", and the task's eval metrics (top1, top5)}: each the mean over `exp`'s (an
    Experiment's) eval batches of the batch's mean, under `params` and `stats` (BatchStat
    state; {} for a model without). `batches` (this process's rows of each batch)
    replaces exp.eval_batches(); `each(batch, result)`, when given, is called after each
    batch is dispatched (meshtrain eval: its progress bar and logits)."""
    results = []
    stats = {} if stats is None else stats
    for rows in exp.eval_batches() if batches is None else batches:
        batch = exp.put_batch(rows)
        results.append(exp.eval_step(params, stats, batch))
        if each is not None:
            each(batch, results[-1]["loss"])
    results = jax.device_get(results)
    # A task that counts what each batch scored (a classifier's padding rows score
    # nothing) is averaged per example; otherwise batches weigh the same.
    weights = np.array([float(r["count"]) if "count" in r else 1.0 for r in results])
    out = {k: float(np.sum([w * r[k] for w, r in zip(weights, results)]) / max(weights.sum(), 1.0))
           for k in results[0] if k != "count"}
    if "count" in results[0]:
        out["count"] = int(weights.sum())
    return out


@dataclasses.dataclass
class NonfiniteGuard:
    """Applies train.nonfinite to a step's loss and its non-finite gradient count."""

    policy: str
    max_skips: int
    names: list[str]    # gradient leaf paths, as step.gradient_names
    skipped: int = 0    # steps skipped in this run and the runs it resumed
    in_a_row: int = 0

    def check(self, step: int, metrics: dict) -> None:
        loss, count, first = (x.item() for x in jax.device_get(
            (metrics["loss"], metrics["nonfinite_grads"], metrics["first_nonfinite"])))
        if math.isfinite(loss) and count == 0:
            self.in_a_row = 0
            return
        what = (f"step {step}: loss {loss}, {count} of {len(self.names)} gradient leaves non-finite"
                + (f" (first: {self.names[first]})" if count else ""))
        if self.policy == "crash":
            raise RunFailed(f"{what}. Stopped (train.nonfinite=crash); checkpoints hold only steps "
                            f"before it. Use train.nonfinite=skip to skip such steps, or lower "
                            f"optim.lr.")
        self.skipped += 1
        self.in_a_row += 1
        warn(f"{what}; skipped, params and optimizer state unchanged "
                      f"({self.in_a_row} in a row, {self.skipped} in all).")
        if self.in_a_row >= self.max_skips:
            raise RunFailed(f"{self.in_a_row} steps in a row were non-finite, the last {what}. "
                            f"Stopped (train.max_skips={self.max_skips}); params are those of "
                            f"step {step - self.in_a_row}.")


@dataclasses.dataclass
class _Reader:
    """Reads dispatched steps' results one step late, so the device never waits for Python:
    the non-finite check and (on log steps) the log line with the step time."""

    log: RunLog
    guard: NonfiniteGuard
    last_time: float
    last_step: int
    rows: list = dataclasses.field(default_factory=list)
    pending: tuple | None = None  # (step, metrics, time it finished if it is a log step)
    watch: watchdog_lib.Watchdog = dataclasses.field(default_factory=watchdog_lib.Watchdog.off)

    def queue(self, step: int, metrics, timed: bool) -> None:
        """Records a just-dispatched step after reading the one before it."""
        self.flush()
        if timed:  # a log step: wait for it, for an honest step time
            with self.watch.waiting():
                jax.block_until_ready(metrics)
            self.watch.finished(step)
        self.pending = (step, metrics, time.perf_counter() if timed else None)

    def flush(self) -> None:
        if self.pending is None:
            return
        step, metrics, now = self.pending
        self.pending = None
        with self.watch.waiting():  # reading the results waits for the step
            self.guard.check(step, metrics)
        self.watch.finished(step)
        if now is not None:
            step_time = (now - self.last_time) / (step - self.last_step)
            self.rows.append(self.log.log_train(step, jax.device_get(metrics), step_time,
                                                skipped=self.guard.skipped))
            self.restart_clock(step, now)

    def restart_clock(self, step: int, now: float | None = None) -> None:
        self.last_time, self.last_step = time.perf_counter() if now is None else now, step


def train_loop(exp, compiled_step, log: RunLog, state=None, *,
               checkpointer: Checkpointer | None = None, resume_meta: dict | None = None,
               run_summary: dict | None = None, preemption: Preemption | None = None,
               clock: goodput.Clock | None = None,
               watchdog: watchdog_lib.Watchdog | None = None) -> list[dict]:
    """Runs `exp` (an Experiment: experiment.py, which sits above this module) to
    train.stop_at (or train.steps), resuming from `state` and its checkpoint meta.

    Returns the logged rows. `compiled_step` is exp.compile(). With a checkpointer it
    saves every checkpoint.every steps, every checkpoint.every_minutes, at the last step,
    and on SIGTERM or Ctrl-C (then stops). `preemption` (made before compiling, so a
    signal then is kept) and `clock` (goodput shares) are made here when not given;
    `watchdog` (run/watchdog.py) hears of every step's progress.
    """
    t = exp.cfg.train
    state = exp.init_state() if state is None else state
    start = int(jax.device_get(state.step))
    end = t.stop_at or t.steps
    batches = exp.train_batches(start_step=start)
    if resume_meta is not None:
        batches.set_state(resume_meta["data"])
    guard = NonfiniteGuard(t.nonfinite, t.max_skips, gradient_names(exp.model),
                           skipped=(resume_meta or {}).get("skipped", 0))
    watch = watchdog or watchdog_lib.Watchdog.off()
    reader = _Reader(log, guard, time.perf_counter(), start, watch=watch)
    own_preemption = preemption is None
    preemption = Preemption() if own_preemption else preemption
    clock = goodput.Clock(None) if clock is None else clock
    profiler = Profiler(t, log.dir, log.say)
    step, stop = start, False
    preemption.lost = lambda: _lost(step, checkpointer)
    clock.since_start("start-up")  # everything before the first step: build, compile, restore, init
    try:
        for step in range(start + 1, end + 1):
            with clock.time("data"):
                batch = exp.put_batch(next(batches))
            began = time.perf_counter()
            profiler.before(step)
            with watch.waiting():  # a dispatch may wait for the devices to finish the last step
                state, metrics = compiled_step(state, batch)
            watch.dispatched(step)
            if checkpointer is not None:
                checkpointer.check_errors(step)  # a failed background save stops the run at once
            profiler.after(step, state)
            log_step = step % t.log_every == 0 or step == end
            reader.queue(step, metrics, timed=log_step)
            stop = preemption.reached(step)
            save = checkpointer is not None and (stop or step == end or checkpointer.due(step, log_step))
            evaluate_now = t.eval_every and (step % t.eval_every == 0 or step == t.steps)
            if save or evaluate_now:
                reader.flush()  # no checkpoint or eval of a state past a crash-policy failure
            # The host runs one step ahead of the device, so this is step-1's device time
            # (the first step's includes none): near enough for where the time went.
            clock.step(step, time.perf_counter() - began)
            if save:
                with clock.time("checkpoint"), watch.busy("checkpoint save"):
                    checkpointer.save(step, state, {"step": step, "data": batches.get_state(),
                                                    "skipped": guard.skipped, "run": run_summary or {}})
            if evaluate_now:
                with clock.time("eval"), watch.busy("evaluation"):
                    result = evaluate(exp, state.params, stats=state.stats)
                    log.log_eval(step, result["loss"], result)
                reader.restart_clock(step)  # eval time is not training time (tokens/s, ETA)
            if stop:
                saved = f"saved step {step} in {checkpointer.dir}" if checkpointer else "no checkpoint dir, nothing saved"
                how = "interrupted (Ctrl-C)" if preemption.requested == "Ctrl-C" else "preempted (SIGTERM)"
                log.say(f"{how} at step {step}: {saved}; rerun the same command to resume.")
                break
            if log_step:
                clock.save()  # a run killed later keeps its goodput up to here
        began = time.perf_counter()
        reader.flush()
        clock.add("steps", time.perf_counter() - began)  # the last step's device time
        log.ended(step, preemption.requested if stop else None)
    finally:
        profiler.stop(state)  # a run that ends inside the traced steps still writes its trace
        if own_preemption:
            preemption.close()
    return reader.rows


def _lost(step: int, checkpointer: Checkpointer | None) -> str:
    """What quitting at `step` loses, for the second Ctrl-C."""
    if checkpointer is None:
        return f"steps 1-{step} are lost (no checkpoint dir)"
    last = checkpointer.last_committed()
    if last is None:
        return f"steps 1-{step} are lost (no checkpoint committed yet in {checkpointer.dir})"
    lost = f"steps {last + 1}-{step} are lost" if step > last else "nothing is lost"
    return f"{lost}; the last committed checkpoint is step {last} in {checkpointer.dir}, and rerunning the same command resumes from it"
