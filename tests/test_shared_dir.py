"""The check that every process sees the one checkpoint directory (meshtrain/cluster/shared_dir.py).

The logic runs as threads standing in for processes, sharing a dictionary for JAX's
key-value store; then two real processes, started from different directories with the
same relative --workdir (so each has its own "runs/x"), are stopped before training."""

import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from meshtrain.cluster import shared_dir
from meshtrain.errors import UserError
from support.processes import ENV, free_port
from support.threads import each


class Store:
    """A key-value store shared by threads: set once, get blocks until the key is there."""

    def __init__(self):
        self.values, self.cond = {}, threading.Condition()

    def set(self, key, value):
        with self.cond:
            assert key not in self.values, key
            self.values[key] = value
            self.cond.notify_all()

    def get(self, key, timeout_s):
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.values, timeout_s), f"no {key}"
            return self.values[key]


@pytest.fixture(autouse=True)
def _no_wait(monkeypatch):
    monkeypatch.setattr(shared_dir, "OTHERS_WAIT_S", 0.0)  # no liveness thread here to end them


def run_check(dirs: list, patience_s=0.5) -> list:
    """verify() on len(dirs) threads, process i looking at dirs[i]: each one's error or None."""
    store, hosts = Store(), [f"node{i}" for i in range(len(dirs))]
    out = each(lambda i: shared_dir.verify(str(dirs[i]), i, hosts, store, timeout_s=20, patience_s=patience_s),
               list(range(len(dirs))))
    for e in out:
        if e is not None and not isinstance(e, UserError):
            raise e
    return [None if e is None else str(e) for e in out]


def test_one_shared_directory_passes_and_leaves_nothing_behind(tmp_path):
    d = tmp_path / "ckpt"
    assert run_check([d, d, d]) == [None, None, None]
    assert d.is_dir() and list(d.iterdir()) == []  # process 0 made it and removed its file


def test_a_process_that_sees_another_directory_stops_every_process_naming_it(tmp_path):
    shared, local = tmp_path / "shared", tmp_path / "node2-local"
    local.mkdir()
    t0 = time.monotonic()
    errors = run_check([shared, shared, local, tmp_path / "missing"])
    took = time.monotonic() - t0
    assert len(set(errors)) == 1 and errors[0]  # every process raises the same paragraph
    msg = errors[0]
    assert "not shared by the processes" in msg and f"into {shared}" in msg
    assert "2 of 3 other processes did not see it within 0.5 s" in msg
    assert f"process 2 (host node2, looked in {local}: no such file)" in msg
    assert f"process 3 (host node3, looked in {tmp_path / 'missing'}: no such directory)" in msg
    assert "process 1 " not in msg  # it saw the file
    assert "--workdir (or checkpoint.dir) as an absolute path" in msg and "node-local" in msg
    assert took < 10  # the patience (0.5 s), not the timeout


def test_a_file_that_shows_up_late_is_waited_for(tmp_path, monkeypatch):
    """A network file system may show process 0's new file a moment later elsewhere."""
    real_open, first = open, {}

    def slow_open(path, *a, **k):  # the file is invisible for its first 0.5 s
        if ".meshtrain-shared-" in str(path) and a[:1] != ("w",):
            first.setdefault(path, time.monotonic())
            if time.monotonic() - first[path] < 0.5:
                raise FileNotFoundError(path)
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", slow_open)
    assert run_check([tmp_path, tmp_path], patience_s=5) == [None, None]
    assert first  # the late path was taken


def test_one_process_or_an_object_store_is_not_checked():
    one = SimpleNamespace(launch=SimpleNamespace(num_processes=1, process_id=0), hosts=["a"])
    two = SimpleNamespace(launch=SimpleNamespace(num_processes=2, process_id=0), hosts=["a", "b"])
    shared_dir.check("/nonexistent/x", one, 1, store=object())  # no store call: would raise
    shared_dir.check("gs://bucket/run", two, 1, store=object())
    shared_dir.check(None, two, 1, store=object())


# `python -m meshtrain.train ARGS` with the check's patience for a late file cut from 15 s
# (meant for a network file system) to 1 s: here the other directory does not exist, so
# the verdict is certain and the rest of the wait would be pure waiting. The patience
# itself is tested above, on threads.
TRAIN_PATIENT_1S = ("import sys; from meshtrain.cluster import shared_dir; check = shared_dir.check; "
                    "shared_dir.check = lambda *a, **k: check(*a, **{'patience_s': 1.0, **k}); "
                    "from meshtrain import train; sys.exit(train.main(sys.argv[1:]))")


@pytest.mark.slow
def test_two_processes_with_different_directories_stop_before_training(tmp_path):
    """The same relative --workdir from two working directories: two different directories."""
    port, procs = free_port(), []
    for i in range(2):
        cwd = tmp_path / f"host{i}"
        cwd.mkdir()
        procs.append(subprocess.Popen(
            [sys.executable, "-c", TRAIN_PATIENT_1S, "--config=gpt2_tiny_dp8", "--workdir=runs/x",
             "--config.train.steps=4", f"--coordinator=localhost:{port}", "--num_processes=2",
             f"--process_id={i}"], cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    outs = [p.communicate(timeout=240)[0] for p in procs]
    # Process 0 says it (status 2: bad input); process 1 stops on its word.
    assert [p.returncode for p in procs] == [2, 1], outs
    assert "Traceback" not in outs[0] and "process 0 (host" in outs[1] and "stopped with status 2" in outs[1]
    assert (f"process 1 (host {socket.gethostname()}, looked in "
            f"{tmp_path / 'host1' / 'runs' / 'x' / 'checkpoints'}: no such directory)") in outs[0], outs[0]
    assert "did not see it within 1 s" in outs[0]  # the patience cut above
    assert "compiled train step" not in outs[0]  # stopped before compiling
    assert not (tmp_path / "host1" / "runs").exists()
