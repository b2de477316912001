"""Tokens per second the data pipeline delivers, against what training consumes; and what
`meshtrain prepare` makes of a corpus, per input format and worker count.

    python benchmarks/data.py [--tokens=20000000] [--batches=200]
    python benchmarks/data.py --prepare-mb=2048 [--formats=jsonl,jsonl.zst,parquet,text]
                              [--workers=1,2] [--kill-check] [--tokenizer=byte|bpe]

Writes a pre-tokenized meshtrain token dataset (random ids, documents of random
length joined with end of text, GPT-2-sized uint16 records) into a temporary
TFDS data_dir, then times `DataSource.train_batches` at batch 64 x seq_len 1024,
one process, for: no read-ahead; read-ahead threads; grain worker processes; and
random-offset windows. Each row is the median of 3 timed passes of --batches
batches after a warm-up pass. Goal (docs/benchmarks.md): at least 1M tokens/s on 2
CPU cores; one H100 trains GPT-2 small at about 0.47M tokens/s (llm.c, 8 x H100).

With --prepare-mb: a corpus of that many MB of random-word documents in 16 files of
each format (a saved Hugging Face dataset with `hf`, when `datasets` is installed),
prepared by `python -m meshtrain prepare --tokenizer=byte` with each --workers count:
seconds, input MB/s and tokens/s per worker, and the largest process's peak RSS
(getrusage of the waited children). --kill-check then kills a prepare of the first
format (SIGKILL) once half its units are done, reruns it, and compares every file of the
dataset with the unbroken run's. Goals (issue 40): peak RSS under 1 GB on 2 GB, 1.7x
with 2 workers, byte-identical after a kill.
"""

import argparse
import os
import re
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


def make_corpus(root: Path, fmt: str, mb: int, files: int = 16) -> str:
    """`mb` MB of random-word documents in `files` files of `fmt`; -> prepare's --input."""
    import json
    rng = np.random.default_rng(0)
    words = np.array("the of and to in a is that for it as was with be by on not he this are or his from "
                     "at which but have an they you were her she there one all we their".split())
    root.mkdir(parents=True)
    per_file = mb * 2**20 // files
    for i in range(files):
        docs, size = [], 0
        while size < per_file:
            docs.append(" ".join(words[rng.integers(0, len(words), int(rng.integers(50, 800)))]))
            size += len(docs[-1]) + 12
        stem = root / f"part-{i:03d}"
        if fmt == "text":
            stem.with_suffix(".txt").write_text("\n\n".join(docs))
        elif fmt.startswith("jsonl"):
            data = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
            if fmt == "jsonl.zst":
                import zstandard
                data = zstandard.ZstdCompressor().compress(data)
            Path(f"{stem}.{fmt}").write_bytes(data)
        elif fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq
            pq.write_table(pa.table({"text": docs}), f"{stem}.parquet", row_group_size=4096)
        else:
            import datasets
            datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(stem))
    return str(root / ("part-*" + ("" if fmt == "hf" else f".{'txt' if fmt == 'text' else fmt}")))


TOKENIZER = ["--tokenizer=byte"]  # set by --tokenizer (bpe: trained on a sample, then bpe:PATH)


