"""The start agreement and liveness through JAX's key-value store, in one process: a real
JAX coordination service and one real client per simulated process (threads), no device
backend. Deaths, hangs and strangers on JAX's port during a real run are tested with real
processes (tests/test_multihost.py)."""

import contextlib
import io
import threading
import time

import pytest

from meshtrain.cluster import agreement, kv
from meshtrain.cluster.liveness import Liveness
from meshtrain.errors import RunFailed
from meshtrain.run.watchdog import HANG_STATUS, Watchdog
from support.processes import free_port, wait_for
from support.threads import each


@contextlib.contextmanager
def service(n: int, heartbeat_s: int = 5):
    """JAX's coordination service on a free loopback port and n connected clients (kv.Store)."""
    from jax._src.lib import _jax
    address = f"127.0.0.1:{free_port()}"
    svc = _jax.get_distributed_runtime_service(address, n, heartbeat_timeout=heartbeat_s, recoverable=True)
    clients = [_jax.get_distributed_runtime_client(address, i, init_timeout=20, heartbeat_timeout=heartbeat_s,
                                                   shutdown_on_destruction=False) for i in range(n)]
    each(lambda c: c.connect(), clients)
    try:
        yield [kv.Store(c) for c in clients]
    finally:
        each(lambda c: c.shutdown(), clients)
        svc.shutdown()


def me(i: int) -> dict:
    return {"process": i, "host": f"node{i}", "pid": 100 + i}


def agree_all(stores, configs=None, ids=None, timeout=5.0) -> list:
    n = len(stores)
    ids = ids or list(range(n))
    return each(lambda k: agreement.agree(stores[k], me(ids[k]), n, (configs or {}).get(k, {"a": 1}), timeout),
                list(range(n)))


def test_every_process_gets_the_same_table():
    with service(3) as stores:
        out = agree_all(stores)
    assert out[0] == out[1] == out[2] == [me(0), me(1), me(2)]


def test_a_config_difference_stops_every_process_naming_the_first_key():
    with service(2) as stores:
        out = agree_all(stores, configs={0: {"train": {"seed": 0, "steps": 5}}, 1: {"train": {"seed": 3, "steps": 5}}})
    for e in out:
        assert isinstance(e, RunFailed)
        assert ("process 1 (host node1, pid 101) runs another config than process 0 (first difference, "
                "process 0 vs process 1: train.seed: 0 vs 3)") in str(e)


def test_a_duplicate_id_is_named_by_the_second_process():
    with service(2) as stores:
        stores[1].set(f"{agreement.START}/1", {**me(1), "num_processes": 2, "config": {}})
        with pytest.raises(RunFailed, match=r"two processes claim id 1: process 1 \(host node1, pid 101\) and "
                                            r"process 1 \(host node9, pid 9\)\. Give each process its own id"):
            agreement.agree(stores[0], {"process": 1, "host": "node9", "pid": 9}, 2, {}, 1)


@pytest.mark.parametrize("value, problem", [
    ("[" * 100_000, "not a JSON object"),
    ('{"process": 1, "host": "x"}', "pid missing or not int, num_processes missing or not int, config missing"),
    ('{"process": 0, "host": "x", "pid": 1, "num_processes": 2, "config": {}}', "it says process 0"),
    (b"\xff\xfe{", "not a JSON object"),
])
def test_a_strangers_start_record_stops_the_start_saying_what_was_wrong(value, problem):
    """JAX's port has no authentication: a record written by another program is untrusted input."""
    with service(2) as stores:
        stores[1].client.key_value_set_bytes(f"{agreement.START}/1", value if isinstance(value, bytes) else value.encode())
        with pytest.raises(RunFailed) as e:
            agreement.agree(stores[0], me(0), 2, {}, 2)
    assert "the start record of process 1 is not meshtrain's (" + problem in str(e.value)
    assert "Keep its port closed to all but the job's nodes" in str(e.value)


def test_a_process_that_never_writes_its_record_is_named():
    with service(2) as stores:
        with pytest.raises(RunFailed, match=r"process 1 joined JAX's service but wrote no start record within 0.5 s"):
            agreement.agree(stores[0], me(0), 2, {}, 0.5)


def test_parse_takes_only_bounded_json_objects():
    assert kv.parse('{"a": [1, 2]}') == {"a": [1, 2]}
    for bad in ["[" * 100_000, "x" * (kv.MAX_VALUE + 1), "\ufffd\ufffd", "[1, 2]", None, "{", 7]:
        assert kv.parse(bad) is None
    assert [kv.index_of(k, "p", 4) for k in ["p/3", "p/4", "p/-1", "p/x", "q/1", "p/\u0663", "p/" + "9" * 30]] == \
        [3, None, None, None, None, None, None]


class Exits:
    def __init__(self):
        self.status = None

    def __call__(self, status):
        self.status = status


