"""Turn a local corpus into a TFDS ArrayRecord dataset of token ids (train and validation
splits, the tokenizer saved beside them), or a folder of images into one of images
and labels; offline: no TensorFlow, no network.

    meshtrain prepare --input='corpus/*.txt' --name=mytext \\
        --data_dir=~/tensorflow_datasets --tokenizer=char [--val_fraction=0.05]
    meshtrain prepare ... --tokenizer=bpe --train_bpe=2048
    meshtrain prepare --input='fineweb/*.parquet' --name=fw --data_dir=D --tokenizer=gpt2
    meshtrain prepare --input='c4/*.jsonl.zst' --val_input='c4val/*.jsonl.zst' ...
    meshtrain prepare --input='llmc/*train*.bin' --val_input='llmc/*val*.bin' --tokenizer=gpt2 ...
    meshtrain prepare --images=DIR --name=mypics --data_dir=~/tensorflow_datasets
    python -m meshtrain.data.prepare ...   (the same)

Then train on text with --config.data.kind=tfds --config.data.name=mytext
--config.data.data_dir=DIR, on images with --config.data.kind=images and the same
name and data_dir. The formats are described in meshtrain/data/token_dataset.py,
meshtrain/data/image_dataset.py and docs/data.md.
"""

import sys
import time
from pathlib import Path

from meshtrain import cli
from meshtrain.data.corpus import Corpus
from meshtrain.data.tokenizers import check_tokenizer_spec, make_tokenizer
from meshtrain.errors import UserError
from meshtrain.progress import Progress, format_duration


def parser() -> cli.Parser:
    p = cli.command_parser("meshtrain prepare", __doc__)
    p.add_argument("--input", default="",
                   help="a file, a glob ('data/*.jsonl.zst') or a save_to_disk directory: text, "
                        "jsonl (.gz/.zst), parquet, a Hugging Face dataset or .bin token files (nanoGPT, "
                        "llm.c, Megatron-LM's .bin beside its .idx)")
    p.add_argument("--format", default="auto",
                   help="auto (by the file names) | text | jsonl | parquet | hf | tokens")
    p.add_argument("--text_field", default="text", help="the JSON field or column holding each document")
    p.add_argument("--val_input", default="",
                   help="the held-out split's files, in --input's format; without it the split is cut from --input")
    p.add_argument("--images", default="",
                   help="instead of --input: a folder with one subfolder of image files per "
                        "class (the ImageFolder layout)")
    p.add_argument("--name", required=True, help="dataset name (lower snake case)")
    p.add_argument("--data_dir", required=True, help="TFDS data directory to write into")
    p.add_argument("--tokenizer", default="byte",
                   help="byte | char | bpe:PATH | bpe (with --train_bpe) | gpt2 | gpt2:DIR | hf:DIR")
    p.add_argument("--train_bpe", type=int, default=0, metavar="VOCAB_SIZE",
                   help="train a byte-level BPE of this vocabulary on the training split")
    p.add_argument("--val_fraction", type=float, default=0.05,
                   help="share of the corpus (its tail) held out as the validation split; "
                        "with --images, the share of every class (its last files)")
    p.add_argument("--doc_separator", default="",
                   help="split files into documents at this string (default: a file is a "
                        "document); backslash escapes such as \\n are understood")
    p.add_argument("--record_tokens", type=int, default=4096, help="tokens per record")
    p.add_argument("--workers", type=int, default=1,
                   help="processes tokenizing at once, a file (or a text file's part) each; a "
                        "killed prepare rerun keeps what they finished")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset")
    return p


def execute(args) -> int:
    from meshtrain.data import tokenize_pool
    if args.workers < 1:
        raise UserError(f"--workers={args.workers}: must be >= 1 (processes that tokenize at once).")
    # the workers start while this process imports TFDS and reads the input's layout
    with tokenize_pool.pool(args.workers if args.input else 1) as executor:
        return _execute(args, executor)


