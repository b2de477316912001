"""`DataSource`: batches of token windows, split across processes, on grain.

A source is two window streams (train and eval). Each stream is a grain
`MapDataset` of window ids (position in the stream -> which window), plus a
vectorised reader (window ids -> tokens). Global batch b of a stream holds stream
positions b * batch_size ... (b + 1) * batch_size - 1; process p of P reads the
contiguous rows [p * batch_size / P, (p + 1) * batch_size / P) of it. Because every
position maps to a fixed window, a batch is the same whatever the process count,
and resuming at step k is random access to batch k (nothing is replayed).
"""

import hashlib
import json
from typing import Any, Callable, Iterator

import grain
import numpy as np

from meshtrain.errors import UserError

# Rows per process in a pipeline: far past any run, yet small enough that the
# stream positions computed from them stay well inside int64.
_MAX_ROWS = 2**40

# Window ids [rows] int64 -> tokens [rows, seq_len + 1] int32 (an image source's reader
# returns a dict of arrays instead: meshtrain/data/image_source.py).
Reader = Callable[[np.ndarray], np.ndarray | dict[str, np.ndarray]]


class DataSource:
    """Train and eval token windows of one dataset.

    Attributes:
      vocab_size: token ids are in [0, vocab_size).
      seq_len: each window has seq_len + 1 tokens (inputs [:-1], targets [1:]).
      info: JSON-serialisable facts for run.json.
      tokenizer: the text tokenizer (with `save(path)`), or None for synthetic data.
    """

    def __init__(self, *, vocab_size: int, seq_len: int, info: dict[str, Any],
                 train_ids: grain.MapDataset, read_train: Reader,
                 eval_ids: grain.MapDataset, read_eval: Reader,
                 tokenizer: Any = None):
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.info = info
        self.tokenizer = tokenizer
        self._train = (train_ids, read_train)
        self._eval = (eval_ids, read_eval)

    def train_batches(self, batch_size: int, *, process_index: int = 0,
                      process_count: int = 1, start_step: int = 0, workers: int = 0,
                      prefetch: int = 2) -> "BatchIterator":
        """This process's rows of global train batches start_step, start_step + 1, ...

        Yields [batch_size // process_count, seq_len + 1] int32, forever. `workers`
        > 0 reads in that many grain worker processes; `prefetch` batches are read
        ahead by threads. Arguments are checked at the call, not at the first next().
        """
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        return BatchIterator(self, batch_size, process_index, process_count,
                             start_step * batch_size, workers, prefetch)

    def fingerprint(self) -> str:
        """Names the window stream (data, tokenizer, seq_len, seed, offsets mode)."""
        keys = ("kind", "name", "path", "splits", "tokenizer", "vocab_size", "seed",
                "train_tokens", "random_offsets", "window_stride")
        ident = {k: self.info.get(k) for k in keys}
        ident["seq_len"] = self.seq_len
        return hashlib.sha1(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def eval_batches(self, batch_size: int, num_batches: int, *, process_index: int = 0,
                     process_count: int = 1) -> Iterator[np.ndarray]:
        """This process's rows of held-out batches 0 .. num_batches - 1, same each call.

        Yields [batch_size // process_count, seq_len + 1] int32. A text source whose
        held-out split has fewer windows than num_batches * batch_size cycles over it.
        """
        batches = _pipeline(*self._eval, batch_size, process_index, process_count)
        return (batches[step] for step in range(num_batches))


class BatchIterator:
    """This process's rows of consecutive global batches, with a small saved state.

    The state is the stream position of the next global batch (windows consumed
    by all processes), so it is one JSON object for every process and restores
    under any process count (and under another batch size, which starts the next
    batch at the same window). `get_state()` / `set_state()` follow grain's
    iterator protocol; `next` after `set_state(s)` gives what the unbroken
    iterator gave after `get_state()` returned s.
    """

    def __init__(self, source: DataSource, batch_size: int, process_index: int,
                 process_count: int, position: int, workers: int, prefetch: int):
        _local_batch_size(batch_size, process_index, process_count)  # check now
        self._source = source
        self._args = (batch_size, process_index, process_count)
        self._workers, self._prefetch = workers, prefetch
        self.batch_size = batch_size
        self._start(position)

    def _start(self, position: int) -> None:
        self.position = position
        ds = _pipeline(*self._source._train, *self._args, start=position)
        # Threads read `prefetch` batches ahead of the consumer (0: read on next()).
        it = ds.to_iter_dataset(grain.ReadOptions(num_threads=self._prefetch,
                                                  prefetch_buffer_size=self._prefetch))
        if self._workers:
            _absl_flags_parsed()
            it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=self._workers))
        self._it = iter(it)

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        batch = next(self._it)
        self.position += self.batch_size
        return batch

    def get_state(self) -> dict:
        return {"position": self.position, "stream": self._source.fingerprint()}

    def set_state(self, state: dict) -> None:
        if state.get("stream") != self._source.fingerprint():
            raise UserError(
                f"The saved data state belongs to another window stream (fingerprint "
                f"{state.get('stream')!r}; this run's is {self._source.fingerprint()!r}): the "
                f"dataset, tokenizer, seq_len, seed or data.random_offsets changed. Restore "
                f"with the settings the state was saved with, or start the data afresh.")
        self._start(int(state["position"]))


def _absl_flags_parsed() -> None:
    """grain's worker processes read an absl flag, which fails unless flags were
    parsed (google/grain#1355, fixed after grain 0.2.18); meshtrain parses its own
    command line, so mark absl's as parsed."""
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _pipeline(ids: grain.MapDataset, read: Reader, batch_size: int,
              process_index: int, process_count: int, start: int = 0) -> grain.MapDataset:
    """Batch b of the result is process_index's rows of the global batch at stream
    position start + b * batch_size."""
    local = _local_batch_size(batch_size, process_index, process_count)
    offset = start + process_index * local

    def position(row: int) -> int:
        # Local row -> position in the global stream (see module docstring).
        return (row // local) * batch_size + offset + row % local

    rows = grain.MapDataset.range(_MAX_ROWS).map(position).map(lambda pos: ids[pos])
    return rows.batch(local, batch_fn=lambda win: read(np.asarray(win, np.int64)))


def _local_batch_size(batch_size: int, process_index: int, process_count: int) -> int:
    """Rows per process; a global batch that does not split evenly is a UserError."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if batch_size <= 0 or batch_size % process_count:
        raise UserError(
            f"The global batch size must be a positive multiple of the number of "
            f"processes, because every process loads an equal share of each batch; "
            f"got batch_size={batch_size} with {process_count} processes. Set the "
            f"batch size to a multiple of {process_count} (for example "
            f"{max(process_count, batch_size // process_count * process_count)}).")
    return batch_size // process_count
