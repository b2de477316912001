"""Is the checkpoint directory one directory for every process? Checked once, at start.

Every process writes its shards of each checkpoint into the same directory, and reads
them back on resume, so the directory must be the same on every host: a file system
that every node mounts at the same path. A node-local path (/tmp, a local disk, a
relative path started from different directories) would leave each host with a piece
of every checkpoint, and a resume would fail, or worse, find an older step on one host.

    shared_dir.check(directory, cluster, timeout_s)   # after the processes have joined

    process 0                               process i > 0
    makes DIR, writes DIR/.meshtrain-shared-TOKEN (contents TOKEN)
    publishes TOKEN  ----------------------> reads DIR/.meshtrain-shared-TOKEN, retrying
                                             for up to `patience_s` (a network file
                                             system may show a new file late)
    gathers every report <------------------ reports "ok" or what it found instead
    publishes the verdict ------------------> a failed check: process 0 raises a
    removes the file                          UserError naming the processes; the
                                              others stop on its word, or raise the
                                              same paragraph

The messages go through JAX's key-value store (its coordination service, up once
jax.distributed.initialize has run): no device collective, nothing to compile. One
process, or a directory that is an object-store URL (gs://...), needs no check.
"""

from __future__ import annotations

import os
import secrets
import time

from meshtrain.cluster import kv
from meshtrain.errors import UserError

PREFIX = "meshtrain/shared_dir"
# A failed check: the other processes let process 0 speak first (its failure reaches them
# as a notice through the key-value store, which ends them, naming it), and raise
# themselves only after this.
OTHERS_WAIT_S = 10.0


def check(directory: str | None, cluster, timeout_s: float, store=None, patience_s: float = 15.0) -> None:
    """UserError on every process unless every process of `cluster` sees `directory`.

    cluster: the joined processes (`distributed.Cluster`: launch.process_id, hosts).
    timeout_s: how long to wait for the slowest process to reach the check."""
    n = cluster.launch.num_processes
    if n == 1 or not directory or "://" in directory:
        return
    verify(directory, cluster.launch.process_id, cluster.hosts, store or kv.Store(), timeout_s, patience_s)


def verify(directory: str, process_id: int, hosts: list[str], store, timeout_s: float,
           patience_s: float) -> None:
    """The check itself, one call per process; `store` has set(key, value) and
    get(key, timeout_s), shared by the processes."""
    here = os.path.abspath(directory)
    if process_id == 0:
        token = secrets.token_hex(16)
        path = os.path.join(here, f".meshtrain-shared-{token}")
        os.makedirs(here, exist_ok=True)
        with open(path, "w") as f:
            f.write(token)
        try:
            store.set(f"{PREFIX}/token", token)
            reports = {i: store.get(f"{PREFIX}/report/{i}", timeout_s) for i in range(1, len(hosts))}
            verdict = _verdict(here, hosts, reports, patience_s)
            store.set(f"{PREFIX}/verdict", verdict)
        finally:
            try:
                os.remove(path)
            except OSError:
                pass
    else:
        token = store.get(f"{PREFIX}/token", timeout_s)
        store.set(f"{PREFIX}/report/{process_id}", _look(here, token, patience_s))
        verdict = store.get(f"{PREFIX}/verdict", timeout_s)
        if verdict:
            time.sleep(OTHERS_WAIT_S)
    if verdict:
        raise UserError(verdict)


def _look(here: str, token: str, patience_s: float) -> str:
    """"ok", or what this process found instead of process 0's file (its path included)."""
    path = os.path.join(here, f".meshtrain-shared-{token}")
    deadline = time.monotonic() + patience_s
    while True:
        try:
            with open(path) as f:
                found = f.read()
            if found == token:
                return "ok"
            problem = "the file holds something else"
        except FileNotFoundError:
            problem = "no such file" if os.path.isdir(here) else "no such directory"
        except OSError as e:
            problem = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            return f"looked in {here}: {problem}"
        time.sleep(0.2)


def _verdict(here: str, hosts: list[str], reports: dict[int, str], patience_s: float) -> str:
    """"" when every report is "ok", else the message every process raises."""
    bad = {i: r for i, r in sorted(reports.items()) if r != "ok"}
    if not bad:
        return ""
    who = "; ".join(f"process {i} (host {hosts[i]}, {r})" for i, r in bad.items())
    return (f"The checkpoint directory is not shared by the processes: process 0 (host {hosts[0]}) "
            f"wrote a check file into {here}, and {len(bad)} of {len(hosts) - 1} other processes did "
            f"not see it within {patience_s:g} s: {who}. Every process writes its part of each "
            f"checkpoint into this one directory, so it must be the same directory on every host: "
            f"give --workdir (or checkpoint.dir) as an absolute path on a file system that every "
            f"node mounts at the same path (a shared home or project file system, not /tmp or a "
            f"node-local disk).")
