"""A local text corpus (one file or a glob), tokenized in memory at startup.

The corpus and its held-out cut are `meshtrain.data.corpus.Corpus`; each split is
its documents joined with end of text, held as one array (uint16 when the
vocabulary fits), and cut into windows by `meshtrain.data.windows`. For corpora
too large to tokenize at every start, `python -m meshtrain.data.prepare` stores
the tokens once as a TFDS dataset (data.kind = 'tfds').
"""

import numpy as np

from meshtrain.data import formats
from meshtrain.data.corpus import Corpus, resolve_paths
from meshtrain.data.source import DataSource
from meshtrain.data.tokenizers import check_tokenizer_spec, make_tokenizer
from meshtrain.data.windows import ArrayStream, stream_source, token_dtype
from meshtrain.errors import UserError

# The most text tokenized at every start: past it a start takes minutes and the text, its
# ids and the joined splits are held at once; `prepare` stores the tokens once instead.
TEXT_LIMIT = 512 * 2**20


def make_text_source(path, *, tokenizer: str, val_fraction, seq_len: int, seed: int,
                     random_offsets: bool = False) -> DataSource:
    """A DataSource over the text at `path` (a file or a glob of files)."""
    check_tokenizer_spec(tokenizer)
    files = resolve_paths(path)
    prepare = (f"meshtrain prepare --input={str(path)!r} --name=NAME --data_dir=DIR --tokenizer={tokenizer}, "
               f"then --config.data.kind=tfds --config.data.name=NAME --config.data.data_dir=DIR (docs/data.md)")
    other = {formats.format_of(f) for f in files} - {"text"}
    if other:
        raise UserError(f"data.kind=text reads plain text, but data.path {str(path)!r} holds {', '.join(sorted(other))} "
                        f"files: prepare them once: {prepare}.")
    corpus = Corpus(path, val_fraction=val_fraction, strict_utf8=tokenizer != "byte")
    if corpus.total > TEXT_LIMIT:
        raise UserError(f"data.path {str(path)!r} holds {corpus.total / 2**30:,.2f} GiB of text, more than "
                        f"data.kind=text tokenizes at every start ({TEXT_LIMIT // 2**20} MiB): store its tokens "
                        f"once, in parallel and resumably: {prepare}.")
    tok = make_tokenizer(tokenizer, corpus.text() if tokenizer == "char" else None)
    dtype = token_dtype(tok.vocab_size)
    train, val = (ArrayStream(np.concatenate(list(corpus.tokens(tok, split))).astype(dtype))
                  for split in ("train", "validation"))
    info = {"kind": "text", "path": str(path), "files": [str(f) for f in corpus.files],
            "tokenizer": tok.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id}
    return stream_source(train, val, seq_len=seq_len, seed=seed, random_offsets=random_offsets,
                         vocab_size=tok.vocab_size, info=info, tokenizer=tok,
                         where=f"data.path {str(path)!r}")
