"""Training data: one entry point, `make_source`, for every kind of data.

Kinds:
  synthetic: a Markov chain with a known entropy rate (`info["best_loss"]`), so a
    loss curve has a floor to be judged against. Vocabulary from the model config.
  text: local text files (a path or glob), tokenized in memory at startup.
  tfds: a TFDS ArrayRecord dataset: one written by `python -m meshtrain.data.prepare`
    (tokens stored), or a catalog one such as lm1b (tokenized once, then cached).
For text and tfds the tokenizer decides the vocabulary (`source.vocab_size`).
"""

import numbers

from meshtrain.data.source import DataSource
from meshtrain.data.synthetic import make_synthetic_source
from meshtrain.data.text import make_text_source
from meshtrain.data.tokenizers import TOKENIZERS, load_tokenizer
from meshtrain.errors import UserError

__all__ = ["DataSource", "KINDS", "TOKENIZERS", "load_tokenizer", "make_source"]

KINDS = ("synthetic", "text", "tfds")

# The synthetic chain's vocabulary when the model config leaves it at -1 (or None).
DEFAULT_SYNTHETIC_VOCAB = 256


def make_source(data_cfg, *, vocab_size: int, seq_len: int, seed: int) -> DataSource:
    """The DataSource that `data_cfg.kind` names.

    Args:
      data_cfg: ConfigDict with kind, path, tokenizer, name, data_dir, split,
        eval_split, feature, cache_dir, val_fraction, random_offsets (only the keys
        of the chosen kind are read).
      vocab_size: the model config's vocabulary; the synthetic chain's size (-1
        or None means 256). Ignored by text sources, whose tokenizer decides.
      seq_len: tokens per training example; windows hold seq_len + 1 tokens.
      seed: non-negative; fixes the synthetic chain and its samples, and the
        order of text windows.
    """
    _check_seq_len_and_seed(seq_len, seed)
    _check_reading(data_cfg)
    kind = data_cfg.get("kind")
    if kind == "synthetic":
        vocab = DEFAULT_SYNTHETIC_VOCAB if vocab_size in (-1, None) else vocab_size
        _check_synthetic_vocab(vocab)
        return make_synthetic_source(vocab_size=vocab, seq_len=seq_len, seed=seed)
    if kind == "text":
        return make_text_source(
            data_cfg.get("path"), tokenizer=data_cfg.get("tokenizer", "byte"),
            val_fraction=data_cfg.get("val_fraction", 0.05), seq_len=seq_len, seed=seed,
            random_offsets=bool(data_cfg.get("random_offsets", False)))
    if kind == "tfds":
        from meshtrain.data.tfds_source import make_tfds_source  # lazy: imports TFDS
        return make_tfds_source(data_cfg, seq_len=seq_len, seed=seed)
    raise UserError(
        f"Unknown data.kind {kind!r}. Known kinds: {', '.join(KINDS)} ('synthetic' "
        f"is a Markov chain with a known best loss; 'text' reads data.path; 'tfds' reads "
        f"data.name from data.data_dir). Set data.kind to one of them.")


def _check_reading(d) -> None:
    workers, prefetch = d.get("workers", 0), d.get("prefetch", 0)
    if workers < 0 or prefetch < 0:
        raise UserError(
            f"data.workers={workers}, data.prefetch={prefetch}: both must be >= 0 (workers "
            f"is grain worker processes, 0 reads in this process; prefetch is batches read "
            f"ahead, 0 reads on demand).")


def _check_synthetic_vocab(vocab: int) -> None:
    if not _is_int(vocab) or vocab < 2:
        raise UserError(
            f"Synthetic data needs a vocabulary of at least 2 symbols, but the model "
            f"config's vocab_size is {vocab!r}. Set vocab_size to an integer >= 2, or "
            f"to -1 for the default of {DEFAULT_SYNTHETIC_VOCAB}.")


def _check_seq_len_and_seed(seq_len: int, seed: int) -> None:
    if not _is_int(seq_len) or seq_len < 1:
        raise UserError(
            f"seq_len must be a positive integer (tokens per training example); got "
            f"{seq_len!r}. Set it to, for example, 256.")
    if not _is_int(seed) or not 0 <= seed < 2**32:
        raise UserError(
            f"The seed must be an integer in [0, 2**32) because it seeds the data "
            f"shuffle; got {seed!r}. Set it to a non-negative integer such as 0.")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