def watch(stores, heartbeat_s=2.0, out=None):
    table = [me(i) for i in range(len(stores))]
    exits = [Exits() for _ in stores]
    peers = [Liveness(s, table, i, heartbeat_s, exit=e) for i, (s, e) in enumerate(zip(stores, exits))]
    for p in peers:
        p.watch()
    return peers, exits


def stop(peers):
    for p in peers:
        p.leaving = True
    for p in peers:
        p.thread.join(5)


def test_a_process_that_stops_beating_is_named_by_every_other_within_the_timeout(capfd):
    with service(3) as stores:
        peers, exits = watch(stores)
        peers[1].note = lambda: "the checkpoint is safe"
        peers[2].leaving = True  # its beats stop, as when it is killed
        gone = time.monotonic()
        wait_for(lambda: exits[0].status and exits[1].status, timeout=20, what="both to stop")
        took = time.monotonic() - gone
        stop(peers)
    assert exits[0].status == exits[1].status == 1 and 1.0 <= took < 4.0, took
    err = capfd.readouterr().err
    assert err.count("meshtrain: error: process 2 (host node2, pid 102) was lost: silent for 2 s "
                     "(distributed.heartbeat_timeout=2)") == 2, err
    assert "Stopping process 1 of 3 too (exit 1), so the job ends instead of hanging in a collective. " \
           "the checkpoint is safe" in err


def test_a_failed_process_is_named_and_settle_returns_while_all_beat(capfd):
    with service(2) as stores:
        peers, exits = watch(stores)
        t0 = time.monotonic()
        peers[0].settle()  # everyone beats: no loss to wait for
        assert time.monotonic() - t0 < 2.5 and exits[0].status is None
        peers[1].leave(1, "ValueError: bad batch")
        wait_for(lambda: exits[0].status, timeout=10, what="process 0 to stop")
        stop(peers)
    assert "process 1 (host node1, pid 101) stopped with status 1: ValueError: bad batch" in capfd.readouterr().err


def test_settle_takes_a_dead_peers_last_beat_for_no_sign_of_life():
    """Process 2 beats once more and dies; the others' collectives fail at once and they
    settle before their threads read that beat (or, for process 1, before process 0's beat
    passes it on). Neither may count it as a beat after the failure: both wait until process 2
    is named lost (with it, a gloo error's traceback reached the console one run in six)."""
    with service(3) as stores:
        peers, exits = watch(stores)
        peers[2]._beat({})
        peers[2].leaving = True  # dead after its last beat
        settled = {i: threading.Event() for i in (0, 1)}
        for i in (0, 1):
            threading.Thread(target=lambda i=i: (peers[i].settle(), settled[i].set()), daemon=True).start()
        wait_for(lambda: all(exits[i].status or settled[i].is_set() for i in (0, 1)), timeout=20,
                 what="both to settle or stop")
        assert [exits[i].status for i in (0, 1)] == [1, 1] and not any(e.is_set() for e in settled.values())
        stop(peers)


def test_two_processes_hear_of_a_hang_and_the_report_names_who_never_dispatched():
    """Process 1 stalls before step 6; process 0 waits on the devices for it. Process 1's
    watchdog fires first (bound 1 s, process 0's 30 s): process 0 is told through the store,
    and reports from the table the beats brought, naming process 1 and step 6."""
    with service(2) as stores:
        peers, lost = watch(stores, heartbeat_s=5.0)
        outs, exits = [io.StringIO(), io.StringIO()], [Exits(), Exits()]
        dogs = [Watchdog(bound, 60, liveness=p, table=p.table, out=o, exit=e)
                for bound, p, o, e in zip((30, 1), peers, outs, exits)]
        for w in dogs:
            w.start()
        for step in range(1, 6):
            for w in dogs:
                w.dispatched(step)
                w.finished(step)
        dogs[0].dispatched(6)
        dogs[0]._enter("device")  # process 0 waits for step 6, which process 1 never dispatches
        wait_for(lambda: exits[0].status is not None and exits[1].status is not None, timeout=30,
                 what="both watchdogs")
        for w in dogs:
            w.stop()
        stop(peers)
    assert exits[0].status == exits[1].status == HANG_STATUS and lost[0].status is None
    zero, one = outs[0].getvalue(), outs[1].getvalue()
    assert one.startswith("meshtrain: error: hang in step 6: process 1 ")
    assert zero.startswith("meshtrain: error: hang in step 6: process 0 ")
    assert "is waiting for the devices to finish step 6" in zero and "process 1 (host" in zero
    assert "found a hang (no progress for" in zero
    assert "step 6: dispatched (not finished) by process 0; not dispatched by process 1." in zero
    assert "wait in step 6's collectives for process 1 (host" in zero


def test_beats_grow_rarer_past_100_processes_and_stay_within_a_quarter_timeout():
    """Process 0 reads every beat each half period: ~500 requests/s to JAX's service at 1,000."""
    periods = [Liveness(None, [me(i) for i in range(n)], 0, timeout).period
               for n, timeout in ((2, 60), (2, 2), (1000, 60), (1000, 20))]
    assert periods == [1.0, 0.5, 10.0, 5.0]
