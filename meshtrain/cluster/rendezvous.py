"""Rendezvous and liveness for multi-process runs: one TCP connection from each process to process 0.

JAX's runtime aborts with a C++ stack trace and no count when processes fail to
arrive, and notices a dead process only after its heartbeat timeout. This small
channel, opened before JAX's and kept for the whole run, says plainly what happened:

    start   process 0 listens on the rendezvous port (JAX's port + 1). Every other
            process connects, retrying until distributed.init_timeout, and says hello:
            id, process count, host, pid and its config. When all N are there, process 0
            answers each with the table of processes. Otherwise, at the timeout, it tells
            those that came how many arrived and who is missing, and all of them exit 1.
            Processes that disagree (count, duplicate id, config) are stopped at once.
    run     both ends send a heartbeat every heartbeat_timeout / 4 s. A process that dies
            (kill -9, OOM killer, segfault) closes its socket at once; a host that vanishes
            goes silent for heartbeat_timeout. Process 0 then tells every other process
            which one was lost, and each prints that and exits 1 instead of hanging in
            the next collective. A process that stops with an error says so first, so the
            others stop too and name it. If process 0 is lost, the others see its socket
            close, and stop.
            Beats also carry the watchdog's progress (watchdog.py) to process 0, and its
            table of all processes back; they go early (every PROGRESS_PERIOD s at most)
            when it changed. A process that finds a hang says "hung"; process 0 passes it
            on, and every process reports and exits.
    end     `leave(0)` says "done", after which a closed socket is no loss.

Messages are JSON lines: hello, welcome, abort, beat, done, failed, lost, hung.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable

from meshtrain.errors import RunFailed

LOST_STATUS = 1
PROGRESS_PERIOD = 1.0  # s: the shortest interval between beats sent early for new progress


class Channel:
    """A socket that sends and receives JSON lines."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffer = b""
        self.closed = False
        self.lock = threading.Lock()

    def send(self, **message) -> None:
        try:
            with self.lock:
                self.sock.sendall((json.dumps(message) + "\n").encode())
        except OSError:
            pass  # a broken connection shows up as EOF on the reading side

    def receive(self) -> list[dict]:
        """Reads what is there (call when readable); sets `closed` on EOF."""
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError, socket.timeout):
            return []
        except OSError:
            data = b""
        if not data:
            self.closed = True
            return []
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # not ours: ignore
        return out

    def read(self, deadline: float) -> dict | None:
        """One message, waiting until `deadline`; None on timeout or EOF."""
        while not self.closed:
            if b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                try:
                    return json.loads(line)
                except ValueError:
                    continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(1 << 16)
            except socket.timeout:
                return None
            except OSError:
                data = b""
            if not data:
                self.closed = True
            self.buffer += data
        return None

    def finish(self) -> None:
        """Reads what is queued, then half-closes: the peer gets our last message, then EOF
        (closing with unread data would send RST, which can drop that message)."""
        try:
            self.sock.setblocking(False)
            while self.sock.recv(1 << 16):
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


def describe(entry: dict) -> str:
    return f"process {entry['process']} (host {entry['host']}, pid {entry['pid']})"


def first_difference(a: dict, b: dict, prefix: str = "") -> str | None:
    """The first dotted key whose value differs between two nested dicts, with both values."""
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            found = first_difference(x, y, f"{prefix}{key}.")
            if found:
                return found
        elif x != y:
            return f"{prefix}{key}: {x!r} vs {y!r}"
    return None


