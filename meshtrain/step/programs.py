"""A train step made of several jitted programs that the host picks between by the step
number: DiLoCo's rounds (step/rounds.py) and train.compress_momentum's exact warm-up
before its compressed step (`Phased`). The loop calls one like the train step:

    step(state, batch) -> (state, metrics)

Two programs, not a `lax.cond` in one, so that each program's HLO holds only its own
collectives (what the planner reads, and the tests that count them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


class Programs:
    """Where the host is: the state's step, read once from the device when a state comes
    that this object did not return (a fresh or restored one), and counted after.
    Subclasses run `_run(state, batch, step)` (step: the state's, before the call) and name
    `_main`, the program that runs most steps: what is read of a compiled step (its HLO,
    memory, costs, arguments) is that one's."""

    _last: Any = None
    _step: int = 0

    def __call__(self, state, batch):
        if state is not self._last:
            self._step = int(jax.device_get(state.step))
        state, metrics = self._run(state, batch, self._step)
        self._step += 1
        self._last = state
        return state, metrics

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._main, name)


@dataclasses.dataclass
class Phased(Programs):
    """`warm` before step `warmup`, `hot` from it (jitted, or compiled: `compile`)."""

    warm: Any
    hot: Any
    warmup: int

    @property
    def _main(self):
        return self.hot

    def _run(self, state, batch, step: int):
        return (self.warm if step < self.warmup else self.hot)(state, batch)

    def compile(self, state, batch, options=None) -> "Phased":
        """Both programs compiled from shapes (`state`, `batch`: ShapeDtypeStructs)."""
        return Phased(self.warm.lower(state, batch).compile(options), self.hot.lower(state, batch).compile(options),
                      self.warmup)
