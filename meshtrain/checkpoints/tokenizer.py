"""The tokenizer a checkpoint's params were trained with, for exports (`convert to_hf`)
and sampling (`sample --checkpoint`).

A training run saves its tokenizer whole as WORKDIR/tokenizer.json (train.py's
save_tokenizer), so a training checkpoint's is read from beside WORKDIR/checkpoints;
the char tokenizer's vocabulary (the corpus's characters) exists nowhere else. A
converted checkpoint names its files in meta "tokenizer" (hf:CKPT/tokenizer). Any other
spec is rebuilt, which reads no data. Whether prompts get the special tokens the
tokenizer's post-processor adds (Llama's BOS) is the checkpoint's too, apart from the
tokenizer: InitSource.prompt_special_tokens (init_from.py), which sampling applies.
"""

from __future__ import annotations

from meshtrain.errors import UserError


def of(src) -> tuple[object | None, str]:
    """(the tokenizer of `src`, an init_from.InitSource, "") or (None, why there is none:
    one sentence without a final stop)."""
    from meshtrain.data.tokenizers import load_tokenizer, make_tokenizer
    converted = "family" in src.meta
    saved = None if converted else src.step_dir.parent.parent / "tokenizer.json"
    if saved is not None and saved.is_file():
        return load_tokenizer(saved), ""
    if src.tokenizer is None:
        return None, ("the Hugging Face directory it was converted from had no tokenizer files" if converted
                      else "the run trained on synthetic data, token ids that stand for no text")
    try:
        return make_tokenizer(src.tokenizer), ""
    except ValueError:  # 'char' needs its corpus
        return None, (f"it was trained with the {src.tokenizer!r} tokenizer, whose vocabulary (the "
                      f"corpus's characters) the run saved as WORKDIR/tokenizer.json, and {saved} "
                      f"does not exist")
    except UserError as e:
        return None, f"its tokenizer {src.tokenizer!r} cannot be read: {e}"