class Rendezvous:
    """The channel of one process. `start()` returns the process table; `watch()` guards the run."""

    def __init__(self, process_id: int, num_processes: int, address: tuple[str, int], *,
                 init_timeout: float, heartbeat_timeout: float, config: dict):
        self.id, self.n, self.address = process_id, num_processes, address
        self.init_timeout, self.heartbeat_timeout = init_timeout, heartbeat_timeout
        self.me = {"process": process_id, "host": socket.gethostname(), "pid": os.getpid()}
        self.config = config
        self.table: list[dict] = []
        self.channels: dict[int, Channel] = {}  # process -> channel (process 0: all others; else {0: ...})
        self.heard: dict[int, float] = {}
        self.done: set[int] = set()
        self.leaving = False
        self.note: Callable[[], str] = lambda: ""  # what is safe on disk, for the loss message
        # watchdog.py's: our beats carry progress_of(); process 0 keeps every "progress" beat,
        # the others process 0's last "table"; on_hung(message) hears of a hang.
        self.progress_of: Callable[[], dict] | None = None
        self.progress: dict[int, object] = {}
        self.progress_table: object = None
        self.on_hung: Callable[[dict], None] | None = None
        self.thread: threading.Thread | None = None

    # -- start -------------------------------------------------------------------------

    def start(self) -> list[dict]:
        self.table = self._gather() if self.id == 0 else self._join()
        return self.table

    def _gather(self) -> list[dict]:
        host, port = self.address
        dual = socket.has_dualstack_ipv6()  # peers may reach this host over IPv4 or IPv6
        try:
            server = socket.create_server(("", port), family=socket.AF_INET6 if dual else socket.AF_INET,
                                          dualstack_ipv6=dual, backlog=max(self.n, 16))
        except OSError as e:
            raise RunFailed(
                f"Process 0 cannot listen on port {port} of {self.me['host']} ({e.strerror or e}): "
                f"another job may hold it. meshtrain uses the coordinator's port and the next one; "
                f"choose another pair with --coordinator=HOST:PORT (or JAX_COORDINATOR_PORT under "
                f"SLURM).") from None
        deadline = time.monotonic() + self.init_timeout
        arrived = {0: self.me}
        try:
            while len(arrived) < self.n:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._abort(self._missing_message(arrived))
                server.settimeout(remaining)
                try:
                    sock, _ = server.accept()
                except socket.timeout:
                    continue
                channel = Channel(sock)
                hello = channel.read(min(deadline, time.monotonic() + 30))
                if not hello or hello.get("type") != "hello":
                    channel.close()  # a stranger, or too slow to speak
                    continue
                problem = self._check_hello(hello, arrived)
                if problem:
                    self._abort(problem, channel)
                self.channels[hello["process"]] = channel
                arrived[hello["process"]] = {k: hello[k] for k in ("process", "host", "pid")}
        finally:
            server.close()
        table = [arrived[i] for i in range(self.n)]
        for channel in self.channels.values():
            channel.send(type="welcome", table=table)
        return table

    def _check_hello(self, hello: dict, arrived: dict) -> str | None:
        i, who = hello.get("process"), describe(hello)
        if hello.get("num_processes") != self.n:
            return (f"{who} was started for {hello.get('num_processes')} processes, process 0 for "
                    f"{self.n}. Start every process with the same count.")
        if not isinstance(i, int) or not 0 < i < self.n:
            return f"{who} says it is process {i}, outside 1..{self.n - 1}."
        if i in arrived:
            return (f"two processes claim id {i}: {describe(arrived[i])} and {who}. Give each "
                    f"process its own id in 0..{self.n - 1}.")
        diff = first_difference(self.config, hello.get("config", {}))
        if diff:
            return (f"{who} runs another config than process 0 (first difference, process 0 vs "
                    f"process {i}: {diff}). Start every process with the same --config and "
                    f"--config.* overrides.")
        return None

    def _missing_message(self, arrived: dict) -> str:
        missing = [i for i in range(self.n) if i not in arrived]
        shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
        host, port = self.address
        return (f"only {len(arrived)} of {self.n} processes arrived within {self.init_timeout:g} s "
                f"(distributed.init_timeout); missing: process {shown}. Check that every process "
                f"was started and can reach {host}:{port} (process 0's host; the log of a missing "
                f"process says why it did not come), or raise distributed.init_timeout if they "
                f"start slowly.")

    def _abort(self, reason: str, *more: Channel):
        for channel in [*self.channels.values(), *more]:
            channel.send(type="abort", reason=reason)
            channel.close()
        raise RunFailed(f"Start of {self.n} processes failed: {reason}")

    def _join(self) -> list[dict]:
        host, port = self.address
        deadline = time.monotonic() + self.init_timeout
        sock = None
        while sock is None:
            try:
                sock = socket.create_connection((host, port), timeout=5)
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RunFailed(
                        f"Process {self.id} of {self.n} could not reach process 0 at {host}:{port} "
                        f"within {self.init_timeout:g} s (distributed.init_timeout; last error: "
                        f"{e.strerror or e}). Check that process 0 was started, that {host} is its "
                        f"host and reachable from {self.me['host']}, and that ports {port - 1} and "
                        f"{port} are free and open there.") from None
                time.sleep(0.25)
        channel = Channel(sock)
        channel.send(type="hello", num_processes=self.n, config=self.config, **self.me)
        # Process 0 answers when all have arrived, by its own deadline, which may be later.
        reply = channel.read(time.monotonic() + 2 * self.init_timeout + 30)
        if reply is None or reply.get("type") not in ("welcome", "abort"):
            raise RunFailed(f"Process {self.id} of {self.n} reached process 0 at {host}:{port}, "
                            f"which did not answer (it exited or hangs; see its log).")
        if reply["type"] == "abort":
            raise RunFailed(f"Start of {self.n} processes failed: {reply['reason']}")
        self.channels[0] = channel
        return reply["table"]

    # -- run -------------------------------------------------------------------------

    def watch(self) -> None:
        """Starts the liveness thread (a daemon: it never keeps the process alive)."""
        now = time.monotonic()
        self.heard = dict.fromkeys(self.channels, now)
        self.thread = threading.Thread(target=self._loop, name="meshtrain-liveness", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        period = self.heartbeat_timeout / 4
        selector = selectors.DefaultSelector()
        for i, channel in self.channels.items():
            channel.sock.setblocking(False)
            selector.register(channel.sock, selectors.EVENT_READ, i)
        last_beat, sent = 0.0, None
        while not self.leaving:
            for key, _ in selector.select(timeout=min(period / 2, 0.5)):
                i, channel = key.data, self.channels[key.data]
                for message in channel.receive():
                    self._on_message(i, message)
                if channel.closed:
                    selector.unregister(channel.sock)
                    if i not in self.done and not self.leaving:
                        self._lost(i, "its connection closed (the process exited or was killed)")
            now = time.monotonic()
            for i, heard in self.heard.items():
                if i not in self.done and now - heard > self.heartbeat_timeout and not self.leaving:
                    self._lost(i, f"silent for {now - heard:.0f} s (distributed.heartbeat_timeout="
                                  f"{self.heartbeat_timeout:g}): its host is down or unreachable")
            news = self.progress_of() if self.progress_of is not None else {}
            if now - last_beat >= period or (news != sent and now - last_beat >= PROGRESS_PERIOD):
                last_beat, sent = now, news
                for i, channel in self.channels.items():
                    if i not in self.done:
                        channel.send(type="beat", **news)

    def _on_message(self, i: int, message: dict) -> None:
        self.heard[i] = time.monotonic()
        kind = message.get("type")
        if kind == "beat" and "progress" in message and self.id == 0:
            self.progress[i] = message["progress"]
        elif kind == "beat" and "table" in message and i == 0:
            self.progress_table = message["table"]
        elif kind == "hung":
            self._forward(i, message)
            if self.on_hung is not None:
                self.on_hung(message)
            else:
                self._stop(f"process {message.get('process')} found a hang: {message.get('why')}.",
                           gone=message.get("process"))
        elif kind == "done":
            self.done.add(i)
        elif kind == "failed":
            self._forward(i, message)
            self._stop(f"{describe(self.table[message['process']])} stopped with status "
                       f"{message['status']}: {message['message']}", gone=message["process"])
        elif kind == "lost":
            self._stop(f"{describe(self.table[message['process']])} was lost: {message['why']}.")

    def announce_hang(self, **message) -> None:
        """Tells the others of a hang (process 0 then lingers, see _linger); the caller exits next."""
        self.leaving = True
        for channel in self.channels.values():
            channel.send(type="hung", process=self.id, **message)
        if self.id == 0:
            self._linger()
        elif 0 in self.channels:
            self.channels[0].finish()  # our message, then EOF (not RST)

    def _lost(self, i: int, why: str) -> None:
        self._forward(i, {"type": "lost", "process": i, "why": why})
        self._stop(f"{describe(self.table[i])} was lost: {why}.", gone=i)

    def _forward(self, source: int, message: dict) -> None:
        if self.id == 0:  # process 0 is the hub: tell everyone else
            for j, channel in self.channels.items():
                if j != source:
                    channel.send(**message)

    def _stop(self, what: str, gone: int | None = None) -> None:
        if self.leaving:
            return
        self.leaving = True
        note = self.note()
        print(f"meshtrain: error: {what} Stopping process {self.id} of {self.n} too (exit "
              f"{LOST_STATUS}), so the job ends instead of hanging in a collective."
              + (f" {note}" if note else ""), file=sys.stderr, flush=True)
        sys.stdout.flush()
        self._linger(gone)
        os._exit(LOST_STATUS)

    def _linger(self, gone: int | None = None, timeout: float = 3.0) -> None:
        """Process 0 hosts JAX's coordination service, whose end makes JAX abort every other
        process with a stack trace: wait (briefly) until they have gone on our word. The
        process `gone` (lost or failed) is not waited for."""
        if self.id != 0:
            return
        deadline = time.monotonic() + timeout
        waiting = [c for i, c in self.channels.items() if not c.closed and i != gone]
        while waiting and time.monotonic() < deadline:
            ready, _, _ = select.select([c.sock for c in waiting], [], [], max(0.0, deadline - time.monotonic()))
            for channel in waiting:
                if channel.sock in ready:
                    channel.receive()
            waiting = [c for c in waiting if not c.closed]

    def leave(self, status: int, message: str = "") -> None:
        """Says this process is done (status 0) or failed; after a failure the caller exits
        at once (process 0 first waits for the others to go)."""
        self.leaving = True
        kind = {"type": "done"} if status == 0 else {
            "type": "failed", "process": self.id, "status": status, "message": message or "no message"}
        for channel in self.channels.values():
            channel.send(**kind)
        if status == 0:
            if self.thread is not None:
                self.thread.join(timeout=2)
            for channel in self.channels.values():
                channel.close()
        elif self.id == 0:
            self._linger()
        else:
            # Leave now: process 0 may end (and JAX abort us) as soon as it reads this.
            # Read what is queued first, so the close sends FIN after our message, not RST.
            channel = self.channels.get(0)
            if channel is not None:
                channel.finish()
