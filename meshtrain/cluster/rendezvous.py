"""Rendezvous and liveness for multi-process runs: one TCP connection from each process to process 0.

JAX's runtime aborts with a C++ stack trace and no count when processes fail to
arrive, and notices a dead process only after its heartbeat timeout. This small
channel, opened before JAX's and kept for the whole run, says plainly what happened:

    start   process 0 listens on the rendezvous port (JAX's port + 1) until all N
            processes have arrived, answering each connection with a challenge (a
            nonce). Every other process connects, retrying until distributed.init_timeout,
            and says hello: id, process count, host, pid, its config and an HMAC of the
            nonce and those fields keyed by the job's secret (MESHTRAIN_SECRET;
            handshake.py has the exchange). When all N are there, process 0 answers each
            with the table of processes, signed in turn. Otherwise, at the timeout, it
            tells those that came how many arrived and who is missing, and all of them
            exit 1. Processes that disagree (count, duplicate id, config) are stopped at
            once. A connection that fails the HMAC, sends anything but a well-formed
            hello, a line over 4 MiB (channel.py) or nothing for 30 s is dropped with
            one log line, and the start goes on: only the job's processes can stop it.
    run     both ends send a heartbeat every heartbeat_timeout / 4 s. A process that dies
            (kill -9, OOM killer, segfault) closes its socket at once; a host that vanishes
            goes silent for heartbeat_timeout. Process 0 then tells every other process
            which one was lost, and each prints that and exits 1 instead of hanging in
            the next collective. A process that stops with an error says so first, so the
            others stop too and name it. If process 0 is lost, the others see its socket
            close, and stop. The port is closed by then; lines keep their 4 MiB bound.
            Beats also carry the watchdog's progress (watchdog.py) to process 0, and its
            table of all processes back; they go early (every PROGRESS_PERIOD s at most)
            when it changed. A process that finds a hang says "hung"; process 0 passes it
            on, and every process reports and exits.
    end     `leave(0)` says "done", after which a closed socket is no loss.

Messages are JSON lines: challenge, hello, welcome, abort, rejected, beat, done, failed, lost, hung.
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

from meshtrain.cluster import handshake
from meshtrain.cluster.channel import Channel
from meshtrain.errors import RunFailed

LOST_STATUS = 1
PROGRESS_PERIOD = 1.0  # s: the shortest interval between beats sent early for new progress


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
                 init_timeout: float, heartbeat_timeout: float, config: dict, secret: bytes | None = None,
                 bind_host: str | None = None):
        """`bind_host`: where process 0 listens (None: every interface)."""
        self.id, self.n, self.address, self.bind_host = process_id, num_processes, address, bind_host
        self.init_timeout, self.heartbeat_timeout = init_timeout, heartbeat_timeout
        self.me = {"process": process_id, "host": socket.gethostname(), "pid": os.getpid()}
        self.config = config
        self.secret = secret  # the job's MESHTRAIN_SECRET; None: unauthenticated
        self.table: list[dict] = []
        self.channels: dict[int, Channel] = {}  # process -> channel (process 0: all others; else {0: ...})
        self.heard: dict[int, float] = {}
        self.done: set[int] = set()  # processes that said they go (done, or hung): their close is no loss
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

    def _listen(self) -> socket.socket:
        port = self.address[1]
        try:
            if self.bind_host is not None:  # this machine's processes only (launch.bind_host)
                return socket.create_server((self.bind_host, port), backlog=max(self.n, 16))
            dual = socket.has_dualstack_ipv6()  # peers may reach this host over IPv4 or IPv6
            return socket.create_server(("", port), family=socket.AF_INET6 if dual else socket.AF_INET,
                                        dualstack_ipv6=dual, backlog=max(self.n, 16))
        except OSError as e:
            raise RunFailed(
                f"Process 0 cannot listen on port {port} of {self.me['host']} ({e.strerror or e}): "
                f"another job may hold it. meshtrain uses the coordinator's port and the next one; "
                f"choose another pair with --coordinator=HOST:PORT (or JAX_COORDINATOR_PORT under "
                f"SLURM).") from None

    def _gather(self) -> list[dict]:
        if self.secret is None:
            handshake.warn_unauthenticated(self.address[1])
        else:
            handshake.warn_if_weak(self.secret)
        deadline = time.monotonic() + self.init_timeout
        arrived = {0: self.me}
        with handshake.Lobby(self._listen(), self.n, self.secret) as lobby:
            while len(arrived) < self.n:
                try:
                    found = lobby.next_hello(deadline, waiting=self.n - len(arrived))
                except handshake.Disagree as e:
                    self._abort(str(e), e.channel)
                if found is None:
                    self._abort(self._missing_message(arrived, lobby.dropped))
                channel, hello = found
                problem = self._check_hello(hello, arrived)
                if problem:  # an authentic process of this job that does not fit: stop the start
                    self._abort(problem, channel)
                self.channels[hello["process"]] = channel
                arrived[hello["process"]] = {k: hello[k] for k in ("process", "host", "pid")}
        table = [arrived[i] for i in range(self.n)]
        body = json.dumps({"table": table})
        for channel in self.channels.values():
            channel.sock.settimeout(handshake.HELLO_WINDOW)
            channel.send(**handshake.seal("welcome", channel.nonce, body, self.secret))
        return table

    def _check_hello(self, hello: dict, arrived: dict) -> str | None:
        i, who = hello["process"], describe(hello)
        if hello["num_processes"] != self.n:
            return (f"{who} was started for {hello['num_processes']} processes, process 0 for "
                    f"{self.n}. Start every process with the same count.")
        if not 0 < i < self.n:
            return f"{who} says it is process {i}, outside 1..{self.n - 1}."
        if i in arrived:
            return (f"two processes claim id {i}: {describe(arrived[i])} and {who}. Give each "
                    f"process its own id in 0..{self.n - 1}.")
        diff = first_difference(self.config, hello["config"])
        if diff:
            return (f"{who} runs another config than process 0 (first difference, process 0 vs "
                    f"process {i}: {diff}). Start every process with the same --config and "
                    f"--config.* overrides.")
        return None

    def _missing_message(self, arrived: dict, dropped: int = 0) -> str:
        missing = [i for i in range(self.n) if i not in arrived]
        shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
        host, port = self.address
        dropped = (f" {dropped} connection(s) were dropped meanwhile (logged above: another "
                   f"{handshake.SECRET_VARIABLE}, or not this job's)." if dropped else "")
        return (f"only {len(arrived)} of {self.n} processes arrived within {self.init_timeout:g} s "
                f"(distributed.init_timeout); missing: process {shown}.{dropped} Check that every "
                f"process was started and can reach {host}:{port} (process 0's host; the log of a "
                f"missing process says why it did not come), or raise distributed.init_timeout if "
                f"they start slowly.")

    def _abort(self, reason: str, *more: Channel):
        for channel in [*self.channels.values(), *more]:
            channel.sock.settimeout(handshake.HELLO_WINDOW)
            channel.send(**handshake.seal("abort", channel.nonce, json.dumps({"reason": reason}), self.secret))
            channel.close()
        raise RunFailed(f"Start of {self.n} processes failed: {reason}")

    def _connect(self, deadline: float) -> Channel:
        host, port = self.address
        while True:
            try:
                return Channel(socket.create_connection((host, port), timeout=5), f"{host}:{port}")
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RunFailed(
                        f"Process {self.id} of {self.n} could not reach process 0 at {host}:{port} "
                        f"within {self.init_timeout:g} s (distributed.init_timeout; last error: "
                        f"{e.strerror or e}). Check that process 0 was started, that {host} is its "
                        f"host and reachable from {self.me['host']}, and that ports {port - 1} and "
                        f"{port} are free and open there.") from None
                time.sleep(0.25)

    def _join(self) -> list[dict]:
        host, port = self.address
        deadline = time.monotonic() + self.init_timeout
        failed = f"Process {self.id} of {self.n} reached process 0 at {host}:{port}, which"
        while True:
            channel = self._connect(deadline)
            challenge = channel.read(max(deadline, time.monotonic() + handshake.HELLO_WINDOW))
            if challenge is not None or channel.error or time.monotonic() > deadline:
                break
            channel.close()  # closed at once: process 0 had too many connections waiting
            time.sleep(0.25)
        if not (challenge and challenge.get("type") == "challenge" and isinstance(challenge.get("nonce"), str)):
            raise RunFailed(f"{failed} did not send meshtrain's challenge: another program holds the "
                            f"port, or process 0 is an older meshtrain. Choose another port with "
                            f"--coordinator=HOST:PORT (JAX_COORDINATOR_PORT under SLURM).")
        mine = handshake.nonce()
        body = json.dumps({**self.me, "num_processes": self.n, "config": self.config, "nonce": mine})
        channel.send(**handshake.seal("hello", challenge["nonce"], body, self.secret))
        if bool(challenge.get("auth")) != (self.secret is not None):
            has, lacks = (0, self.id) if challenge.get("auth") else (self.id, 0)
            raise RunFailed(f"Start of {self.n} processes failed: process {has} has a "
                            f"{handshake.SECRET_VARIABLE} and process {lacks} has none. "
                            f"{handshake.how_to_share()}")
        # Process 0 answers when all have arrived, by its own deadline, which may be later.
        reply = channel.read(time.monotonic() + 2 * self.init_timeout + 30)
        if reply is None or reply.get("type") not in ("welcome", "abort", "rejected"):
            raise RunFailed(f"{failed} did not answer ({channel.error or 'it exited or hangs'}; "
                            f"see its log).")
        if reply["type"] == "rejected":
            raise RunFailed(f"{failed} refused this process: it {str(reply.get('reason'))[:300]}. "
                            f"{handshake.how_to_share()}")
        try:
            body = handshake.open_reply(reply, mine, self.secret)
        except ValueError as e:
            raise RunFailed(f"{failed} answered, but {e}.") from None
        if reply["type"] == "abort":
            raise RunFailed(f"Start of {self.n} processes failed: {body['reason']}")
        self.channels[0] = channel
        return body["table"]

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
                        self._lost(i, channel.error or "its connection closed (the process exited or was killed)")
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
            # Whoever sent it exits next (with the hang's status): its close is no loss, even
            # where our own watchdog is still writing its report of the same hang.
            self.done.add(i)
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