def _execute(args, executor) -> int:
    from meshtrain.data import token_dataset  # imports TFDS: after argument errors

    token_dataset.check_name(args.name)
    if bool(args.input) == bool(args.images):
        raise UserError(
            "prepare reads either text (--input='corpus/*.txt') or an image folder "
            "(--images=DIR); pass exactly one of them.")
    if args.images:
        return _prepare_images(args)
    spec = _tokenizer_spec(args)
    if args.record_tokens < 1:
        raise UserError(f"--record_tokens={args.record_tokens}: must be >= 1 (4096 is a good size).")
    out = token_dataset.dataset_dir(args.data_dir, args.name)
    if out.exists() and not args.overwrite:
        raise UserError(
            f"A dataset already exists at {str(out)!r}. Pass --overwrite to replace it, or "
            f"choose another --name.")
    corpus = _open(args, spec)
    started = time.perf_counter()
    print(f"prepare: {len(corpus.files)} file(s) of {corpus.fmt}, {corpus.total:,} bytes; "
          f"{corpus.describe_split()}", file=sys.stderr)
    source = {"source": {"input": args.input, "val_input": args.val_input, **corpus.info()}}
    if corpus.fmt == "tokens":
        tok = _build_tokenizer(spec, args, corpus)
        print(f"prepare: tokenizer {tok.describe()} (the ids as they are)", file=sys.stderr)
        corpus.check(tok, spec)
        if corpus.headerless:
            print("prepare: note: nanoGPT's raw uint16 files carry no header, so a copy cut short cannot be told "
                  "from a whole one; llm.c's header (write_datafile) records the count (docs/data.md, 'Damaged "
                  "inputs')", file=sys.stderr)
        _remove(out)
        bar = Progress("copy", corpus.total)
        meta = token_dataset.write_token_dataset(
            args.name, args.data_dir, tok, {split: (lambda split=split: corpus.tokens(tok, split, bar.update))
                                            for split in token_dataset.SPLITS},
            record_tokens=args.record_tokens, extra_metadata=source, separator=corpus.separator)
        bar.close()
    else:
        from meshtrain.data import token_shards
        tok, work, units = _work(args, spec, corpus)
        fraction = getattr(corpus, "val_fraction", 0.0)
        meta = token_shards.write(
            args.name, args.data_dir, tok, corpus, units, work, executor, workers=args.workers,
            fraction=fraction, record_tokens=args.record_tokens, extra_metadata=source, replace=True,
            tokenize_bar=Progress("tokenize", sum(u.nbytes for u in units)),
            check=lambda splits: _check_splits(corpus, units, splits, fraction))
        work.remove()
    n = meta["num_tokens"]
    print(f"prepare: wrote {str(out)!r} in {format_duration(time.perf_counter() - started)}: "
          f"train {n['train']:,} tokens ({meta['num_documents']['train']:,} document(s)), "
          f"validation {n['validation']:,} tokens; vocab {tok.vocab_size}.\n"
          f"train with: python -m meshtrain.train --config=gpt2_tiny_dp8 "
          f"--config.data.kind=tfds --config.data.name={args.name} "
          f"--config.data.data_dir={args.data_dir}")
    return 0


def _prepare_images(args) -> int:
    from meshtrain.data import image_dataset
    from meshtrain.data.tfds_writer import dataset_dir

    if args.tokenizer != "byte" or args.train_bpe:
        raise UserError("--tokenizer and --train_bpe are for text; an image dataset has "
                        "labels, not tokens. Leave them out with --images.")
    out = dataset_dir(args.data_dir, args.name)
    if out.exists() and not args.overwrite:
        raise UserError(
            f"A dataset already exists at {str(out)!r}. Pass --overwrite to replace it, or "
            f"choose another --name.")
    started = time.perf_counter()
    classes, files = image_dataset.scan_folder(args.images)
    splits = image_dataset.split_files(files, args.val_fraction)
    print(f"prepare: {len(files):,} image(s) in {len(classes)} classes; validation = the last "
          f"{args.val_fraction:g} of every class's files", file=sys.stderr)
    if out.exists():
        import shutil
        shutil.rmtree(out)
    bar = Progress("images", len(files), unit=" files")
    meta = image_dataset.write_image_dataset(
        args.name, args.data_dir, classes, splits, progress=bar.update,
        extra_metadata={"source": {"images": args.images}})
    bar.close()
    n = meta["num_examples"]
    print(f"prepare: wrote {str(out)!r} in {format_duration(time.perf_counter() - started)}: "
          f"train {n['train']:,} images, validation {n['validation']:,}; {len(classes)} "
          f"classes, {meta['channels']} channel(s).\n"
          f"train with: python -m meshtrain.train --config=CONFIG --config.data.kind=images "
          f"--config.data.name={args.name} --config.data.data_dir={args.data_dir} "
          f"(CONFIG: an image model's config)")
    return 0


def _tokenizer_spec(args) -> str:
    if args.train_bpe:
        if args.tokenizer not in ("bpe", "byte"):
            raise UserError(
                f"--train_bpe trains a new BPE tokenizer, but --tokenizer={args.tokenizer!r} "
                f"names another. Pass --tokenizer=bpe (or leave it out) with --train_bpe.")
        return "bpe"
    if args.tokenizer == "bpe":
        raise UserError(
            "--tokenizer=bpe needs either a tokenizer file (--tokenizer=bpe:PATH, a Hugging "
            "Face tokenizer.json) or a vocabulary size to train one (--train_bpe=2048).")
    return check_tokenizer_spec(args.tokenizer)


def _remove(out: Path) -> None:
    """The dataset --overwrite replaces, removed once the new one's tokens are ready."""
    if out.exists():
        import shutil
        shutil.rmtree(out)


