"""Orbax's own reports, kept off the console: a failed save is one paragraph from
meshtrain (store.Checkpointer.failed), and what Orbax says about it goes to a file.

While a Checkpointer is open, DIR/orbax.log (process I > 0: DIR/orbax.process_I.log)
receives
  - Orbax's records at ERROR and above, logged through absl with the tracebacks of its
    background threads (the write, the commit, the finalize thread): a full disk gives
    four, some 300 lines;
  - the exceptions no code can catch (sys.unraisablehook) of threads other than the main
    one: after a failed write, tensorstore completes the writes still in flight in its
    own threads and calls back into the save's asyncio loop, which Orbax has closed
    ("RuntimeError: Event loop is closed", up to some 80 of them).
Orbax's warnings stay on the console; its INFO lines (one per save) are dropped, and so
are its "Reached preemption sync point" warnings, which every process repeats for each
thread that asks after a SIGTERM (the loop says it once).

The file is written when there is something to write, so a run without errors leaves
none; one that stops for a failed save names it in its paragraph, any other run that sent
something there says so in a warning at the end. A write that fails (the disk the save
filled) keeps the text in memory until `flush()` succeeds: store.failed removes the
unfinished step first.
"""

from __future__ import annotations

import logging
import pathlib
import re
import sys
import threading
import traceback

import jax

from meshtrain.errors import warn

MAX_PENDING = 2**20  # characters kept while the file cannot be written; the newest are dropped


def is_log(name: str) -> bool:
    """Whether `name`, in a checkpoint directory, is one of these logs (not a foreign file)."""
    return re.fullmatch(r"orbax(\.process_\d+)?\.log", name) is not None


def quiet_absl() -> logging.Logger:
    """Orbax's absl logger at WARNING, without the sync-point lines (once per process)."""
    absl = logging.getLogger("absl")
    absl.setLevel(logging.WARNING)
    if not any(isinstance(f, _SyncPointLines) for f in absl.filters):
        absl.addFilter(_SyncPointLines())
    return absl


class _SyncPointLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Reached preemption sync point" not in str(record.msg)


class OrbaxLog:
    """Sends Orbax's errors and its threads' uncatchable exceptions to `path` until close()."""

    def __init__(self, directory: pathlib.Path):
        i = jax.process_index()
        self.path = directory / ("orbax.log" if i == 0 else f"orbax.process_{i}.log")
        self.reports = 0  # records and exceptions received
        self._pending: list[str] = []
        self._lock = threading.Lock()
        self.format = logging.Formatter("%(asctime)s %(levelname)s [%(threadName)s] %(message)s").format
        self._errors = _Errors(self)
        self._absl = logging.getLogger("absl")
        self._absl.addFilter(self._errors)
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable

    def add(self, text: str) -> None:
        with self._lock:
            self.reports += 1
            if sum(map(len, self._pending)) < MAX_PENDING:
                self._pending.append(text if text.endswith("\n") else text + "\n")
        self.flush()

    def flush(self) -> None:
        """Writes what is held; a write that fails keeps it held (a full disk, a vanished directory)."""
        with self._lock:
            if not self._pending:
                return
            try:
                with open(self.path, "a") as f:
                    f.write("".join(self._pending))
                self._pending.clear()
            except OSError:
                pass

    def _unraisable(self, unraisable) -> None:
        # Only exceptions of other threads: the main thread's are meshtrain's own and stay visible.
        if threading.current_thread() is threading.main_thread():
            self._previous_hook(unraisable)
            return
        where = f" in {unraisable.object!r}" if unraisable.object is not None else ""
        self.add(f"[{threading.current_thread().name}] {unraisable.err_msg or 'Exception ignored'}{where}:\n"
                 + "".join(traceback.format_exception(unraisable.exc_type, unraisable.exc_value,
                                                      unraisable.exc_traceback)))

    def close(self, said: bool) -> None:
        """Gives the console back its hooks (those set after ours are left alone) and flushes;
        warns of what the log received unless the run `said` why it stops."""
        self._absl.removeFilter(self._errors)
        if sys.unraisablehook == self._unraisable:
            sys.unraisablehook = self._previous_hook
        self.flush()
        if self.reports and not said:
            warn(f"{self.reports} error report(s) from Orbax or other background threads went to "
                 f"{self.path}, though no save failed.")


class _Errors(logging.Filter):
    """An absl record at ERROR or above goes to the log, and no further."""

    def __init__(self, log: OrbaxLog):
        super().__init__()
        self.log = log

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        self.log.add(self.log.format(record))  # the traceback included
        return False
