"""Preemption and Ctrl-C: "save at the next step and exit 0", on every process at once.

SIGTERM (a scheduler's preemption, `scancel --signal=TERM`, the Slurm template's time
limit) and the first Ctrl-C (SIGINT) mean the same: finish the step, save it, stop, so
rerunning the same command resumes there. A second Ctrl-C quits at once and says which
steps that loses (those after the last committed checkpoint).

One process installs its own handlers (JAX's preemption service exists only after
`jax.distributed.initialize`). Several processes use JAX's sync point instead: the
coordination service turns a SIGTERM on any process into the same step on all of them
(the highest step any process has reached, plus one), so they save one checkpoint
together; a Ctrl-C on one of them is turned into a SIGTERM to itself, which that service
hears. Either way the loop asks `reached(step)` after every step.

Made before compiling, so a signal during start-up is not lost either: the run then
trains one step and saves it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

import jax

INTERRUPTED_STATUS = 130  # the shell's convention for a process ended by SIGINT


class Preemption:
    def __init__(self):
        self.requested: str | None = None  # "SIGTERM" or "Ctrl-C" once asked to stop
        self.multiprocess = jax.process_count() > 1
        # What a quit now would lose, one sentence (set by the loop, which knows the step).
        self.lost: Callable[[], str] = lambda: "nothing was trained yet"
        self.previous: dict[int, object] = {}
        # Python lets only the main thread install handlers; a loop run from another
        # thread (a notebook's background job) keeps the default handlers.
        if threading.current_thread() is threading.main_thread():
            signals = [signal.SIGINT] + ([] if self.multiprocess else [signal.SIGTERM])
            for s in signals:
                self.previous[s] = signal.signal(s, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if self.requested is not None:
            if signum == signal.SIGINT:  # the second Ctrl-C: the user wants out now
                _say(f"second Ctrl-C: quitting without saving; {self.lost()}.")
                sys.stdout.flush()
                os._exit(INTERRUPTED_STATUS)
            return
        self.requested = name
        if signum == signal.SIGINT:
            _say("Ctrl-C: saving at the next step, then stopping (Ctrl-C again quits at once, "
                 "without saving).")
            if self.multiprocess:  # JAX's preemption service listens for SIGTERM only
                os.kill(os.getpid(), signal.SIGTERM)

    def reached(self, step: int) -> bool:
        """True on the step at which every process should save and stop. Call it every step."""
        if self.multiprocess:
            from jax.experimental import multihost_utils
            if multihost_utils.reached_preemption_sync_point(step):
                self.requested = self.requested or "SIGTERM"
                return True
            return False
        return self.requested is not None

    def close(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}


def _say(line: str) -> None:
    print(f"meshtrain: {line}", file=sys.stderr, flush=True)
