"""The rendezvous in one process (peers as threads): who arrived, who disagrees, busy ports.
Losses during a run end the process, so they are tested with real processes
(tests/test_multihost.py)."""

import socket
import threading

import pytest

from meshtrain.errors import RunFailed
from meshtrain.cluster.rendezvous import Rendezvous, first_difference
from processes import free_port


def meet(n: int, port: int, configs: dict[int, dict], ids=None, timeout=5.0) -> dict:
    """Starts process 0 here and the others in threads; returns {id: table or error text}."""
    out = {}

    def run(i, key):
        r = Rendezvous(i, n, ("localhost", port), init_timeout=timeout, heartbeat_timeout=5,
                       config=configs.get(key, {}))
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
