"""A local text corpus: one file or a glob of files, tokenized into windows.

Split: the token stream (files concatenated in sorted order) is cut in two; the
last `val_fraction` of the tokens is held out for eval, the rest is for training.

Windows: window i of a split is tokens[i * seq_len : i * seq_len + seq_len + 1].
The stride is seq_len, so consecutive windows share one token (the last target of
window i is the first input of window i + 1) and every token after the first is a
target exactly once per epoch. A split of n tokens has (n - 1) // seq_len windows.

Order: train windows are shuffled with the seed, reshuffled each epoch
(grain `shuffle` then `repeat`); eval windows are in order and cycle if an eval
run asks for more of them than the split holds.
"""

import glob
import os
from pathlib import Path

import grain
import numpy as np

from meshtrain.data.source import DataSource
from meshtrain.data.tokenizers import ByteTokenizer, CharTokenizer, check_tokenizer_name
from meshtrain.errors import UserError

_GLOB_CHARS = "*?["


def make_text_source(path, *, tokenizer: str, val_fraction, seq_len: int,
                     seed: int) -> DataSource:
    """A DataSource over the text at `path` (a file or a glob of files)."""
    check_tokenizer_name(tokenizer)
    val_fraction = _check_val_fraction(val_fraction)
    files = resolve_paths(path)
    tok, tokens = tokenize_files(files, tokenizer, path)
    train, val = split_tokens(tokens, val_fraction)
    for name, split in (("training", train), ("held-out (eval)", val)):
        _check_split(name, len(split), len(tokens), val_fraction, len(val), seq_len)
    n_train, n_val = num_windows(len(train), seq_len), num_windows(len(val), seq_len)
    info = {
        "kind": "text", "path": str(path), "files": [str(f) for f in files],
        "tokenizer": tok.name, "vocab_size": tok.vocab_size,
        "train_tokens": len(train), "val_tokens": len(val),
        "train_windows": n_train, "val_windows": n_val, "window_stride": seq_len,
    }
    return DataSource(
        vocab_size=tok.vocab_size, seq_len=seq_len, info=info, tokenizer=tok,
        # repeat() reseeds the shuffle each epoch; positions past an epoch wrap.
        train_ids=grain.MapDataset.range(n_train).shuffle(seed=seed).repeat(),
        read_train=lambda ids: read_windows(train, ids, seq_len),
        eval_ids=grain.MapDataset.range(n_val).repeat(),
        read_eval=lambda ids: read_windows(val, ids, seq_len),
    )


def num_windows(n_tokens: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens at stride seq_len in n_tokens tokens."""
    return max(0, (n_tokens - 1) // seq_len)


def read_windows(tokens: np.ndarray, ids: np.ndarray, seq_len: int) -> np.ndarray:
    """Windows `ids` of a split; [rows] int -> [rows, seq_len + 1] int32."""
    starts = np.asarray(ids, np.int64) * seq_len
    return tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def split_tokens(tokens: np.ndarray, val_fraction: float):
    """(train, val): the val split is the last round(n * val_fraction) tokens."""
    n_val = int(round(len(tokens) * val_fraction))
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]


def resolve_paths(path) -> list[Path]:
    """The files `path` names: itself, or the sorted matches of a glob."""
    if path is None or str(path) == "":
        raise UserError(
            "data.kind is 'text' but data.path is not set. Set data.path to a text "
            "file (or a glob such as 'corpus/*.txt') to train on.")
    text = os.path.expanduser(str(path))
    if any(c in text for c in _GLOB_CHARS):
        files = sorted(Path(p) for p in glob.glob(text, recursive=True))
        files = [f for f in files if f.is_file()]
    else:
        files = [Path(text)] if Path(text).is_file() else []
        if Path(text).is_dir():
            raise UserError(
                f"data.path {str(path)!r} is a directory; it must name a text file or "
                f"a glob of files. To train on the files in it, pass a glob such as "
                f"{os.path.join(str(path), '*.txt')!r}.")
    if not files:
        raise UserError(
            f"data.path {str(path)!r} matches no file (it resolves to "
            f"{os.path.abspath(text)!r}; relative paths are taken from the working "
            f"directory, {os.getcwd()!r}). Check the spelling, pass an absolute path, "
            f"or run from the directory the path is relative to.")
    return files


def tokenize_files(files: list[Path], tokenizer: str, path):
    """(tokenizer, tokens): the files concatenated in order, encoded.

    Tokens are uint16 when the vocabulary fits (half the memory), else int32.
    """
    data = [f.read_bytes() for f in files]
    if not any(data):
        raise UserError(
            f"data.path {str(path)!r} holds no text: {len(files)} file(s), all empty. "
            f"Point data.path at a non-empty text file.")
    if tokenizer == "byte":
        tok = ByteTokenizer()
        ids = tok.encode_bytes(b"".join(data))
    else:
        text = "".join(_decode(d, f) for d, f in zip(data, files))
        tok = CharTokenizer.from_text(text)
        ids = tok.encode(text)
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.int32
    return tok, ids.astype(dtype)


def _decode(data: bytes, file: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"The char tokenizer reads UTF-8 text, but {str(file)!r} is not valid "
            f"UTF-8 ({e.reason} at byte {e.start}). Convert the file to UTF-8, or set "
            f"data.tokenizer to 'byte', which accepts any bytes.") from None


def _check_val_fraction(val_fraction) -> float:
    ok = isinstance(val_fraction, (int, float)) and not isinstance(val_fraction, bool)
    if not ok or not 0 < val_fraction < 1:
        raise UserError(
            f"data.val_fraction must be a number strictly between 0 and 1 (the share "
            f"of the token stream held out at its end for eval); got {val_fraction!r}. "
            f"Set it to, for example, 0.1.")
    return float(val_fraction)


def _check_split(name: str, n: int, total: int, val_fraction: float, n_val: int,
                 seq_len: int) -> None:
    """One window needs seq_len + 1 tokens; say so with the numbers if it won't fit."""
    if n >= seq_len + 1:
        return
    raise UserError(
        f"The {name} split is too short for one window: it has {n} tokens (of "
        f"{total} in the corpus; data.val_fraction={val_fraction:g} holds out the "
        f"last {n_val}), but one window needs seq_len + 1 = "
        f"{seq_len + 1} tokens. Use a larger corpus, a smaller seq_len, or move "
        f"data.val_fraction so that both splits hold at least {seq_len + 1} tokens.")
