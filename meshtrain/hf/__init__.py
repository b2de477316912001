"""Hugging Face interop: converting `transformers` checkpoints to meshtrain's and back.

One module per family, each with the same parts: FAMILY, MODEL_TYPE, ARCHITECTURE,
SUPPORTED (one sentence for error messages), `architecture(config.json, where)`,
`table(arch, prefix)` (the tensors, see hf/tensors.py), `prefix(names)`,
`ignored_for(arch)` and `hf_config(arch, base, dtype, special)`; a family whose files
come in more than one layout adds `import_table(arch, names)` (hf/mixtral.py). `python -m
meshtrain.convert` drives them; docs/huggingface.md describes the formats.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from meshtrain.errors import UserError
from meshtrain.hf import gpt2, llama, mixtral

CONVERTERS: dict[str, ModuleType] = {m.MODEL_TYPE: m for m in (gpt2, llama, mixtral)}


def supported() -> str:
    return ", ".join(f"{m.ARCHITECTURE} (model_type {t!r})" for t, m in CONVERTERS.items())


def read_config(model_dir) -> dict:
    """config.json of a Hugging Face model directory; a UserError if there is none."""
    d = Path(model_dir)
    path = d / "config.json"
    if not d.is_dir():
        raise UserError(f"--model={str(d)!r} is not a directory. Give a Hugging Face model "
                        f"directory (config.json and *.safetensors), e.g. one written by "
                        f"save_pretrained or downloaded from the Hub. Supported: {supported()}.")
    if not path.is_file():
        raise UserError(f"{d} has no config.json, so it is not a Hugging Face model directory "
                        f"(or not a complete download). Supported: {supported()}.")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON ({e}). Re-download it.") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a JSON object. Re-download it.")
    return config


def converter_for(config: dict, where: str) -> ModuleType:
    """The converter of a config.json's model_type, checking its `architectures`."""
    model_type = config.get("model_type")
    conv = CONVERTERS.get(model_type)
    if conv is None:
        raise UserError(f"{where}: model_type {model_type!r} "
                        f"({', '.join(config.get('architectures') or []) or 'no architectures'}) "
                        f"is not supported. Supported: {supported()}.")
    archs = config.get("architectures") or [conv.ARCHITECTURE]
    if conv.ARCHITECTURE not in archs:
        raise UserError(f"{where}: architectures {archs} is not {conv.ARCHITECTURE}; only the "
                        f"causal-LM head is converted (a base model or another head has other "
                        f"or missing weights). Supported: {supported()}.")
    return conv


def import_table(conv: ModuleType, arch: dict, names) -> list:
    """The tensors to read from a file holding `names`: the converter's choice among the
    layouts it reads, else its table under the file's prefix."""
    own = getattr(conv, "import_table", None)
    return own(arch, names) if own else conv.table(arch, conv.prefix(names))


def converter_of_family(family: str) -> ModuleType:
    for conv in CONVERTERS.values():
        if conv.FAMILY == family:
            return conv
    raise UserError(f"Model family {family!r} has no Hugging Face export. Supported: {supported()}.")
