"""Windows of seq_len + 1 tokens over a token stream, addressed by window id.

A token stream is one split's documents, each followed by end of text: n tokens
with random access (`read(starts, length)`), held in memory (`ArrayStream`) or in
ArrayRecord records of a fixed number of tokens (`RecordStream`).

Strided windows (the default): window i is tokens[i*T : i*T + T + 1], T = seq_len.
The stride is T, so window i's last target is window i+1's first input and every
token but the first is a target exactly once per epoch; a stream of n tokens has
(n - 1) // T windows. Train windows are shuffled with the seed and reshuffled each
epoch (grain `shuffle` then `repeat`); eval windows are read in order.

Random-offset windows (`data.random_offsets`, as nanoGPT samples): the window at
stream position p starts at hash(seed, p) mod (n - T), any token offset, drawn
independently; an "epoch" is then just (n - 1) // T positions.
"""

import numpy as np

from meshtrain.errors import UserError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class ArrayStream:
    """A stream held in a 1-D array (numpy or memmap) of token ids."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = tokens
        self.num_tokens = len(tokens)

    def read(self, starts: np.ndarray, length: int) -> np.ndarray:
        """[rows] int64 token offsets -> [rows, length] int32."""
        return self.tokens[starts[:, None] + np.arange(length)].astype(np.int32)


class RecordStream:
    """A stream stored as records of `record_tokens` tokens (the last one shorter).

    `records` is a random-access source (len, __getitems__) of dicts whose
    `feature` holds a 1-D array; record k is tokens [k*R, (k+1)*R).
    """

    def __init__(self, records, feature: str, record_tokens: int, num_tokens: int):
        self.records = records
        self.feature = feature
        self.record_tokens = record_tokens
        self.num_tokens = num_tokens

    def read(self, starts: np.ndarray, length: int) -> np.ndarray:
        """[rows] int64 token offsets -> [rows, length] int32; one batched record read."""
        r = self.record_tokens
        first, last = starts // r, (starts + length - 1) // r
        need = np.unique(np.concatenate([np.arange(a, b + 1) for a, b in zip(first, last)]))
        got = self.records.__getitems__([int(k) for k in need])
        table = {int(k): np.asarray(rec[self.feature]) for k, rec in zip(need, got)}
        out = np.empty((len(starts), length), np.int32)
        for row, (s, a, b) in enumerate(zip(starts, first, last)):
            span = table[a] if a == b else np.concatenate([table[k] for k in range(a, b + 1)])
            off = s - a * r
            out[row] = span[off: off + length]
        return out


def token_dtype(vocab_size: int):
    """uint16 when ids < vocab_size fit (half the bytes), else int32."""
    return np.uint16 if vocab_size <= 1 << 16 else np.int32


def num_windows(n_tokens: int, seq_len: int) -> int:
    """Strided windows of seq_len + 1 tokens in n_tokens tokens."""
    return max(0, (n_tokens - 1) // seq_len)


def random_starts(seed: int, positions: np.ndarray, n_starts: int) -> np.ndarray:
    """Window starts in [0, n_starts) for stream positions; [rows] -> [rows] int64.

    Two rounds of splitmix64 on (seed, position): a counter-based draw, so a
    position's window is the same whatever batch or process reads it.
    """
    with np.errstate(over="ignore"):
        z = splitmix64(splitmix64(np.uint64(seed)) ^ np.asarray(positions, np.uint64))
    return (z % np.uint64(n_starts)).astype(np.int64)


def splitmix64(x):
    """One splitmix64 step on uint64 values (call under np.errstate(over="ignore"))."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def stream_source(train, val, *, seq_len: int, seed: int, random_offsets: bool,
                  vocab_size: int, info: dict, tokenizer, where: str):
    """A DataSource over two token streams (train and held-out)."""
    # grain loads here, not with the module: prepare's workers use this module's
    # token_dtype and would pay grain's 1-2 s import each.
    import grain

    from meshtrain.data.source import DataSource
    for name, s in (("training", train), ("held-out (eval)", val)):
        if s.num_tokens < seq_len + 1:
            raise UserError(
                f"The {name} split of {where} is too short for one window: it has "
                f"{s.num_tokens} tokens, but one window needs seq_len + 1 = {seq_len + 1}. "
                f"Use a larger corpus, a smaller model.seq_len, or a validation fraction "
                f"that leaves both splits at least {seq_len + 1} tokens.")
    n_train, n_val = num_windows(train.num_tokens, seq_len), num_windows(val.num_tokens, seq_len)
    info = dict(info, seed=seed, train_tokens=train.num_tokens, val_tokens=val.num_tokens,
                train_windows=n_train, val_windows=n_val, random_offsets=bool(random_offsets),
                window_stride=None if random_offsets else seq_len)
    if random_offsets:
        n_starts = train.num_tokens - seq_len

        def read_train(pos):
            return train.read(random_starts(seed, pos, n_starts), seq_len + 1)
        train_ids = grain.MapDataset.range(2**62)
    else:
        def read_train(ids):
            return train.read(ids * seq_len, seq_len + 1)
        # repeat() reseeds the shuffle each epoch; positions past an epoch wrap.
        train_ids = grain.MapDataset.range(n_train).shuffle(seed=seed).repeat()
    return DataSource(
        vocab_size=vocab_size, seq_len=seq_len, info=info, tokenizer=tokenizer,
        train_ids=train_ids, read_train=read_train,
        eval_ids=grain.MapDataset.range(n_val).repeat(),
        read_eval=lambda ids: val.read(ids * seq_len, seq_len + 1),
    )
