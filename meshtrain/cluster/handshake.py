"""Who may join a job's start: a per-job secret, proven by HMAC, never sent.

Every process of a job gets the same secret in the environment variable MESHTRAIN_SECRET
(launch/local.sh and launch/slurm.sbatch make a fresh one per launch; by hand, run
`export MESHTRAIN_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')`
once and start every process from that shell). Each side of the rendezvous proves that
it knows the secret K with an HMAC over a nonce the other side chose:

    process 0                                   process i
    accept ---- challenge {nonce: N0, auth} ---> N0: 16 random bytes, new per connection;
                                                 auth: whether process 0 has a secret
           <--- hello {body, mac} -------------- body: JSON text of {process, num_processes,
                                                   host, pid, config, nonce: Ni}
                                                 mac = H(K, "hello", N0, body)
    mac, then fields, then config checked
           ---- welcome {body, mac} -----------> body: {"table": [...]}, mac = H(K, "welcome", Ni, body)
           (or abort {body: {"reason"}, mac})    checked: process 0 knows K too
           (or rejected {reason}, unsigned, then the connection is closed)

    H(K, kind, nonce, body) = hex HMAC-SHA256(K, kind + "\\n" + nonce + "\\n" + body)

The body travels as JSON text inside the message, so the MAC covers exactly the bytes
that were sent, with no canonical re-encoding. The kind keeps a hello from passing as a
welcome; the nonces, new for every connection, keep a recorded hello or welcome from
being replayed. Process 0 compares MACs with `hmac.compare_digest`. Only a hello whose
MAC holds can make the start fail (another config, a duplicate id): everything else is
`Refused`, dropped with one log line, and the start goes on waiting. Process 0 (`Lobby`)
hears every connection at once, gives each HELLO_WINDOW seconds for its hello, and keeps
at most N + 64 waiting (more are closed at once, and a real process then retries).

Not protected: messages after the welcome (heartbeats) are not signed, and nothing is
encrypted (the config travels in the clear); JAX's own coordination port is not ours.
Without a secret `mac` is null, process 0 warns once, and any well-formed hello is
believed, as before; malformed input and long lines are still dropped. A process with
a secret and a process 0 without one (or the reverse) both stop, saying so.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import selectors
import socket
import sys
import time
from collections.abc import Mapping

from meshtrain.cluster.channel import NOT_JSON, Channel, loads

SECRET_VARIABLE = "MESHTRAIN_SECRET"
MAKE_SECRET = "export MESHTRAIN_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')"
HELLO_WINDOW = 30.0  # seconds a connection may take to say its hello
LOGGED_DROPS = 20    # dropped connections logged one by one; later ones are only counted
HELLO_FIELDS = {"process": int, "num_processes": int, "host": str, "pid": int, "config": dict, "nonce": str}


class Refused(Exception):
    """A connection to drop: the message says what was wrong with what it sent."""


class Disagree(Exception):
    """A well-formed hello from a process with a secret, to a process 0 without one."""

    channel: Channel | None = None


class Lobby:
    """Process 0's side of the start: every connection at once (a silent one cannot hold up
    the others), each challenged, until `next_hello` finds an authentic hello; the rest are
    dropped with one log line each (the first LOGGED_DROPS), and counted in `dropped`."""

    def __init__(self, server: socket.socket, n: int, secret: bytes | None):
        self.server, self.n, self.secret = server, n, secret
        self.pending: dict[Channel, float] = {}  # connected, no hello yet -> by when it must come
        self.dropped = 0
        self.waiting = n - 1  # processes still awaited, for the log lines
        server.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(server, selectors.EVENT_READ)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for channel in self.pending:
            channel.close()
        self.selector.close()
        self.server.close()

    def next_hello(self, deadline: float, waiting: int) -> tuple[Channel, dict] | None:
        """The next authentic hello and its channel (no longer pending), or None at `deadline`."""
        self.waiting = waiting
        while (now := time.monotonic()) < deadline:
            for channel, by in list(self.pending.items()):
                if now >= by:
                    self.drop(channel, f"sent no hello within {HELLO_WINDOW:g} s")
            wake = min([deadline, *self.pending.values()])
            for key, _ in self.selector.select(max(0.0, wake - now)):
                if key.data is None:
                    self._accept(deadline)
                elif key.data in self.pending:
                    found = self._hear(key.data)
                    if found:
                        return found
        return None

    def _accept(self, deadline: float) -> None:
        try:
            sock, address = self.server.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        host, port = address[0].removeprefix("::ffff:"), address[1]  # IPv4 on a dual-stack socket
        channel = Channel(sock, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        if len(self.pending) >= self.n + 64:  # a flood; a real process retries when closed at once
            self.drop(channel, f"came while {len(self.pending)} connections wait for their hello")
            return
        channel.challenge = nonce()
        channel.send(type="challenge", nonce=channel.challenge, auth=self.secret is not None)
        self.pending[channel] = min(deadline, time.monotonic() + HELLO_WINDOW)  # now: select may have waited
        self.selector.register(sock, selectors.EVENT_READ, channel)

    def _hear(self, channel: Channel) -> tuple[Channel, dict] | None:
        lines = channel.lines()
        if not lines:
            if channel.closed:
                self.drop(channel, channel.error or "closed the connection without a hello")
            return None
        try:
            hello = open_hello(lines[0], channel.challenge, self.secret)
        except Refused as e:
            self.drop(channel, str(e), tell=True)
            return None
        except Disagree as e:
            e.channel = channel
            raise
        finally:
            if channel in self.pending:
                del self.pending[channel]
                self.selector.unregister(channel.sock)
        channel.queue[:0] = lines[1:]  # (none from meshtrain: it waits for the welcome)
        channel.nonce = hello["nonce"]
        return channel, hello

    def drop(self, channel: Channel, why: str, tell: bool = False) -> None:
        """Closes a connection that is not (or not provably) one of the job's processes;
        `tell` also says why to the other end (a process with another secret learns it)."""
        if channel in self.pending:
            del self.pending[channel]
            self.selector.unregister(channel.sock)
        if tell:
            channel.send(type="rejected", reason=why)
        channel.close()
        self.dropped += 1
        if self.dropped <= LOGGED_DROPS:
            more = " (later ones are counted, not logged)" if self.dropped == LOGGED_DROPS else ""
            print(f"meshtrain: warning: rendezvous: dropped a connection from {channel.peer}: {why}; "
                  f"still waiting for {self.waiting} of {self.n} processes{more}.",
                  file=sys.stderr, flush=True)


def secret_from(environ: Mapping[str, str]) -> bytes | None:
    value = environ.get(SECRET_VARIABLE, "")
    return value.encode() if value else None


def nonce() -> str:
    return secrets.token_hex(16)


def mac(secret: bytes, kind: str, nonce_: str, body: str) -> str:
    return hmac.new(secret, f"{kind}\n{nonce_}\n{body}".encode(), hashlib.sha256).hexdigest()


def seal(kind: str, nonce_: str, body: str, secret: bytes | None) -> dict:
    """The message {type, body, mac} to send; `body` is JSON text."""
    return {"type": kind, "body": body, "mac": mac(secret, kind, nonce_, body) if secret else None}


def open_hello(line: bytes, nonce_: str, secret: bytes | None) -> dict:
    """The fields of the hello on `line`, answering the challenge `nonce_`; raises Refused
    (drop it) or Disagree (a process of the job without our secret setting: stop the start)."""
    message = loads(line)
    if message is NOT_JSON:
        raise Refused(f"sent a line that is not JSON: {_show(line)}")
    if not isinstance(message, dict) or message.get("type") != "hello":
        raise Refused(f"sent JSON that is not a hello: {_show(line)}")
    body, sign = message.get("body"), message.get("mac")
    if not isinstance(body, str) or not (sign is None or (isinstance(sign, str) and sign.isascii())):
        raise Refused(f"sent a hello without meshtrain's fields (a body text and a mac): {_show(line)}")
    if secret is not None:
        if sign is None:
            raise Refused(f"sent a hello without a MAC{_claims(body)}: that process has no "
                          f"{SECRET_VARIABLE}, process 0 has one")
        if not hmac.compare_digest(sign, mac(secret, "hello", nonce_, body)):
            raise Refused(f"sent a hello whose MAC does not match{_claims(body)}: another "
                          f"{SECRET_VARIABLE}, or not a process of this job")
    hello = loads(body)
    if hello is NOT_JSON:
        raise Refused(f"sent a hello whose body is not JSON: {_show(body.encode())}")
    wrong = fields_problem(hello)
    if wrong:
        raise Refused(f"sent a hello with missing or mistyped fields ({wrong})")
    if secret is None and sign is not None:
        raise Disagree(
            f"process {hello['process']} (host {hello['host']}, pid {hello['pid']}) has a "
            f"{SECRET_VARIABLE} and process 0 has none. {how_to_share()}")
    return hello


def fields_problem(hello) -> str:
    """'' if `hello` holds every field with its type, else what is wrong."""
    if not isinstance(hello, dict):
        return f"a {type(hello).__name__}, not an object"
    wrong = []
    for name, kind in HELLO_FIELDS.items():
        value = hello.get(name)
        if name not in hello:
            wrong.append(f"{name} missing")
        elif not isinstance(value, kind) or isinstance(value, bool):
            wrong.append(f"{name}={_short(value)} is not {'an' if kind is int else 'a'} {kind.__name__}")
    if not wrong and not 0 < len(hello["nonce"]) <= 128:
        wrong.append("nonce is not 1 to 128 characters")
    return ", ".join(wrong)


def open_reply(message: dict, nonce_: str, secret: bytes | None) -> dict:
    """The body of process 0's welcome or abort to the hello that chose `nonce_`; raises
    ValueError saying what was wrong."""
    kind, body, sign = message.get("type"), message.get("body"), message.get("mac")
    if not isinstance(body, str):
        raise ValueError(f"its {kind} has no body")
    if secret is not None and not (isinstance(sign, str) and sign.isascii() and
                                   hmac.compare_digest(sign, mac(secret, kind, nonce_, body))):
        raise ValueError(f"its {kind} is not signed with this job's {SECRET_VARIABLE}: it is not "
                         f"this job's process 0, or has another secret")
    opened = loads(body)
    key, kind_of = ("table", list) if kind == "welcome" else ("reason", str)
    if not isinstance(opened, dict) or not isinstance(opened.get(key), kind_of):
        raise ValueError(f"its {kind} lacks its {key}")
    return opened


def how_to_share() -> str:
    return (f"Start every process with the same {SECRET_VARIABLE} in its environment "
            f"(launch/local.sh and launch/slurm.sbatch set one; by hand: {MAKE_SECRET}, then start "
            f"each process from that shell), or with none at all.")


def warn_unauthenticated(port: int) -> None:
    print(f"meshtrain: warning: {SECRET_VARIABLE} is not set, so anyone who can reach port {port} "
          f"of this host while the processes start can join or stop the start. To allow only this "
          f"job's processes, give every process the same secret: {MAKE_SECRET} before starting "
          f"them (launch/local.sh and launch/slurm.sbatch do this for you).",
          file=sys.stderr, flush=True)


def warn_if_weak(secret: bytes) -> None:
    """A short secret can be guessed offline from one recorded hello (its nonce, body and MAC)."""
    if len(secret) < 16:
        print(f"meshtrain: warning: {SECRET_VARIABLE} has only {len(secret)} characters, which can "
              f"be guessed from one recorded hello; make it long and random: {MAKE_SECRET}.",
              file=sys.stderr, flush=True)


def _claims(body: str) -> str:
    """', claiming process I (host H, pid P)' when the body says so."""
    hello = loads(body)
    if not isinstance(hello, dict):
        return ""
    return (f", claiming process {_short(hello.get('process'))} (host {_short(hello.get('host'))}, "
            f"pid {_short(hello.get('pid'))})")


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _show(data: bytes, limit: int = 60) -> str:
    return repr(data[:limit]) + (f" ... ({len(data):,} bytes)" if len(data) > limit else "")

