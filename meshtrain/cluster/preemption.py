"""Preemption: SIGTERM means "save at the next step and exit 0", on every process at once.

One process installs its own SIGTERM handler (JAX's preemption service exists only
after `jax.distributed.initialize`). Several processes use JAX's sync point instead:
the coordination service turns a SIGTERM on any process into the same step on all
of them (the highest step any process has reached, plus one), so they save one
checkpoint together. Either way the loop asks `reached(step)` after every step.
"""

from __future__ import annotations

import signal
import threading

import jax


class Preemption:
    def __init__(self):
        self.requested = False
        self.multiprocess = jax.process_count() > 1
        self.previous = None
        # Python lets only the main thread install handlers; a loop run from another
        # thread (a notebook's background job) keeps the default SIGTERM.
        if not self.multiprocess and threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self.requested = True

    def reached(self, step: int) -> bool:
        """True on the step at which every process should save and stop. Call it every step."""
        if self.multiprocess:
            from jax.experimental import multihost_utils
            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def close(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None
