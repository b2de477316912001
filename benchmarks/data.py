"""Tokens per second the data pipeline delivers, against what training consumes.

    python benchmarks/data.py [--tokens=20000000] [--batches=200]

Writes a pre-tokenized meshtrain token dataset (random ids, documents of random
length joined with end of text, GPT-2-sized uint16 records) into a temporary
TFDS data_dir, then times `DataSource.train_batches` at batch 64 x seq_len 1024,
one process, for: no read-ahead; read-ahead threads; grain worker processes; and
random-offset windows. Each row is the median of 3 timed passes of --batches
batches after a warm-up pass. Goal (docs/benchmarks.md): at least 1M tokens/s on 2
CPU cores; one H100 trains GPT-2 small at about 0.47M tokens/s (llm.c, 8 x H100).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ml_collections
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtrain.data import make_source  # noqa: E402
from meshtrain.data.token_dataset import write_token_dataset  # noqa: E402

# What one H100 consumes training GPT-2 small (124M) at seq 1024: llm.c on 8 x H100
# takes 140 ms per 524,288-token step, 468K tokens/s per GPU
# (KellerJordan/modded-nanogpt, records/track_1_short/2024-10-13_llmc/README.md).
H100_GPT2_SMALL_TOKENS_PER_S = 468e3


class _Ids:
    """A stand-in tokenizer for random ids: GPT-2's vocabulary size and end of text."""
    name, vocab_size, eot_id = "ids", 50257, 50256

    def describe(self):
        return "random ids (50257)"

    def save(self, path):
        Path(path).write_text('{"kind": "byte"}')  # never used to decode here


def make_dataset(data_dir: Path, n_tokens: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)

    def docs(n):
        made = 0
        while made < n:
            length = int(rng.integers(100, 4000))
            made += length + 1
            yield np.append(rng.integers(0, 50256, length, dtype=np.int32), 50256)
    write_token_dataset("bench_tokens", data_dir, _Ids(),
                        {"train": lambda: docs(n_tokens), "validation": lambda: docs(100_000)})


def time_pipeline(data_dir: Path, batches: int, *, workers=0, prefetch=0,
                  random_offsets=False, batch=64, seq_len=1024) -> float:
    cfg = ml_collections.ConfigDict(dict(
        kind="tfds", name="bench_tokens", data_dir=str(data_dir), split="train",
        eval_split="validation", feature="", cache_dir="", tokenizer="byte",
        random_offsets=random_offsets))
    source = make_source(cfg, vocab_size=-1, seq_len=seq_len, seed=0)
    it = source.train_batches(batch, workers=workers, prefetch=prefetch)
    for _ in range(batches):  # warm-up: start workers, fill the page cache
        next(it)
    rates = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(batches):
            b = next(it)
        rates.append(batches * b.size / (time.perf_counter() - t))
    return statistics.median(rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=20_000_000)
    p.add_argument("--batches", type=int, default=200)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        make_dataset(Path(tmp), args.tokens)
        print(f"wrote {args.tokens:,} tokens in {time.perf_counter() - t:.1f} s")
        rows = [("strided windows, no read-ahead", dict()),
                ("strided windows, 2 read-ahead threads", dict(prefetch=2)),
                ("strided windows, 2 grain worker processes", dict(workers=2, prefetch=2)),
                ("random-offset windows, 2 read-ahead threads", dict(random_offsets=True, prefetch=2))]
        print("\n| pipeline (batch 64 x 1025 tokens, 1 process) | tokens/s | x one H100 on GPT-2 small |")
        print("|---|---|---|")
        for label, kw in rows:
            rate = time_pipeline(Path(tmp), args.batches, **kw)
            print(f"| {label} | {rate / 1e6:.2f}M | {rate / H100_GPT2_SMALL_TOKENS_PER_S:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
