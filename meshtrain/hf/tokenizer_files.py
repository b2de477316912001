"""A model directory's tokenizer files in and out of meshtrain's conversions.

`copy_files` puts a Hugging Face model directory's tokenizer into a converted checkpoint
(`convert from_hf`) and returns the `data.tokenizer` spec that names it there;
`write_hf_files` and `token_ids` put a run's tokenizer into an exported model directory
(`convert to_hf`). Reading a tokenizer is meshtrain.data's (data/hf_tokenizer.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from meshtrain.data.hf_tokenizer import HF_FILES, is_tiktoken_file, load, read_json
from meshtrain.data.tokenizers import make_tokenizer
from meshtrain.errors import UserError


def copy_files(model_dir: Path, out: Path) -> tuple[str | None, str]:
    """Copies a model directory's tokenizer into `out`; (spec relative to out's parent,
    what was copied). tokenizer.json wins; then GPT-2's vocab.bpe + encoder.json (or their
    Hugging Face names merges.txt + vocab.json); then a tiktoken tokenizer.model."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        copied = [f for f in (*HF_FILES, "vocab.json", "merges.txt") if (model_dir / f).is_file()]
        for f in copied:
            shutil.copyfile(model_dir / f, out / f)
        tok = load(model_dir)  # fails now, not at training time, if it cannot be read
        config = read_json(out / "tokenizer_config.json")
        if config.get("eos_token") is None:  # record what load() found, for the copy
            config["eos_token"] = tok.eot
            (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return f"hf:{out.name}", f"{', '.join(copied)} ({tok.describe()})"
    for bpe, encoder in (("vocab.bpe", "encoder.json"), ("merges.txt", "vocab.json")):
        if (model_dir / bpe).is_file() and (model_dir / encoder).is_file():
            out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(model_dir / bpe, out / "vocab.bpe")
            shutil.copyfile(model_dir / encoder, out / "encoder.json")
            return f"gpt2:{out.name}", f"{bpe} + {encoder} as GPT-2's vocab.bpe + encoder.json"
    for model in (model_dir / "tokenizer.model", model_dir / "original" / "tokenizer.model"):
        if model.is_file() and is_tiktoken_file(model):
            out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(model, out / "tokenizer.model")
            return f"hf:{out.name}", f"{model.relative_to(model_dir)} (tiktoken, Llama 3 special tokens)"
    return None, "none (no tokenizer.json, GPT-2 vocab files or tiktoken tokenizer.model)"


def write_hf_files(spec: str | None, out: Path) -> list[str]:
    """Puts the tokenizer a spec names into an exported model directory, in Hugging
    Face's names; returns the files written ([] when there is nothing to copy)."""
    if not spec or ":" not in spec:
        return []
    kind, _, arg = spec.partition(":")
    src = Path(arg)
    if kind == "bpe":
        shutil.copyfile(src, out / "tokenizer.json")
        return ["tokenizer.json"]
    pairs = {"gpt2": [("vocab.bpe", "merges.txt"), ("encoder.json", "vocab.json")],
             "hf": [(f, f) for f in (*HF_FILES, "vocab.json", "merges.txt", "tokenizer.model")]}.get(kind, [])
    written = []
    for a, b in pairs:
        if (src / a).is_file():
            shutil.copyfile(src / a, out / b)
            written.append(b)
    return written


def token_ids(spec: str | None) -> dict:
    """{"eos_token_id": end of text} for a config.json that lacks one, from the tokenizer
    a spec names ({} if it names none or cannot be read)."""
    if not spec:
        return {}
    try:
        return {"eos_token_id": int(make_tokenizer(spec).eot_id)}
    except (UserError, ValueError):  # ValueError: 'char' needs its corpus
        return {}