def _work(args, spec: str, corpus):
    """The work directory (a rerun with the same inputs and options resumes it), its
    tokenizer and the corpus's units; -> (tokenizer, work, units)."""
    from meshtrain.data import formats, tokenize_pool
    from meshtrain.data.tokenizers import load_tokenizer
    files = list(corpus.files) + list(getattr(corpus, "val_files", []))
    plan = {"inputs": [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files],
            **{k: getattr(args, k) for k in ("format", "text_field", "val_fraction", "val_input", "doc_separator",
                                            "tokenizer", "train_bpe", "record_tokens")},
            "unit_bytes": formats.UNIT_BYTES}  # how the units are cut: another cut, other units
    work = tokenize_pool.Work(Path(args.data_dir).expanduser() / f".{args.name}.prepare", plan)
    saved = work.root / "tokenizer.json"
    if saved.exists():
        tok = load_tokenizer(saved)
    else:
        tok = _build_tokenizer(spec, args, corpus)
        tok.save(saved)
    print(f"prepare: tokenizer {tok.describe()}", file=sys.stderr)
    units = corpus.units()
    resumed = sum(work.done(k) for k in range(len(units)))
    print(f"prepare: {len(units)} unit(s) to tokenize with {args.workers} worker(s), the records written as "
          f"they are done" + (f"; {resumed} done by an earlier run, kept" if resumed else ""), file=sys.stderr)
    return tok, work, units


def _check_splits(corpus, units, splits, fraction: float) -> None:
    """An empty split named by the input it comes from (`splits`: token_shards.Splits, every
    unit done); token_shards.write refuses any other empty split (plain text's held-out tail
    of nothing but separators)."""
    val_files = getattr(corpus, "val_files", [])
    what = f"--input {corpus.path!r} ({len(corpus.files)} file(s) of {corpus.fmt})"
    train, held = splits.documents["train"], splits.documents["validation"]
    if train + (0 if val_files else held) == 0:
        raise UserError(f"{what} holds no document with text (empty lines, empty files and empty "
                        f"{'--text_field values' if corpus.fmt != 'text' else 'pieces'} are skipped): point --input "
                        f"at the corpus's files{', or pass --text_field=NAME' if corpus.fmt != 'text' else ''}.")
    if val_files and held == 0:
        raise UserError(f"--val_input {corpus.val_path!r} ({len(val_files)} file(s)) holds no document with text, so "
                        f"the held-out split would be empty: point --val_input at the held-out files, or leave it "
                        f"out to hold out --val_fraction of --input's documents.")
    if any(u.split is None for u in units) and held in (0, train + held):
        raise UserError(f"--val_fraction={fraction:g} of the {train + held:,} document(s) of {what} leaves "
                        f"{'no held-out' if held == 0 else 'no training'} document: use more documents, another "
                        f"--val_fraction, or --val_input with the held-out files.")


def _open(args, spec: str):
    """The corpus --input names, by its format (meshtrain/data/formats.py)."""
    from meshtrain.data import formats, inputs
    if args.format in ("auto", "tokens") and str(args.input).lower().endswith(".bin"):
        fmt = "tokens"  # named so before its files are listed: a Megatron .idx left alone is told apart
    else:
        fmt = formats.format_of(inputs.input_paths(args.input, "--input")[0], args.format)
    if fmt == "tokens":
        if spec in ("char", "bpe"):
            raise UserError(f"--input {args.input!r} holds token ids already: pass the --tokenizer they were "
                            f"made with (nanoGPT's, llm.c's and Megatron's GPT-2 files: --tokenizer=gpt2), "
                            f"not one built from the corpus ({spec}).")
        return inputs.TokenFiles(args.input, val_fraction=args.val_fraction, val_path=args.val_input)
    if fmt != "text":
        return inputs.Records(args.input, fmt, args.text_field, val_fraction=args.val_fraction,
                              val_path=args.val_input)
    if args.val_input:
        raise UserError("--val_input is for jsonl, parquet, hf and token inputs; plain text holds out the "
                        "tail of --input (--val_fraction).")
    separator = args.doc_separator.encode().decode("unicode_escape") or None
    return Corpus(args.input, val_fraction=args.val_fraction, separator=separator, key="--input",
                  strict_utf8=spec != "byte")


def _build_tokenizer(spec: str, args, corpus):
    if spec == "bpe":
        from meshtrain.data.subword import train_bpe
        t = time.perf_counter()
        tok = train_bpe(corpus.documents("train"), args.train_bpe)
        print(f"prepare: trained a byte-level BPE of {tok.vocab_size} ids on the training "
              f"split in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        return tok
    return make_tokenizer(spec, corpus.text() if spec == "char" else None)


run, main = cli.entry_points(parser, execute)


if __name__ == "__main__":
    sys.exit(main())
