"""The rendezvous in one process (peers as threads): who arrived, who disagrees, busy ports,
who may join (the job's secret) and what is dropped. Losses during a run end the process,
so they are tested with real processes (tests/test_multihost.py); so are intruders during
a real start, which must leave the losses of an undisturbed run (the last test)."""

import json
import re
import select
import socket
import threading
import time

import pytest

from meshtrain.errors import RunFailed
from meshtrain.cluster import handshake
from meshtrain.cluster.channel import MAX_LINE, Channel
from meshtrain.cluster.rendezvous import Rendezvous, first_difference
from support.processes import free_port, local_sh, losses, trainer, wait_for

RUN = ["gpt2_tiny_dp8", "--config.train.steps=4", "--config.train.log_every=1", "--config.train.eval_every=0"]


def meet(n: int, port: int, configs: dict[int, dict], ids=None, timeout=5.0, secrets=None) -> dict:
    """Starts process 0 here and the others in threads; returns {id: table or error text}."""
    out = {}

    def run(i, key):
        r = Rendezvous(i, n, ("localhost", port), init_timeout=timeout, heartbeat_timeout=5,
                       config=configs.get(key, {}), secret=(secrets or {}).get(key))
        try:
            out[key] = r.start()
        except RunFailed as e:
            out[key] = str(e)
        finally:
            for channel in r.channels.values():
                channel.close()

    threads = [threading.Thread(target=run, args=(i, k)) for k, i in (ids or {i: i for i in range(1, n)}).items()]
    for t in threads:
        t.start()
    run(0, 0)
    for t in threads:
        t.join()
    return out


def test_all_arrive_and_get_the_same_table():
    out = meet(3, free_port(), {})
    assert out[0] == out[1] == out[2] and [e["process"] for e in out[0]] == [0, 1, 2]


def test_missing_processes_are_counted_and_named():
    out = meet(3, free_port(), {}, ids={1: 1}, timeout=1.0)
    want = "only 2 of 3 processes arrived within 1 s (distributed.init_timeout); missing: process 2."
    assert want in out[0] and want in out[1]


def test_a_duplicate_id_stops_both_and_process_0():
    out = meet(3, free_port(), {}, ids={"a": 1, "b": 1})
    assert all("two processes claim id 1" in text for text in out.values()), out


def test_a_config_difference_is_named():
    out = meet(2, free_port(), {0: {"config": {"train": {"seed": 0}}}, 1: {"config": {"train": {"seed": 3}}}})
    assert "first difference, process 0 vs process 1: config.train.seed: 0 vs 3" in out[0]
    assert out[0] == out[1]


def test_a_busy_port_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RunFailed, match=rf"cannot listen on port {port} .*another job may hold it"):
            Rendezvous(0, 2, ("localhost", port), init_timeout=1, heartbeat_timeout=5, config={}).start()


def test_first_difference_walks_nested_dicts():
    assert first_difference({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}}) == "a.c: 2 vs 3"
    assert first_difference({"a": 1}, {"a": 1, "z": None}) is None
    assert first_difference({"a": 1}, {"b": 1}) == "a: 1 vs None"


# -- who may join: the job's secret (handshake.py) and the line bound (channel.py) ------------

SECRET = b"the job's secret"


def test_a_hello_is_bound_to_the_secret_its_nonce_and_its_kind():
    body = json.dumps({"process": 1, "num_processes": 2, "host": "h", "pid": 7, "config": {}, "nonce": "n1"})
    line = json.dumps(handshake.seal("hello", "n0", body, SECRET)).encode()
    assert handshake.open_hello(line, "n0", SECRET)["pid"] == 7
    assert SECRET.decode() not in line.decode()  # the secret itself never goes on the wire
    for nonce, secret in [("n0-replayed-elsewhere", SECRET), ("n0", b"another secret")]:
        with pytest.raises(handshake.Refused, match="MAC does not match, claiming process 1"):
            handshake.open_hello(line, nonce, secret)
    tampered = line.replace(b'\\"pid\\": 7', b'\\"pid\\": 8')
    assert tampered != line
    with pytest.raises(handshake.Refused, match="MAC does not match"):
        handshake.open_hello(tampered, "n0", SECRET)
    as_welcome = {**handshake.seal("hello", "n1", json.dumps({"table": []}), SECRET), "type": "welcome"}
    with pytest.raises(ValueError, match="not signed with this job's MESHTRAIN_SECRET"):
        handshake.open_reply(as_welcome, "n1", SECRET)
    welcome = handshake.seal("welcome", "n1", json.dumps({"table": []}), SECRET)
    assert handshake.open_reply(welcome, "n1", SECRET) == {"table": []}


