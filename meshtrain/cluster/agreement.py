"""The start agreement of a multi-process run, through JAX's key-value store.

JAX's own start (jax.distributed.initialize) has every process connect to process 0's
coordination service and returns once all N are there. What JAX does not check is that
they are one job: started for the same count, each with its own id, with the same config.
So, before anything is compiled:

    every process   writes START/I = {process, host, pid, num_processes, config}, once
                    (a second process with the same id finds the key taken and stops,
                    naming the first)
    process 0       reads the N records, checks each against its own, and writes VERDICT:
                    {"table": [{process, host, pid}, ...]} or {"abort": reason}
    the others      wait for VERDICT: the table, or the reason, raised as RunFailed

The records are read as untrusted (kv.parse): JAX's port has no authentication, so a
record that is not meshtrain's stops the start with what was wrong, never a traceback.
"""

from __future__ import annotations

import time

from meshtrain.cluster import kv
from meshtrain.cluster.liveness import describe
from meshtrain.errors import RunFailed, shown

START, VERDICT = "meshtrain/start", "meshtrain/verdict"
FIELDS = {"process": int, "host": str, "pid": int, "num_processes": int, "config": dict}


def first_difference(a: dict, b: dict, prefix: str = "") -> str | None:
    """The first dotted key whose value differs between two nested dicts, with both values."""
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            found = first_difference(x, y, f"{prefix}{key}.")
            if found:
                return found
        elif x != y:
            return f"{prefix}{key}: {shown(x, 80)} vs {shown(y, 80)}"
    return None


def agree(store: kv.Store, me: dict, n: int, config: dict, timeout_s: float) -> list[dict]:
    """The table of the N processes, the same on each; RunFailed if they are not one job.

    me: {"process", "host", "pid"} of this process; config: what must be equal everywhere."""
    i = me["process"]
    record = {**me, "num_processes": n, "config": config}
    try:
        store.set(f"{START}/{i}", record)
    except Exception as e:  # noqa: BLE001 - ALREADY_EXISTS (JaxRuntimeError)
        if "ALREADY_EXISTS" not in str(e):
            raise
        other = kv.parse(store.try_get(f"{START}/{i}")) or {}
        who = describe(other) if not _problem(other) else "another process"
        raise RunFailed(f"Start of {n} processes failed: two processes claim id {i}: {who} and "
                        f"{describe(me)}. Give each process its own id in 0..{n - 1}.") from None
    if i == 0:
        verdict = _judge(store, record, n, timeout_s)
        store.set(VERDICT, verdict)
    else:
        verdict = kv.parse(store.get(VERDICT, timeout_s + 30)) or {"abort": "process 0's verdict is unreadable"}
    if "abort" in verdict:
        raise RunFailed(f"Start of {n} processes failed: {str(verdict['abort'])[:4000]}")
    return verdict["table"]


def _judge(store: kv.Store, mine: dict, n: int, timeout_s: float) -> dict:
    """Process 0: {"table": ...} once all N records agree with `mine`, else {"abort": why}."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = {kv.index_of(k, START, n): v for k, v in store.entries(START)}
        records.pop(None, None)
        if len(records) == n or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if len(records) < n:  # JAX saw them all connect; one never wrote: it failed in between
        missing = ", ".join(str(i) for i in range(n) if i not in records)
        return {"abort": f"process {missing} joined JAX's service but wrote no start record within "
                         f"{timeout_s:g} s (distributed.init_timeout): see its log."}
    table = []
    for i in range(n):
        record = kv.parse(records[i])
        problem = _problem(record) if record is not None else "not a JSON object"
        if not problem and record["process"] != i:
            problem = f"it says process {record['process']}"
        if problem:
            return {"abort": f"the start record of process {i} is not meshtrain's ({problem}); another "
                             f"program wrote to JAX's coordination service. Keep its port closed to "
                             f"all but the job's nodes (docs/multihost.md)."}
        problem = _disagree(record, mine)
        if problem:
            return {"abort": problem}
        table.append({k: record[k] for k in ("process", "host", "pid")})
    return {"table": table}


def _problem(record: dict) -> str:
    wrong = [f"{name} missing or not {kind.__name__}" for name, kind in FIELDS.items()
             if not isinstance(record.get(name), kind) or isinstance(record.get(name), bool)]
    return ", ".join(wrong)


def _disagree(record: dict, mine: dict) -> str | None:
    who, i = describe(record), record["process"]
    if record["num_processes"] != mine["num_processes"]:
        return (f"{who} was started for {record['num_processes']} processes, process 0 for "
                f"{mine['num_processes']}. Start every process with the same count.")
    diff = first_difference(mine["config"], record["config"])
    if diff:
        return (f"{who} runs another config than process 0 (first difference, process 0 vs process "
                f"{i}: {diff}). Start every process with the same --config and --config.* overrides.")
    return None
