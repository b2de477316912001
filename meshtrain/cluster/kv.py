"""JAX's key-value store, as meshtrain's processes talk through it (its coordination service).

Process 0 hosts JAX's coordination service (jax.distributed.initialize starts it); every
process holds a client. Its key-value store and barriers carry all of meshtrain's own
traffic between processes: the start agreement (agreement.py), beats and notices
(liveness.py), the shared-directory check (shared_dir.py). No other port is opened.

Values are text that another process wrote, or anyone who reached JAX's port (it has no
authentication): `parse` takes them as untrusted input, bounded in size and depth, and
answers None for anything that is not the JSON object a caller expects.
"""

from __future__ import annotations

import json
import threading

MAX_VALUE = 1 << 20  # characters of one value: a start record with its config is ~2 KB


def parse(text) -> dict | None:
    """The JSON object in `text`, or None: not text, over MAX_VALUE, not JSON, nested
    deeper than Python's recursion limit, or not an object."""
    if not isinstance(text, str) or len(text) > MAX_VALUE:
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def index_of(key: str, prefix: str, n: int) -> int | None:
    """The process index that ends `key` (PREFIX/I), or None unless 0 <= I < n."""
    tail = key[len(prefix):].lstrip("/") if key.startswith(prefix) else ""
    if not (tail.isascii() and tail.isdigit()) or len(tail) > 9:
        return None
    i = int(tail)
    return i if i < n else None


class Store:
    """This process's client of JAX's service (after jax.distributed.initialize)."""

    def __init__(self, client=None):
        if client is None:
            from jax._src import distributed  # no public handle on the client; Orbax uses it too
            client = distributed.global_state.client
        self.client = client

    def set(self, key: str, value: str | dict, overwrite: bool = False) -> None:
        text = value if isinstance(value, str) else json.dumps(value)
        self.client.key_value_set(key, text, allow_overwrite=overwrite)

    def get(self, key: str, timeout_s: float) -> str:
        """Waits up to `timeout_s` for `key`; raises JAX's error (DEADLINE_EXCEEDED) after."""
        return _text(self.client.blocking_key_value_get_bytes(key, max(1, int(timeout_s * 1000))))

    def try_get(self, key: str) -> str | None:
        try:
            return _text(self.client.key_value_try_get_bytes(key))
        except Exception:  # noqa: BLE001 - NOT_FOUND (JaxRuntimeError): not written yet
            return None

    def entries(self, prefix: str) -> list[tuple[str, str]]:
        """Every (key, value) under PREFIX/."""
        return [(k, _text(v)) for k, v in self.client.key_value_dir_get_bytes(prefix.rstrip("/") + "/")]

    def barrier(self, name: str, timeout_s: float, processes: list[int] | None = None) -> None:
        """Waits until every process (or those listed) arrives; JAX's error names the absent."""
        self.client.wait_at_barrier(name, max(1, int(timeout_s * 1000)), processes)

    def part(self, process_id: int, n: int, timeout_s: float = 30.0) -> None:
        """The end of this process's use of JAX's service. The others disconnect; process 0,
        whose exit ends the service (and would make JAX abort whoever is still connected),
        waits until they have, at most `timeout_s`: GetAliveTasks answers once every live
        process called it or left, and the others never call it."""
        if process_id != 0:
            import jax
            jax.distributed.shutdown()
            return
        answered = threading.Event()

        def ask():
            try:
                self.client.get_live_nodes(list(range(n)))
            except Exception:  # noqa: BLE001 - the service is going anyway
                pass
            answered.set()

        threading.Thread(target=ask, name="meshtrain-part", daemon=True).start()
        answered.wait(timeout_s)


def _text(value: bytes) -> str:
    """Values are read as bytes: anyone on JAX's port may have written bytes that are not
    UTF-8, which the text getters would raise on; those become U+FFFD here."""
    return value.decode(errors="replace")
