"""Several simulated processes in one test process: one thread each, acting at once."""

import threading


def each(f, items) -> list:
    """f(item) for every item, each in its own thread; per item, the result or the exception."""
    out = [None] * len(items)

    def run(i):
        try:
            out[i] = f(items[i])
        except Exception as e:  # noqa: BLE001 - returned for the test to look at
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out