# Starts the command and prints the largest RSS among its processes (kB). A small process of
# its own: a child forked from this one, which holds the corpus it generated, would count
# this process's pages in its peak.
_PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, "
         "stderr=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def run_prepare(source: str, data_dir: Path, workers: int, separator: bool) -> tuple[float, int, float]:
    """(seconds, tokens, peak RSS of the largest process in GB) of one prepare."""
    import json
    import shutil
    import subprocess
    # every run from the same state, untimed: no earlier dataset to replace, and the writes
    # before it (the corpus, the last run's dataset) on disk, not in the page cache
    shutil.rmtree(data_dir, ignore_errors=True)
    os.sync()
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "meshtrain", "prepare", f"--input={source}", "--name=bench", f"--data_dir={data_dir}",
           *TOKENIZER, f"--workers={workers}"] + (["--doc_separator=\\n\\n"] if separator else [])
    out = subprocess.run([sys.executable, "-c", _PEAK, *cmd], check=True, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    seconds = time.perf_counter() - t
    peak = int(out.stdout.split()[-1]) / 2**20  # kB -> GB
    meta = json.loads((data_dir / "bench" / "1.0.0" / "metadata.json").read_text())
    return seconds, sum(meta["num_tokens"].values()), peak


def kill_check(source: str, tmp: Path, separator: bool) -> str:
    """Kill a prepare once half its units are done, rerun it, compare with an unbroken run."""
    import signal
    import subprocess
    whole, cut = tmp / "whole", tmp / "cut"
    run_prepare(source, whole, 1, separator)
    cmd = [sys.executable, "-m", "meshtrain", "prepare", f"--input={source}", "--name=bench", f"--data_dir={cut}",
           *TOKENIZER, "--workers=1"] + (["--doc_separator=\\n\\n"] if separator else [])
    log = tmp / "cut.log"
    with open(log, "w") as err:  # prepare says how many units it cut the input into
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        units = None
        while proc.poll() is None:
            units = units or re.search(r"(\d+) unit\(s\) to tokenize", log.read_text())
            if units and len(list((cut / ".bench.prepare").glob("unit-*.done"))) >= int(units[1]) // 2:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = len(list((cut / ".bench.prepare").glob("unit-*.done")))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    files = sorted(p.name for p in (whole / "bench" / "1.0.0").iterdir())
    same = all((whole / "bench" / "1.0.0" / f).read_bytes() == (cut / "bench" / "1.0.0" / f).read_bytes() for f in files)
    total = units[1] if units else "?"
    return f"killed (SIGKILL) with {done} of {total} units done, rerun: {len(files)} files, byte-identical: {same}"


def bpe(path: Path, vocab: int = 300) -> str:
    """A byte-level BPE trained on a sample of the benchmark's words (which support about
    300 ids: their merges run out), saved: --tokenizer=bpe:PATH. It runs the same Rust
    encoder a GPT-2-sized one does, a pass of merges a word."""
    from meshtrain.data.subword import train_bpe
    rng = np.random.default_rng(1)
    words = "the of and to in a is that for it as was with be by on not he this are or his".split()
    train_bpe((" ".join(rng.choice(words, 500)) for _ in range(200)), vocab).save(path)
    return f"--tokenizer=bpe:{path}"


def _arithmetic(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def host_ceiling(n: int = 30_000_000) -> float:
    """What 2 processes of pure Python arithmetic gain over 1 on this host (the most
    `--workers=2` could gain): 2 x one's time / the pair's time, on a warm pool."""
    import concurrent.futures
    t = time.perf_counter()
    _arithmetic(n)
    one = time.perf_counter() - t
    with concurrent.futures.ProcessPoolExecutor(2) as ex:
        list(ex.map(_arithmetic, [1, 1]))
        t = time.perf_counter()
        list(ex.map(_arithmetic, [n, n]))
        return 2 * one / (time.perf_counter() - t)


def prepare_rows(args) -> None:
    if args.tokenizer == "bpe":
        TOKENIZER[0] = bpe(Path(tempfile.mkdtemp()) / "bpe.json")
    print(f"\ntokenizer: {TOKENIZER[0]}")
    print(f"\n| input ({args.prepare_mb} MB, 16 files) | workers | seconds | MB/s | M tokens/s per worker "
          f"| peak RSS, GB |\n|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats.split(","):
            source = make_corpus(Path(tmp) / fmt, fmt, args.prepare_mb)
            for workers in map(int, args.workers.split(",")):
                seconds, tokens, peak = run_prepare(source, Path(tmp) / "out", workers, fmt == "text")
                print(f"| {fmt} | {workers} | {seconds:.1f} | {args.prepare_mb / seconds:.1f} | "
                      f"{tokens / seconds / workers / 1e6:.2f} | {peak:.2f} |", flush=True)
            if args.kill_check:
                print(kill_check(source, Path(tmp) / f"{fmt}-kill", fmt == "text"), flush=True)
                args.kill_check = False
    print(f"\nthis host's ceiling for 2 processes: {host_ceiling():.2f}x one (pure Python arithmetic)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=20_000_000)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--prepare-mb", type=int, default=0, help="time prepare on a corpus of this many MB instead")
    p.add_argument("--formats", default="jsonl,jsonl.zst,parquet,text")
    p.add_argument("--workers", default="1,2")
    p.add_argument("--kill-check", action="store_true")
    p.add_argument("--tokenizer", default="byte", choices=("byte", "bpe"),
                   help="bpe: a byte-level BPE trained here, run by the same encoder a real one is")
    args = p.parse_args()
    if args.prepare_mb:
        return prepare_rows(args)
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
