"""JSON lines over one socket, each line at most MAX_LINE bytes (the rendezvous's wire).

Messages are JSON objects, one per line. A peer that sends a longer line, or one that
never ends, is cut off (`closed`, with `error` saying why) instead of growing this
process's memory for as long as it likes: 4 MiB holds a hello (whose config is about
1.5 KB) or the welcome's process table of 40,000 processes (~80 bytes each) with room to
spare. Lines that are not JSON objects are skipped by `receive` and `read`; process 0's
start reads raw `lines()` and says what was wrong with them (handshake.py).
"""

from __future__ import annotations

import json
import socket
import threading
import time

MAX_LINE = 4 << 20  # bytes in one line, newline excluded
_CHUNK = 1 << 16


class Channel:
    """A socket that sends and receives JSON lines."""

    def __init__(self, sock: socket.socket, peer: str = ""):
        self.sock = sock
        self.peer = peer           # "HOST:PORT" of the other end, for log lines
        self.buffer = b""          # the unfinished line
        self.queue: list[bytes] = []  # complete lines not read yet
        self.closed = False        # EOF, a broken connection, or cut off (then `error`)
        self.error = ""
        self.challenge = ""        # process 0: the nonce it sent this peer (handshake.py)
        self.nonce = ""            # process 0: the nonce the peer's hello chose
        self.lock = threading.Lock()

    def send(self, **message) -> None:
        try:
            with self.lock:
                self.sock.sendall((json.dumps(message) + "\n").encode())
        except OSError:
            pass  # a broken connection shows up as EOF on the reading side

    def _take(self, data: bytes) -> None:
        """Adds received bytes; EOF or a line over MAX_LINE closes the channel."""
        if not data:
            self.closed = True
            return
        if b"\n" in data:
            *lines, rest = (self.buffer + data).split(b"\n")
            self.queue += lines
            self.buffer = rest
        else:
            self.buffer += data
        if len(self.buffer) > MAX_LINE or any(len(line) > MAX_LINE for line in self.queue):
            self.error = f"sent a line longer than {MAX_LINE >> 20} MiB (the rendezvous's bound)"
            self.closed, self.buffer, self.queue = True, b"", []

    def _recv(self) -> bytes | None:
        """What the socket holds (b"" on EOF or a broken connection); None if nothing yet."""
        try:
            return self.sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError, socket.timeout):
            return None
        except OSError:
            return b""

    def lines(self) -> list[bytes]:
        """The complete lines so far (call when readable), raw."""
        if not self.closed:
            data = self._recv()
            if data is not None:
                self._take(data)
        out, self.queue = self.queue, []
        return out

    def receive(self) -> list[dict]:
        """The messages so far (call when readable); sets `closed` on EOF."""
        return [m for m in map(_parse, self.lines()) if m is not None]

    def read(self, deadline: float) -> dict | None:
        """One message, waiting until `deadline`; None on timeout, EOF or a cut-off."""
        while True:
            while self.queue:
                message = _parse(self.queue.pop(0))
                if message is not None:
                    return message
            remaining = deadline - time.monotonic()
            if self.closed or remaining <= 0:
                return None
            self.sock.settimeout(remaining)
            data = self._recv()
            if data is None and time.monotonic() >= deadline:
                return None
            if data is not None:
                self._take(data)

    def finish(self) -> None:
        """Reads what is queued, then half-closes: the peer gets our last message, then EOF
        (closing with unread data would send RST, which can drop that message)."""
        try:
            self.sock.setblocking(False)
            while self.sock.recv(_CHUNK):
                pass
        except OSError:
            pass
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


NOT_JSON = object()


def loads(text: str | bytes):
    """The JSON value of text from the network, or NOT_JSON: invalid text (ValueError,
    which covers bad UTF-8), and nesting deeper than Python's recursion limit, which json
    reports as RecursionError (a line of 100,000 '[' from a stranger)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return NOT_JSON


def _parse(line: bytes) -> dict | None:
    """A JSON object, or None for anything else (not ours: skipped)."""
    message = loads(line)
    return message if isinstance(message, dict) else None
