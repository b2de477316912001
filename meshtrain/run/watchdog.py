"""Hang watchdog: every process watches its own step progress, in a daemon thread.

    watchdog = Watchdog.for_run(cfg.train, cluster.liveness, cluster.table).start()
    train_loop(..., watchdog=watchdog)     # the loop calls the hooks below
    watchdog.stop()

Hooks (the training loop's, cheap): `dispatched(step)` after a step is handed to the
devices, `with waiting():` around every wait for the devices, `finished(step)` when a
step's results have been read, `with busy(what):` around a checkpoint save or an
evaluation. The thread checks twice a second that a step finished within the bound:

    bound   train.hang_timeout seconds after the last finished step; None (the default)
            is max(AUTO_FLOOR_S, AUTO_MULTIPLE x the median step time); 0 turns the
            watchdog off. It is armed when the first step has finished: the first step,
            checkpoint saves and evaluation get train.hang_timeout_busy instead.
    hang    the process writes to stderr (its log) the step it was in, where every
            process was, and every Python thread's stack (faulthandler); tells the others,
            which do the same; and exits HANG_STATUS, so `srun --kill-on-bad-exit` ends
            the job and a requeue resumes from the last committed checkpoint.

    backstop  the thread above needs the GIL; a thread that holds it (a C extension that
            never releases it) would silence the watchdog. So each tick re-arms
            faulthandler.dump_traceback_later at the current bound: if no tick came for
            that long, faulthandler's own C thread writes "Timeout (h:mm:ss)!" and every
            thread's stack to stderr and exits the process with status 1.

Where every process was comes from the beats (liveness.py, through JAX's key-value
store): each process's beat carries its progress to process 0, whose beat carries the
table back, so the report reads a table this process already holds and never waits for a
hung peer. One process alone
reports only itself. The straggler report (stragglers.py) rides on the same beats.
"""

from __future__ import annotations

import collections
import faulthandler
import io
import os
import statistics
import sys
import threading
import time
import traceback

from meshtrain.cluster.liveness import describe
from meshtrain.errors import UserError
from meshtrain.run.stragglers import Judge, window_stats

HANG_STATUS = 3                      # exit status of a process that found (or was told of) a hang
AUTO_MULTIPLE, AUTO_FLOOR_S = 20, 300.0
TICK_S = 0.5                         # how often the thread looks
KEPT_WINDOWS = 4                     # straggler windows a process keeps sending (beats may skip some)


def check_config(t) -> None:
    """train.hang_timeout, hang_timeout_busy, straggler_every, straggler_fraction."""
    h = t.hang_timeout
    if h is not None and (isinstance(h, bool) or not isinstance(h, (int, float)) or (h != 0 and h < 1)):
        raise UserError(f"train.hang_timeout={h!r}: give seconds (at least 1), 0 to turn the hang "
                        f"watchdog off, or None for the default (max({AUTO_FLOOR_S:g} s, "
                        f"{AUTO_MULTIPLE} x the median step time)).")
    if t.hang_timeout_busy < 0:
        raise UserError(f"train.hang_timeout_busy={t.hang_timeout_busy}: give seconds (the bound on "
                        f"the first step, a checkpoint save or an evaluation), or 0 for none.")
    if t.straggler_every < 0 or not 0 < t.straggler_fraction:
        raise UserError(f"train.straggler_every={t.straggler_every}, train.straggler_fraction="
                        f"{t.straggler_fraction}: every must be >= 0 steps (0 turns the straggler "
                        f"report off) and the fraction > 0, e.g. 0.1 (10% of the step time).")


class _Span:
    """`with`-able phase of the loop: waiting for the devices, or busy saving/evaluating."""

    def __init__(self, watchdog: "Watchdog", phase: str):
        self.watchdog, self.phase = watchdog, phase

    def __enter__(self):
        self.watchdog._enter(self.phase)

    def __exit__(self, *exc):
        self.watchdog._leave(self.phase)


