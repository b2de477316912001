"""Liveness of a multi-process run: beats and notices through JAX's key-value store.

JAX's coordination service runs with recoverability on (distributed.py), so a dead
process no longer aborts the others with a C++ trace: this daemon thread, one per
process, finds it and stops the job naming it.

    beats    every process overwrites BEAT/I = {"n": count, ...} every `period` s, min(
             heartbeat_timeout / 4, max(1, N / 100)), and early (at most every tick, half
             a period, and PROGRESS_PERIOD s) when its progress changed. Process 0
             reads every beat; its own carries the table of where each process is and the
             count it last heard from each. The others read process 0's beat alone.
    lost     a count that stands still for distributed.heartbeat_timeout: process 0 writes
             NOTICE/0 = {"kind": "lost", "process": P, "why": ...}; the others stop on it.
             Process 0 standing still is found the same way by the others. (A dead process 0
             takes JAX's service with it, and JAX ends the others at once; the start-up log
             says so beforehand.)
    notices  NOTICE/I from process I: "failed" (it stopped with an error), "hung" (its
             watchdog fired, run/watchdog.py), "done". Every process reads them each tick.
    stop     print one paragraph naming the process (host, pid, last step) and what is
             safe on disk, then exit LOST_STATUS. Process 0 hosts the service, whose end
             would make JAX abort the others: it lingers until they wrote BYE/I or
             LINGER_S passed.
    settle   a collective fails at once in the survivors when a peer dies (gloo: "Connection
             closed by peer"), before any beat is missed. A process that fails first waits
             until every other process beat again, or until it is found lost, so the lost
             process is named, not the collective's error.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from meshtrain.cluster import kv

BEAT, NOTICE, BYE = "meshtrain/beat", "meshtrain/notice", "meshtrain/bye"
LOST_STATUS = 1
PROGRESS_PERIOD = 1.0  # s: the shortest interval between beats sent early for new progress
LINGER_S = 5.0


def describe(entry: dict) -> str:
    return f"process {entry['process']} (host {entry['host']}, pid {entry['pid']})"


class Liveness:
    def __init__(self, store: kv.Store, table: list[dict], process_id: int, heartbeat_timeout: float,
                 exit: Callable[[int], None] = os._exit):
        """`exit(status)` ends the process (os._exit; tests pass their own)."""
        self.store, self.table, self.id, self.n, self.exit = store, table, process_id, len(table), exit
        self.heartbeat_timeout = heartbeat_timeout
        # Beats every second, and rarer past 100 processes: process 0 reads every beat each
        # tick, and JAX's one service answers every process (1,000: ~500 requests/s).
        self.period = min(heartbeat_timeout / 4, max(1.0, self.n / 100))
        self.count = 0
        self.counts: dict[int, int] = {}      # the last beat count read from each process
        self.heard: dict[int, float] = {}     # when that count last moved (monotonic)
        self.done: set[int] = set()           # said "done" or "hung": their silence is no loss
        self.handled: set[tuple] = set()      # (process, kind) of the notices acted on
        self.leaving = False
        self.note: Callable[[], str] = lambda: ""  # what is safe on disk, for the loss message
        # run/watchdog.py's: beats carry progress_of() ({"at": [...], "windows": [...]}); process 0
        # keeps each process's, the others process 0's table of where each was (`where`);
        # on_hung(message) hears of a hang.
        self.progress_of: Callable[[], dict] | None = None
        self.progress: dict[int, object] = {}
        self.progress_table: object = None
        self.on_hung: Callable[[dict], None] | None = None
        self.thread: threading.Thread | None = None

    def watch(self) -> "Liveness":
        now = time.monotonic()
        self.heard = {i: now for i in (range(1, self.n) if self.id == 0 else [0])}
        self._beat({})
        self.thread = threading.Thread(target=self._loop, name="meshtrain-liveness", daemon=True)
        self.thread.start()
        return self

    # -- the thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        tick, last_beat, sent = self.period / 2, time.monotonic(), None
        while not self.leaving:
            time.sleep(tick)
            try:
                self._read_notices()
                self._read_beats()
                now = time.monotonic()
                news = {"progress": self.progress_of()} if self.progress_of is not None else {}
                if now - last_beat >= self.period or (news != sent and now - last_beat >= PROGRESS_PERIOD):
                    last_beat, sent = now, news
                    self._beat(news)
            except Exception as e:  # noqa: BLE001 - JAX's service unreachable: JAX ends us itself
                if not self.leaving:
                    print(f"meshtrain: warning: liveness: {type(e).__name__}: {str(e)[:300]}",
                          file=sys.stderr, flush=True)
                    time.sleep(1.0)

    def _beat(self, news: dict) -> None:
        self.count += 1
        beat = {"n": self.count, **news}
        if self.id == 0:  # what the others know of each other: where each was, what was heard
            own = news.get("progress", {}).get("at")
            beat["table"] = _grouped({**self.where(), **({0: own} if own else {})})
            beat["heard"] = self.counts
        self.store.set(f"{BEAT}/{self.id}", beat, overwrite=True)

    def _read_beats(self) -> None:
        now = time.monotonic()
        if self.id == 0:
            found = {kv.index_of(k, BEAT, self.n): kv.parse(v) for k, v in self.store.entries(BEAT)}
        else:
            found = {0: kv.parse(self.store.try_get(f"{BEAT}/0"))}
        for i, beat in found.items():
            if i is None or i == self.id or beat is None or not isinstance(beat.get("n"), int):
                continue
            if beat["n"] != self.counts.get(i):
                self.counts[i], self.heard[i] = beat["n"], now
            if self.id == 0 and "progress" in beat:
                self.progress[i] = beat["progress"]
            elif i == 0:
                self.progress_table = beat.get("table")
        for i, at in self.heard.items():
            if i not in self.done and now - at > self.heartbeat_timeout and not self.leaving:
                self._lost(i, f"silent for {now - at:.0f} s (distributed.heartbeat_timeout="
                              f"{self.heartbeat_timeout:g}): it died, froze, or its host is down or unreachable")

    def _read_notices(self) -> None:
        for key, value in self.store.entries(NOTICE):
            i, notice = kv.index_of(key, NOTICE, self.n), kv.parse(value)
            if i is None or i == self.id or notice is None or (i, notice.get("kind")) in self.handled:
                continue
            self.handled.add((i, notice.get("kind")))
            self._on_notice(i, notice)

    def _on_notice(self, i: int, notice: dict) -> None:
        kind, p = notice.get("kind"), notice.get("process")
        p = p if isinstance(p, int) and 0 <= p < self.n else i
        if kind == "done":
            self.done.add(i)
        elif kind == "hung":
            self.done.add(i)  # it exits next, with the hang's status
            if self.on_hung is not None:
                self.on_hung(notice)
            else:
                self._stop(f"{describe(self.table[i])} found a hang: {str(notice.get('why'))[:500]}.", gone=i)
        elif kind == "failed":
            self._stop(f"{describe(self.table[i])} stopped with status {notice.get('status')}: "
                       f"{str(notice.get('message'))[:2000]}", gone=i)
        elif kind == "lost":
            self._stop(f"{describe(self.table[p])} was lost{_at(notice.get('step'))}: "
                       f"{str(notice.get('why'))[:500]}.", gone=p)

    def _step_of(self, p: int) -> int | None:
        """The last step process p finished, as last heard."""
        at = self.where().get(p)
        return at[0] if at and isinstance(at[0], int) else None

    def where(self) -> dict[int, list]:
        """{process: [last finished step, last dispatched step, phase]} as last heard:
        process 0 from every beat, the others from process 0's table. Malformed entries
        (another process wrote them) are left out."""
        if self.id == 0:
            found = {i: p.get("at") for i, p in list(self.progress.items()) if isinstance(p, dict)}
        else:
            found = {}
            for entry in self.progress_table if isinstance(self.progress_table, list) else []:
                if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list):
                    found.update({i: entry[0] for i in entry[1] if isinstance(i, int)})
        return {i: at for i, at in found.items() if isinstance(at, list) and len(at) == 3}

    def _lost(self, i: int, why: str) -> None:
        step = self._step_of(i)
        if self.id == 0:
            self._say({"kind": "lost", "process": i, "why": why, "step": step})
        self._stop(f"{describe(self.table[i])} was lost{_at(step)}: {why}.", gone=i)

    # -- leaving -------------------------------------------------------------------------

    def _say(self, notice: dict) -> None:
        try:
            self.store.set(f"{NOTICE}/{self.id}", notice, overwrite=True)
        except Exception:  # noqa: BLE001 - the service is gone: the others hear of it from JAX
            pass

    def _stop(self, what: str, gone: int) -> None:
        if self.leaving:
            return
        self.leaving = True
        note = self.note()
        print(f"meshtrain: error: {what} Stopping process {self.id} of {self.n} too (exit "
              f"{LOST_STATUS}), so the job ends instead of hanging in a collective."
              + (f" {note}" if note else ""), file=sys.stderr, flush=True)
        sys.stdout.flush()
        self._bye(gone)
        self.exit(LOST_STATUS)

    def _bye(self, gone: int | None = None) -> None:
        """Process 0 waits (at most LINGER_S) until every other process but `gone` said bye;
        the others say it."""
        if self.id != 0:
            try:
                self.store.set(f"{BYE}/{self.id}", "bye", overwrite=True)
            except Exception:  # noqa: BLE001
                pass
            return
        waiting = set(range(1, self.n)) - {gone}
        deadline = time.monotonic() + LINGER_S
        while waiting and time.monotonic() < deadline:
            try:
                waiting -= {kv.index_of(k, BYE, self.n) for k, _ in self.store.entries(BYE)}
            except Exception:  # noqa: BLE001
                break
            time.sleep(0.05)
        time.sleep(0.2)  # their exit, after the bye

    def announce_hang(self, **message) -> None:
        """Tells the others of this process's hang; the caller exits next."""
        self.leaving = True
        self._say({"kind": "hung", "process": self.id, **message})
        self._bye()

    def settle(self) -> None:
        """A failure in this process may be a peer's loss seen first by a collective: waits
        until every other process beat again (returns) or is found lost (the thread exits).
        "Again" counts from the beats in the store now, read here: a dead peer's last beat
        may still be unread by the thread, and reading it later is no sign of life. Process
        0's counts of the others reach the others through its own beat, late by up to a
        beat, so they count a peer alive there only two beats on; a count not yet known
        when this starts is counted from where it is first seen."""
        if self.thread is None or self.leaving:
            return
        mark = self._stored_counts()
        after = {i: 1 if self.id == 0 or i == 0 else 2 for i in mark}
        deadline = time.monotonic() + self.heartbeat_timeout + 2.0
        while time.monotonic() < deadline and not self.leaving:
            now = self._stored_counts()
            mark.update({i: now.get(i, -1) for i, c in mark.items() if c < 0})  # not heard of yet
            if all(0 <= c <= now.get(i, -1) - after[i] or i in self.done for i, c in mark.items()):
                return
            time.sleep(0.05)
        while self.leaving and time.monotonic() < deadline + LINGER_S + 5:
            time.sleep(0.5)  # the thread is stopping the process

    def _stored_counts(self) -> dict[int, int]:
        """{process: beat count} of every other process, as the store holds them now:
        process 0 reads each beat, the others process 0's (its own count, and those it heard)."""
        try:
            if self.id == 0:
                beats = {kv.index_of(k, BEAT, self.n): kv.parse(v) for k, v in self.store.entries(BEAT)}
                return {i: b["n"] if isinstance(b, dict) and isinstance(b.get("n"), int) else -1
                        for i in range(1, self.n) for b in [beats.get(i)]}
            beat = kv.parse(self.store.try_get(f"{BEAT}/0"))
        except Exception:  # noqa: BLE001 - the service is gone: JAX ends this process itself
            return {}
        beat = beat if isinstance(beat, dict) else {}
        heard = beat.get("heard") if isinstance(beat.get("heard"), dict) else {}
        counts = {int(k): v for k, v in heard.items() if str(k).isascii() and str(k).isdigit() and isinstance(v, int)}
        return {0: beat.get("n") if isinstance(beat.get("n"), int) else -1,
                **{i: counts.get(i, -1) for i in range(1, self.n) if i != self.id}}

    def leave(self, status: int, message: str = "", end_timeout: float = 300.0) -> None:
        """Done (status 0): waits for every process at the end, then process 0 waits until
        the others have let go of its service. Failed: tells the others; the caller exits next."""
        if status != 0:
            self.leaving = True
            self._say({"kind": "failed", "status": status, "message": message or "no message"})
            self._bye()
            return
        self._say({"kind": "done"})
        try:
            self.store.barrier("meshtrain/end", end_timeout)
        except Exception as e:  # noqa: BLE001 - JAX's DEADLINE_EXCEEDED names who did not come
            print(f"meshtrain: warning: not every process reached the end within {end_timeout:g} s "
                  f"(distributed.init_timeout): {str(e)[:600]}", file=sys.stderr, flush=True)
        self.leaving = True
        if self.thread is not None:  # a daemon thread inside a call into JAX when Python
            self.thread.join(5.0)    # finalizes aborts the process ("exception not rethrown")
        self.store.part(self.id, self.n)


def _at(step) -> str:
    return f" (last heard at step {step})" if isinstance(step, int) else ""


def _grouped(where: dict[int, list]) -> list:
    """[[at, [processes]], ...]: processes at the same place in one entry (a beat's table
    stays small when thousands of processes are in step)."""
    groups: dict[str, list] = {}
    for i, at in sorted(where.items()):
        groups.setdefault(repr(at), [at, []])[1].append(i)
    return list(groups.values())
