"""A progress line for long host-side work (dataset preparation, caches): done/total,
rate and ETA, redrawn in place on a terminal and every few seconds in a log file."""

import sys
import time


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Progress:
    """`update(n)` adds n units of `total`; `close()` prints the final line.

    On a terminal the line is redrawn at most 10 times a second; elsewhere (a log
    file, CI) a new line is written every 10 s so logs stay short.
    """

    def __init__(self, label: str, total: int, unit: str = "B", stream=None):
        self.label, self.total, self.unit = label, max(int(total), 1), unit
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.done = 0
        self.start = self.last = time.perf_counter()

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last >= (0.1 if self.tty else 10.0):
            self.last = now
            self._draw(now, end="\r" if self.tty else "\n")

    def close(self) -> None:
        self._draw(time.perf_counter(), end="\n")

    def _draw(self, now: float, end: str) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        frac = min(self.done / self.total, 1.0)
        eta = (self.total - self.done) / rate if rate > 0 and frac < 1 else 0.0
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        self.stream.write(
            f"{self.label} [{bar}] {100 * frac:5.1f}% {_human(self.done, self.unit)}/"
            f"{_human(self.total, self.unit)} | {_human(rate, self.unit)}/s | "
            f"{'ETA ' + format_duration(eta) if frac < 1 else 'took ' + format_duration(elapsed)}"
            f"{end}")
        self.stream.flush()


def _human(x: float, unit: str) -> str:
    for prefix in ("", "k", "M", "G", "T"):
        if abs(x) < 1000 or prefix == "T":
            if prefix == "":
                return f"{x:.1f}{unit}" if 0 < abs(x) < 10 and x != int(x) else f"{x:.0f}{unit}"
            return f"{x:.1f}{prefix}{unit}"
        x /= 1000
    return f"{x}{unit}"