def test_malformed_hellos_are_refused_saying_what_was_wrong():
    def refusal(message) -> str:
        line = message if isinstance(message, bytes) else json.dumps(message).encode()
        with pytest.raises(handshake.Refused) as e:
            handshake.open_hello(line, "n0", None)
        return str(e.value)

    assert refusal(b"\x00\xffGET / HTTP/1.1") == "sent a line that is not JSON: b'\\x00\\xffGET / HTTP/1.1'"
    # These two killed process 0 with a traceback before (RecursionError, TypeError).
    assert refusal(b"[" * 100_000).startswith("sent a line that is not JSON: b'[[[[")
    body = json.dumps({"process": 1, "num_processes": 2, "host": "h", "pid": 7, "config": {}, "nonce": "n"})
    assert refusal({"type": "hello", "body": body, "mac": "\u00e9"}).startswith(
        "sent a hello without meshtrain's fields (a body text and a mac)")
    deep = handshake.seal("hello", "n0", "[" * 100_000, None)
    assert refusal(deep).startswith("sent a hello whose body is not JSON")
    with pytest.raises(handshake.Refused, match="without meshtrain's fields"):
        handshake.open_hello(json.dumps({"type": "hello", "body": body, "mac": "\u00e9"}).encode(), "n0", SECRET)
    with pytest.raises(ValueError, match="not signed"):
        handshake.open_reply({"type": "welcome", "body": "{}", "mac": "\u00e9"}, "n1", SECRET)
    assert refusal([1, 2]) == "sent JSON that is not a hello: b'[1, 2]'"
    assert refusal({"type": "hello", "id": 1}).startswith("sent a hello without meshtrain's fields")
    body = {"process": True, "host": "h", "pid": "7", "config": {}, "nonce": "n"}
    assert refusal(handshake.seal("hello", "n0", json.dumps(body), None)) == (
        "sent a hello with missing or mistyped fields (process=True is not an int, num_processes "
        "missing, pid='7' is not an int)")


def connect(port: int, host="localhost", patience=10.0) -> socket.socket:
    deadline = time.monotonic() + patience
    while True:
        try:
            return socket.create_connection((host, port), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"nothing listens on port {port}") from None
            time.sleep(0.05)


def test_without_a_secret_process_0_warns_once_and_still_drops_malformed_hellos(capfd):
    port = free_port()

    def intrude():
        with connect(port) as s:  # process 0 is listening
            s.sendall(json.dumps(handshake.seal("hello", "?", '{"process": "1"}', None)).encode() + b"\n")
            s.recv(1 << 16)
        meet_one = Rendezvous(1, 2, ("localhost", port), init_timeout=10, heartbeat_timeout=5, config={})
        out[1] = meet_one.start()

    out = {}
    thread = threading.Thread(target=intrude)
    thread.start()
    out[0] = Rendezvous(0, 2, ("localhost", port), init_timeout=10, heartbeat_timeout=5, config={}).start()
    thread.join()
    assert out[0] == out[1] and len(out[0]) == 2
    err = capfd.readouterr().err
    assert err.count("MESHTRAIN_SECRET is not set, so anyone who can reach port") == 1
    assert re.search(r"dropped a connection from 127\.0\.0\.1:\d+: sent a hello with missing or mistyped "
                     r"fields \(process='1' is not an int, num_processes missing, .*\); still waiting for "
                     r"1 of 2 processes\.", err), err


def start_beside_a_silent_connection(after: float) -> float:
    """Seconds process 0's start takes when a connection that says nothing comes first, and
    process 1 `after` seconds later."""
    port, out = free_port(), {}
    p0 = Rendezvous(0, 2, ("localhost", port), init_timeout=20, heartbeat_timeout=5, config={}, secret=SECRET)
    p1 = Rendezvous(1, 2, ("localhost", port), init_timeout=20, heartbeat_timeout=5, config={}, secret=SECRET)

    def others():
        out["silent"] = connect(port, "127.0.0.1")
        time.sleep(after)
        out[1] = p1.start()

    thread = threading.Thread(target=others)
    thread.start()
    began = time.monotonic()
    out[0] = p0.start()
    took = time.monotonic() - began
    thread.join()
    for channel in [out["silent"], *p0.channels.values(), *p1.channels.values()]:
        channel.close()
    assert out[0] == out[1]
    return took


