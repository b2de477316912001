"""One run per directory: an advisory lock that dies with its process.

A second trainer on the same workdir would interleave its checkpoints and
metrics with the first's (Orbax has no guard of its own). `flock` is released by
the kernel when the holder exits, even under `kill -9`, so a crash never leaves a
stale lock to clean up by hand. The file holds who took it, for the message.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import pathlib
import socket

from meshtrain.errors import UserError

LOCK_NAME = "meshtrain.lock"


class DirectoryLock:
    """Holds DIR/meshtrain.lock until `release()` or the end of the process."""

    def __init__(self, directory: str | os.PathLike, what: str = "directory"):
        self.path = pathlib.Path(directory) / LOCK_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 4096, 0).decode(errors="replace").strip() or "unknown process"
            os.close(self.fd)
            raise UserError(
                f"The {what} {self.path.parent} is in use by another run ({holder}). Two runs "
                f"writing one {what} would overwrite each other's checkpoints and metrics. Wait "
                f"for that run to end or stop it, or give this run another --workdir or "
                f"checkpoint.dir.") from None
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n".encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None
