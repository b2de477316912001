"""Straggler report: which process makes every step slower, judged on process 0.

Collectives make every process's step as slow as the slowest one, so the step times of
the processes converge and cannot name it. What differs is each process's *own time*
per step: the wall time of its step not spent waiting for the device nor saving or
evaluating, i.e. its input and its host code. The watchdog
(watchdog.py) measures it on every process; every train.straggler_every steps (a
*window*) each process takes the median of its own time and of its step time over the
window and sends both with the beats it already sends to process 0 (liveness.py): no
device collective, no extra message.

Process 0 judges each window every process has reported: process p is slow in it when

    own_p - median(own of the other processes) > train.straggler_fraction x median step

i.e. when p alone adds more than that fraction to every step of the job. A process slow in
CONSECUTIVE windows in a row is named in a warning (once, until it recovers): one window
can catch a one-off pause (a garbage collection, a cold page cache, a slow file read), a
real straggler stays slow. run.json keeps every process's medians over the run.
"""

from __future__ import annotations

import statistics

from meshtrain.cluster.liveness import describe
from meshtrain.errors import warn

CONSECUTIVE = 2  # windows in a row before a process is named


def window_stats(own_s: list[float], step_s: list[float]) -> tuple[float, float]:
    """(median own seconds per step, median step seconds) of one window's samples."""
    return (statistics.median(own_s) if own_s else 0.0, statistics.median(step_s) if step_s else 0.0)


class Judge:
    """Process 0's judge. `add(windows)` takes {process: [[window, own_s, step_s], ...]},
    the windows each process last reported; every window all processes have reported is
    judged once, in order."""

    def __init__(self, n: int, every: int, fraction: float, table: list[dict]):
        self.n, self.every, self.fraction, self.table = n, every, fraction, table
        self.judged = -1                                     # the last window judged
        self.streak = [0] * n                                # slow windows in a row, per process
        self.named: set[int] = set()                         # processes ever named
        self.medians: list[list[tuple[float, float]]] = [[] for _ in range(n)]  # per process: (own, step) per window

    def add(self, windows: dict[int, list]) -> list[str]:
        """Judges what is new; returns the warnings given (also printed with meshtrain.errors.warn)."""
        if len(windows) < self.n:
            return []
        by_process = {p: {int(w[0]): (float(w[1]), float(w[2])) for w in ws} for p, ws in windows.items()}
        common = set.intersection(*(set(ws) for ws in by_process.values()))
        said = []
        for w in sorted(x for x in common if x > self.judged):
            said += self._judge(w, {p: by_process[p][w] for p in range(self.n)})
        return said

    def _judge(self, w: int, stats: dict[int, tuple[float, float]]) -> list[str]:
        consecutive = w == self.judged + 1
        self.judged = w
        own = {p: s[0] for p, s in stats.items()}
        step = statistics.median(s[1] for s in stats.values())
        said = []
        for p in range(self.n):
            self.medians[p].append(stats[p])
            if self.n < 2:
                continue
            others = statistics.median(v for q, v in own.items() if q != p)
            slow = own[p] - others > self.fraction * step
            self.streak[p] = (self.streak[p] + 1 if consecutive else 1) if slow else 0
            if self.streak[p] == CONSECUTIVE:
                self.named.add(p)
                said.append(self._warning(p, w, own[p], others, step))
                warn(said[-1])
        return said

    def _warning(self, p: int, w: int, own: float, others: float, step: float) -> str:
        first = (w - CONSECUTIVE + 1) * self.every + 1
        return (f"{describe(self.table[p])} is a straggler: in steps "
                f"{first}-{(w + 1) * self.every} its own time per step (input and host code: "
                f"the part not spent waiting for the devices) was {own:.3f} s against a median of "
                f"{others:.3f} s over the other processes, which adds about {own - others:.3f} s to every "
                f"step of the whole job (median step {step:.3f} s; train.straggler_fraction="
                f"{self.fraction:g}). Look at that host: its input pipeline (data.workers, "
                f"data.prefetch), its disk and network, other jobs on it.")

    def summary(self) -> dict:
        """run.json's `stragglers`: per process, the medians over the judged windows."""
        processes = []
        for p, rows in enumerate(self.medians):
            own, step = window_stats([r[0] for r in rows], [r[1] for r in rows])
            e = self.table[p] if p < len(self.table) else {}
            processes.append({"process": p, "host": e.get("host"), "pid": e.get("pid"),
                              "own_s_per_step": own if rows else None, "step_s": step if rows else None})
        return {"every": self.every, "fraction": self.fraction, "windows": len(self.medians[0]),
                "processes": processes, "named": sorted(self.named)}