def test_a_silent_connection_holds_up_no_one_and_is_dropped_after_its_window(capfd, monkeypatch):
    assert start_beside_a_silent_connection(after=0) < 15  # not after the silent one's 30 s
    monkeypatch.setattr(handshake, "HELLO_WINDOW", 0.5)
    start_beside_a_silent_connection(after=2)
    assert re.search(r"dropped a connection from 127\.0\.0\.1:\d+: sent no hello within 0\.5 s; still "
                     r"waiting for 1 of 2 processes\.", capfd.readouterr().err)


def test_processes_that_disagree_on_having_a_secret_stop_saying_so():
    port = free_port()
    out = meet(2, port, {}, timeout=1.5, secrets={0: SECRET})
    assert "process 0 has a MESHTRAIN_SECRET and process 1 has none" in out[1]
    assert ("only 1 of 2 processes arrived within 1.5 s (distributed.init_timeout); missing: process 1. "
            "1 connection(s) were dropped meanwhile") in out[0]
    out = meet(2, free_port(), {}, timeout=30, secrets={1: SECRET})  # fails at once, not after 30 s
    assert re.search(r"process 1 \(host \S+, pid \d+\) has a MESHTRAIN_SECRET and process 0 has none", out[0])
    assert "process 1 has a MESHTRAIN_SECRET and process 0 has none. Start every process with the same" in out[1]


def test_another_secret_is_refused_and_told_why():
    out = meet(2, free_port(), {}, timeout=1.5, secrets={0: SECRET, 1: b"another"})
    assert "refused this process: it sent a hello whose MAC does not match, claiming process 1" in out[1]
    assert "missing: process 1. 1 connection(s) were dropped" in out[0]


def test_all_arrive_with_the_secret_and_a_short_one_draws_a_warning(capfd):
    out = meet(3, free_port(), {}, secrets={0: SECRET, 1: SECRET, 2: SECRET})
    assert out[0] == out[1] == out[2] and len(out[0]) == 3
    assert capfd.readouterr().err == ""
    out = meet(2, free_port(), {}, secrets={0: b"abc", 1: b"abc"})
    assert out[0] == out[1] and "MESHTRAIN_SECRET has only 3 characters" in capfd.readouterr().err


def test_a_process_0_that_does_not_know_the_secret_is_not_believed():
    """Someone else listening on the port (a stranger's process 0) cannot welcome ours."""
    with socket.create_server(("localhost", 0)) as server:
        port = server.getsockname()[1]

        def impostor():
            sock, _ = server.accept()
            channel = Channel(sock)
            channel.send(type="challenge", nonce="n0", auth=True)
            hello = json.loads(channel.read(time.monotonic() + 10)["body"])
            channel.send(**handshake.seal("welcome", hello["nonce"], json.dumps({"table": []}), b"guess"))
            channel.read(time.monotonic() + 10)

        thread = threading.Thread(target=impostor)
        thread.start()
        with pytest.raises(RunFailed, match=f"at localhost:{port}, which answered, but its welcome is not "
                                            f"signed with this job's MESHTRAIN_SECRET"):
            Rendezvous(1, 2, ("localhost", port), init_timeout=10, heartbeat_timeout=5, config={},
                       secret=SECRET).start()
        thread.join()


def test_a_line_over_the_bound_cuts_the_channel_off():
    """After the start too (heartbeats): a line that never ends does not grow memory."""
    a, b = socket.socketpair()
    a.setblocking(False)
    channel = Channel(a)
    sender = threading.Thread(target=endless_line, args=(b,))
    sender.start()
    while not channel.closed:
        select.select([a], [], [], 5)
        assert channel.receive() == [] and len(channel.buffer) <= MAX_LINE
    assert channel.error == "sent a line longer than 4 MiB (the rendezvous's bound)"
    channel.close()
    sender.join()


def endless_line(sock: socket.socket) -> int:
    """Sends one line that never ends until the other side closes; returns the bytes sent."""
    sent, chunk = 0, b"x" * (1 << 16)
    try:
        while sent < 16 * MAX_LINE:
            sock.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass
    finally:
        sock.close()
    return sent