class Watchdog:
    def __init__(self, timeout: float | None, busy_timeout: float, *, liveness=None, table=None,
                 straggler_every: int = 0, straggler_fraction: float = 0.1, out=None, exit=os._exit):
        """`timeout`: as train.hang_timeout; `liveness`: this process's Liveness (liveness.py), None for one process;
        `table`: the process table [{"process", "host", "pid"}]; `out`: where reports go
        (sys.stderr); `exit(status)` ends the process (os._exit; tests pass their own)."""
        self.timeout, self.busy_timeout = timeout, busy_timeout
        self.liveness = liveness
        self.rank = liveness.id if liveness else 0
        self.n = liveness.n if liveness else 1
        self.table = table or [{"process": 0, "host": os.uname().nodename, "pid": os.getpid()}]
        self.every, self.out, self.exit = straggler_every, out, exit
        self.note = lambda: ""                  # what is safe on disk, for the report
        self.on_fire = lambda stalled_s: None   # before the exit: e.g. goodput's "hang" share
        self.judge = Judge(self.n, straggler_every, straggler_fraction, self.table) if straggler_every else None
        # Progress, written by the loop's thread, read by ours (single attribute stores).
        self.step = self.dispatched_step = self.first_step = 0
        self.phase, self.busy_what = "host", ""
        now = time.monotonic()
        self.progress_at = self.phase_since = now   # last step finished (or busy ended); phase start
        self.intervals: collections.deque = collections.deque(maxlen=64)  # recent step times
        self.windows: collections.deque = collections.deque(maxlen=KEPT_WINDOWS)
        self._window: tuple[int, list, list] | None = None  # (index, own times, step times)
        self._last_dispatch = None                  # monotonic time of the last dispatch
        self._waited = self._busied = 0.0           # seconds waiting for the devices, busy, since then
        self._finished_at, self._busy_since_finish = None, 0.0
        self._told_at: dict[int, list] = {}         # where processes that found a hang were
        self._fired = threading.Lock()
        self._stopped = threading.Event()
        self.thread: threading.Thread | None = None

    @classmethod
    def for_run(cls, t, liveness=None, table=None) -> "Watchdog":
        """The watchdog train.* asks for (possibly one that only keeps the straggler medians)."""
        return cls(t.hang_timeout, t.hang_timeout_busy, liveness=liveness, table=table,
                   straggler_every=t.straggler_every, straggler_fraction=t.straggler_fraction)

    @classmethod
    def off(cls) -> "Watchdog":
        return cls(0, 0)

    @property
    def watching(self) -> bool:
        return self.timeout != 0

    def start(self, first_step: int = 0) -> "Watchdog":
        self.step = self.dispatched_step = self.first_step = first_step
        self.progress_at = time.monotonic()
        if self.liveness is not None:
            self.liveness.progress_of = self.progress
            self.liveness.on_hung = self.told
        if self.watching or self.judge is not None:
            self._backstop(self.bound())
            self.thread = threading.Thread(target=self._run, name="meshtrain-watchdog", daemon=True)
            self.thread.start()
        return self

    def stop(self) -> None:
        """Stops watching (the straggler medians stay for `stragglers()`)."""
        self._stopped.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=2)
        if self.thread is not None:
            faulthandler.cancel_dump_traceback_later()
        if self.liveness is not None:
            self.liveness.on_hung = None

    # -- hooks (the training loop's thread) ----------------------------------------------

    def dispatched(self, step: int) -> None:
        now = time.monotonic()
        if self._last_dispatch is not None and step == self.dispatched_step + 1 and self.every:
            wall = now - self._last_dispatch - self._busied  # dispatch to dispatch, less saves and evals
            self._sample(step, own=wall - self._waited, step_s=wall)
        self._last_dispatch, self._waited, self._busied = now, 0.0, 0.0
        self.dispatched_step, self.phase, self.phase_since = step, "host", now

    def finished(self, step: int) -> None:
        if step <= self.step:
            return
        now = time.monotonic()
        if self._finished_at is not None:
            self.intervals.append((now - self._finished_at - self._busy_since_finish) / (step - self.step))
        self._finished_at, self._busy_since_finish = now, 0.0
        self.step, self.progress_at = step, now

    def waiting(self) -> _Span:
        return _Span(self, "device")

    def busy(self, what: str) -> _Span:
        self.busy_what = what
        return _Span(self, "busy")

    def _enter(self, phase: str) -> None:
        self.phase, self.phase_since = phase, time.monotonic()

    def _leave(self, phase: str) -> None:
        now = time.monotonic()
        spent = now - self.phase_since
        if phase == "busy":
            self._busied += spent
            self._busy_since_finish += spent
            self.progress_at = max(self.progress_at, now)  # a save does not eat into the next step's bound
        else:
            self._waited += spent
        self.phase, self.phase_since = "host", now

    # -- straggler samples --------------------------------------------------------------

    def _sample(self, step: int, own: float, step_s: float) -> None:
        index = (step - 1) // self.every
        if self._window is not None and self._window[0] != index:
            self._close_window()
        if self._window is None:
            self._window = (index, [], [])
        self._window[1].append(max(own, 0.0))
        self._window[2].append(step_s)

    def _close_window(self) -> None:
        index, own, step = self._window
        self._window = None
        self.windows.append([index, *window_stats(own, step)])

    def progress(self) -> dict:
        """This process's {"at": [last finished, last dispatched, phase], "windows": [...]}."""
        phase = self.busy_what if self.phase == "busy" else self.phase
        return {"at": [self.step, self.dispatched_step, phase], "windows": list(self.windows)}

    def stragglers(self) -> dict | None:
        """run.json's `stragglers` (process 0): per-process medians over the run's windows."""
        if self.judge is None:
            return None
        if self._window is not None and self.n == 1:
            self._close_window()
        self._judge()
        return self.judge.summary()

    def _judge(self) -> None:
        if self.judge is None or self.rank != 0:
            return
        windows = {0: list(self.windows)}
        if self.liveness is not None:
            for i, p in list(self.liveness.progress.items()):
                if i != 0 and isinstance(p, dict) and "windows" in p:
                    windows[i] = p["windows"]
        try:
            self.judge.add(windows)
        except (TypeError, ValueError, IndexError):
            pass  # a malformed beat: judged again from the next one

    # -- the thread ---------------------------------------------------------------------

    def bound(self) -> tuple[float, str] | None:
        """(seconds, what is bounded) now; None when nothing is."""
        if not self.watching:
            return None
        if self.phase == "busy":
            what = f"{self.busy_what} (train.hang_timeout_busy={self.busy_timeout:g})"
            return (self.busy_timeout, what) if self.busy_timeout else None
        if self.step == self.first_step:
            what = f"the first step (train.hang_timeout_busy={self.busy_timeout:g})"
            return (self.busy_timeout, what) if self.busy_timeout else None
        if self.timeout is None:
            median = statistics.median(self.intervals) if self.intervals else 0.0
            seconds = max(AUTO_FLOOR_S, AUTO_MULTIPLE * median)
            return seconds, (f"a step (train.hang_timeout=None: max({AUTO_FLOOR_S:g} s, {AUTO_MULTIPLE} x "
                             f"the median step {median:.3g} s))")
        return float(self.timeout), f"a step (train.hang_timeout={self.timeout:g})"

    def _run(self) -> None:
        while not self._stopped.wait(TICK_S):
            self._judge()
            bound = self.bound()
            self._backstop(bound)
            since = self.phase_since if self.phase == "busy" else self.progress_at
            if bound is not None and time.monotonic() - since > bound[0]:
                self.fire(f"no progress for {time.monotonic() - since:.1f} s, longer than the bound "
                          f"on {bound[1]}")

    def _backstop(self, bound: tuple[float, str] | None) -> None:
        """Re-arms (or with no bound, cancels) faulthandler's timer: it fires only if this
        thread could not run for a whole bound."""
        if bound is None or self._stopped.is_set():
            faulthandler.cancel_dump_traceback_later()
            return
        try:
            out = self.out or sys.stderr
            out.fileno()
        except (AttributeError, OSError, ValueError):
            return  # faulthandler writes to a real file only (tests pass StringIO)
        faulthandler.dump_traceback_later(bound[0], exit=True, file=out)

    def told(self, message: dict) -> None:
        """Another process found a hang (a "hung" notice, in the liveness thread)."""
        p = message.get("process")
        known = isinstance(p, int) and 0 <= p < len(self.table)
        if known and isinstance(message.get("at"), list):
            self._told_at[p] = message["at"]  # newer than the last beat's
        who = self._who(p) if known else f"process {p}"
        self.fire(f"{who} found a hang ({message.get('why', 'no reason given')}) and stopped the job")

    def fire(self, why: str) -> None:
        """Reports the hang, tells the others and exits HANG_STATUS (once per process)."""
        if not self._fired.acquire(blocking=False):
            return
        faulthandler.cancel_dump_traceback_later()  # the report below is the one to write
        out = self.out or sys.stderr
        out.write(self.report(why) + "\n")
        out.write(f"Stacks of process {self.rank}'s threads, most recent call first:\n")
        _dump_stacks(out)
        note = self.note()
        out.write(f"meshtrain: process {self.rank} exits with status {HANG_STATUS} (a hang)."
                  + (f" {note}" if note else "") + "\n")
        out.flush()
        sys.stdout.flush()
        if self.liveness is not None:
            self.liveness.announce_hang(why=why, at=self.progress()["at"])
        try:
            self.on_fire(time.monotonic() - (self.phase_since if self.phase == "busy" else self.progress_at))
        except Exception as e:  # noqa: BLE001 - the exit must happen whatever the hook does
            out.write(f"meshtrain: warning: recording the hang failed ({type(e).__name__}: {e})\n")
        self.exit(HANG_STATUS)

    # -- the report ---------------------------------------------------------------------

    def _who(self, p: int) -> str:
        return describe(self.table[p])

    def _stuck_step(self, at: list | None = None) -> tuple[int, str]:
        """(the step a process is in, what it does there) from its [finished, dispatched, phase]."""
        finished, dispatched, phase = at or self.progress()["at"]
        if phase == "device":
            return finished + 1, (f"waiting for the devices to finish step {finished + 1} (dispatched up "
                                  f"to step {dispatched})")
        if phase == "host":
            return dispatched + 1, (f"in its own code (input, host code) before dispatching step "
                                    f"{dispatched + 1} (last finished step {finished})")
        return finished, f"busy with {phase} after step {finished}"

    def report(self, why: str) -> str:
        step, doing = self._stuck_step()
        lines = [f"meshtrain: error: hang in step {step}: {self._who(self.rank)} is {doing}: {why}."]
        if self.n == 1:
            return lines[0]
        table = self._table()
        lines.append("  where the processes were (last finished step, last dispatched step, phase; "
                     "as reported through process 0):")
        groups: dict[str, list[int]] = {"finished by": [], "dispatched (not finished) by": [],
                                        "not dispatched by": [], "not known for": []}
        for p in range(self.n):
            at = table.get(p)
            if at is None:
                groups["not known for"].append(p)
                continue
            lines.append(f"    {self._who(p)}: finished {at[0]}, dispatched {at[1]}, {self._stuck_step(at)[1]}")
            groups["finished by" if at[0] >= step else "dispatched (not finished) by" if at[1] >= step
                   else "not dispatched by"].append(p)
        parts = [f"{k} process {', '.join(map(str, v))}" for k, v in groups.items() if v]
        lines.append(f"  step {step}: " + "; ".join(parts) + ".")
        laggards, waiting = groups["not dispatched by"], groups["dispatched (not finished) by"]
        if laggards and waiting:
            where = ("the stacks below show where" if self.rank in laggards else
                     "the stacks in its own log show where")
            lines.append(f"  The others wait in step {step}'s collectives for {_listed(self, laggards)}, which "
                         f"never dispatched it: {where} it is stuck.")
        elif len(waiting) == self.n:
            lines.append(f"  Every process dispatched step {step} and none finished it: the step itself "
                         f"hangs on the devices (a collective, a device or link fault).")
        return "\n".join(lines)

    def _table(self) -> dict[int, list]:
        """{process: [finished, dispatched, phase]}: as the beats said (Liveness.where), with
        this process's own; processes no beat told of are "unknown"."""
        table = self.liveness.where() if self.liveness is not None else {}
        table.update(self._told_at)
        table[self.rank] = self.progress()["at"]
        return table


def _listed(w: Watchdog, processes: list[int]) -> str:
    shown = [w._who(p) for p in processes[:4]]
    return ", ".join(shown) + (f" and {len(processes) - 4} more" if len(processes) > 4 else "")


def _dump_stacks(out) -> None:
    """Every thread's stack: faulthandler's when `out` is a real file, else Python's own."""
    try:
        fd = out.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        fd = None
    if fd is not None:
        out.flush()
        faulthandler.dump_traceback(file=fd, all_threads=True)
        return
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        out.write(f"Thread {names.get(ident, ident)} (most recent call last):\n")
        out.write("".join(traceback.format_stack(frame)))
