"""Goodput: where a run's wall time went, and the share of it that trained new steps.

A run may take several *pieces* (starts of the command in one workdir: a preemption, a
crash, a requeue). Each piece's wall time, from its process start (from its call when another program
calls `main`: `piece_start`) to its last line, is split into:

    start-up    process start to compiling: imports, joining processes, building the
                model and data, reading the checkpoint back
    compile     compiling the train step
    steps       training steps no earlier piece had reached (productive)
    repeated    steps trained again: an earlier piece had reached them, but it stopped
                before saving them (a crash, kill -9, a hang)
    eval        evaluation
    checkpoint  the loop waiting on saves (an async save blocks only while it copies
                the arrays off the device, and for the last one to commit)
    data        the loop waiting for its next batch (the input pipeline not keeping up;
                with prefetch this is near zero)
    hang        a hang the watchdog caught: from the last finished step to the exit
    other       the rest: the end summary, closing files, Python between phases

so the shares add up to the wall time by construction, and `other` says how much the
clocks did not see. goodput = steps / wall, over every piece of the workdir.

WORKDIR/goodput.jsonl holds one JSON line per piece, rewritten at every log step and
at the end, so a piece that is killed keeps what it measured up to its last log step
(what came after is missing, not misfiled). Only process 0 writes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
import time

from meshtrain.progress import format_duration

SHARES = ("start-up", "compile", "steps", "repeated", "eval", "checkpoint", "data", "hang", "other")
FILE = "goodput.jsonl"


def process_start() -> float:
    """When this process started (seconds since the epoch): from /proc on Linux, so the
    interpreter's and JAX's import time count; elsewhere, when this module was imported."""
    try:
        stat = pathlib.Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return _IMPORTED


_IMPORTED = time.time()
PACKAGE = pathlib.Path(__file__).resolve().parent.parent


def started_by_meshtrain(argv0: str) -> bool:
    """Whether the program this process runs is a meshtrain command: the `meshtrain` console
    script or a module of the package (`python -m meshtrain.train`)."""
    program = pathlib.Path(argv0 or "")
    return program.name == "meshtrain" or PACKAGE in program.resolve().parents


def piece_start(called: float) -> float:
    """When this piece began: the process start when the process is a meshtrain command,
    so the interpreter's and JAX's imports are in its start-up; else `called`, when `main`
    was called from other Python (a notebook's kernel, a test, a script), whose process
    began earlier and for other work."""
    return process_start() if started_by_meshtrain(sys.argv[0] if sys.argv else "") else called


class Clock:
    """This piece's seconds per share. `time(share)` is a context manager; the loop adds
    each step's time with `step(seconds, repeated)`. `record()` is the piece's JSON line."""

    def __init__(self, workdir: str | None, started: float | None = None, write: bool = True):
        self.started = process_start() if started is None else started
        self.seconds = dict.fromkeys(SHARES, 0.0)
        self.steps = {"first": None, "last": None, "repeated": 0}
        self.path = pathlib.Path(workdir) / FILE if workdir and write else None
        self.earlier = read_pieces(self.path.parent) if self.path else []
        # Steps an earlier piece finished: training them again is repeated work.
        self.reached = max((p["steps"]["last"] or 0 for p in self.earlier), default=0)

    def add(self, share: str, seconds: float) -> None:
        self.seconds[share] += seconds

    @contextlib.contextmanager
    def time(self, share: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[share] += time.perf_counter() - t0

    def since_start(self, share: str) -> None:
        """Puts everything from the process start until now that no share holds yet into
        `share` (the start-up, measured once the first phase is done)."""
        self.seconds[share] += max(0.0, self.wall() - sum(self.seconds.values()))

    def step(self, step: int, seconds: float) -> None:
        repeated = step <= self.reached
        self.seconds["repeated" if repeated else "steps"] += seconds
        self.steps["repeated"] += repeated
        self.steps["first"] = step if self.steps["first"] is None else self.steps["first"]
        self.steps["last"] = step

    def hung(self, seconds: float) -> None:
        """The watchdog found a hang `seconds` after the last progress: that time is the
        "hang" share, saved at once (the process exits next)."""
        self.seconds["hang"] += seconds
        self.save()

    def wall(self) -> float:
        return time.time() - self.started

    def record(self) -> dict:
        wall = self.wall()
        seconds = dict(self.seconds)
        seconds["other"] = max(0.0, wall - sum(v for k, v in seconds.items() if k != "other"))
        return {"piece": len(self.earlier) + 1,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
                "wall_s": round(wall, 3), "seconds": {k: round(v, 3) for k, v in seconds.items()},
                "steps": dict(self.steps)}

    def save(self) -> dict:
        """Writes this piece's line after the earlier pieces' (atomically); returns it."""
        record = self.record()
        if self.path is not None:
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(p) + "\n" for p in [*self.earlier, record]))
            os.replace(tmp, self.path)
        return record

    def total(self) -> dict:
        """Every piece of the workdir, this one included, added up (see `add_up`)."""
        return add_up([*self.earlier, self.record()])


def read_pieces(workdir: pathlib.Path) -> list[dict]:
    """The pieces recorded in WORKDIR/goodput.jsonl (none if it is missing; unreadable
    lines, e.g. from a crash mid-write of an older version, are skipped)."""
    path = pathlib.Path(workdir) / FILE
    if not path.exists():
        return []
    pieces = []
    for line in path.read_text().splitlines():
        try:
            piece = json.loads(line)
        except ValueError:
            continue
        if isinstance(piece, dict) and "seconds" in piece and "steps" in piece:
            pieces.append(piece)
    return pieces


def add_up(pieces: list[dict]) -> dict:
    """{"pieces", "wall_s", "seconds": {share: s}, "repeated_steps", "goodput"} over pieces."""
    seconds = {k: sum(p["seconds"].get(k, 0.0) for p in pieces) for k in SHARES}
    wall = sum(p["wall_s"] for p in pieces)
    return {"pieces": len(pieces), "wall_s": round(wall, 3),
            "seconds": {k: round(v, 3) for k, v in seconds.items()},
            "repeated_steps": sum(p["steps"].get("repeated", 0) for p in pieces),
            "goodput": seconds["steps"] / wall if wall > 0 else None}


def line(total: dict) -> str:
    """One line: the goodput, then every share that is not zero, largest first."""
    wall, seconds = total["wall_s"], total["seconds"]
    pieces = f" over {total['pieces']} pieces" if total["pieces"] > 1 else ""
    head = (f"goodput {100 * (total['goodput'] or 0):.1f}% of {format_duration(wall)}{pieces}: ")
    parts = []
    for share in sorted(SHARES, key=lambda k: -seconds[k]):
        if seconds[share] >= 0.0005 or share == "steps":
            extra = f", {total['repeated_steps']} steps" if share == "repeated" else ""
            parts.append(f"{share} {_seconds(seconds[share])} ({100 * seconds[share] / max(wall, 1e-9):.0f}%{extra})")
    return head + " | ".join(parts)


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else format_duration(s)