@pytest.mark.slow
def test_intruders_while_two_processes_start_are_dropped_and_the_run_trains_undisturbed(tmp_path):
    """Process 0 starts alone; a stranger with another secret, a hello without meshtrain's
    fields, a line of 100,000 '[', a garbage sender and a line that never ends connect in
    turn, and each is dropped with one line in its log. Then process 1 comes, and the two
    train with the losses of an undisturbed launch/local.sh run (which makes its own
    secret, so it does not warn)."""
    ref = tmp_path / "ref"
    done = local_sh(2, *RUN, f"--workdir={ref}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "MESHTRAIN_SECRET" not in done.stdout + (ref / "logs" / "process_0.log").read_text()

    port, w, log = free_port(), tmp_path / "w", tmp_path / "p0.txt"
    args = [f"--config={RUN[0]}", *RUN[1:], f"--workdir={w}", f"--coordinator=localhost:{port}", "--num_processes=2"]
    env = {"MESHTRAIN_SECRET": "the job's secret"}
    p0 = trainer([*args, "--process_id=0"], log, env)
    try:
        def dropped(sock: socket.socket, why: str) -> str:
            """Waits for process 0's line about this connection; returns what the intruder read."""
            reply = Channel(sock).read(time.monotonic() + 60)
            line = f"dropped a connection from 127.0.0.1:{sock.getsockname()[1]}: {why}"
            wait_for(lambda: line in log.read_text(), timeout=60, what=line)
            sock.close()
            return reply

        stranger = connect(port + 1, "127.0.0.1", patience=240)
        challenge = Channel(stranger).read(time.monotonic() + 60)
        assert challenge["type"] == "challenge" and challenge["auth"] is True
        body = json.dumps({"process": 1, "num_processes": 2, "host": "x", "pid": 1, "config": {}, "nonce": "n"})
        stranger.sendall(json.dumps(handshake.seal("hello", challenge["nonce"], body, b"guess")).encode() + b"\n")
        assert dropped(stranger, "sent a hello whose MAC does not match, claiming process 1 (host 'x', pid 1): "
                                 "another MESHTRAIN_SECRET, or not a process of this job")["type"] == "rejected"

        sock = connect(port + 1, "127.0.0.1")
        sock.sendall(b'{"type": "hello", "id": 1}\n')  # crashed process 0 with a KeyError before
        dropped(sock, "sent a hello without meshtrain's fields (a body text and a mac)")

        sock = connect(port + 1, "127.0.0.1")
        sock.sendall(b"[" * 100_000 + b"\n")  # killed process 0 with a RecursionError before
        dropped(sock, "sent a line that is not JSON: b'" + "[" * 60 + "' ... (100,000 bytes)")

        sock = connect(port + 1, "127.0.0.1")
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        dropped(sock, "sent a line that is not JSON: b'GET / HTTP/1.1\\r'")

        sock = connect(port + 1, "127.0.0.1")
        sent = endless_line(sock)
        assert sent < 16 * MAX_LINE, "process 0 kept reading a line without end"
        wait_for(lambda: re.search(r"dropped a connection from 127.0.0.1:\d+: sent a line longer than 4 MiB "
                                   r"\(the rendezvous's bound\); still waiting for 1 of 2 processes.",
                                   log.read_text()), timeout=60, what="the endless line dropped")

        p1 = trainer([*args, "--process_id=1"], tmp_path / "p1.txt", env)
        assert p1.wait(timeout=300) == 0, (tmp_path / "p1.txt").read_text()[-3000:]
        assert p0.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        p0.kill()
    assert log.read_text().count("dropped a connection") == 5 and "Traceback" not in log.read_text()
    assert losses(w) == losses(ref) and len(losses(w)) == 4


def listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* write them) of sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


@pytest.mark.parametrize("bind_host, addresses", [("127.0.0.1", {"0100007F"}), (None, {"0" * 32})])
def test_process_0_listens_on_loopback_alone_when_the_coordinator_is_loopback(bind_host, addresses):
    """launch/local.sh's coordinator is 127.0.0.1: no other machine can reach the start
    (launch.Launch.bind_host); a coordinator named by host listens on every interface."""
    port, out = free_port(), {}
    r = Rendezvous(0, 2, ("127.0.0.1", port), init_timeout=2, heartbeat_timeout=5, config={}, bind_host=bind_host)
    t = threading.Thread(target=lambda: out.setdefault("error", pytest.raises(RunFailed, r.start)))
    t.start()
    wait_for(lambda: listening(port), timeout=10, what="process 0 listening")
    assert listening(port) == addresses
    t.join()
    assert "only 1 of 2 processes arrived" in str(out["error"].value)
