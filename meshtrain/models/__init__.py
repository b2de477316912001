"""Models written with logical axis names, reached through one seam (models/family.py).

`model_config(cfg.model, ...)` turns config keys into the family's config dataclass;
`family.get(name)` gives the rest (module, activations, parameter count, FLOPs).
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from meshtrain.errors import UserError
from meshtrain.models import attention, family, gpt2, llama, mixtral, remat, resnet, vgg  # noqa: F401  (models register themselves)
from meshtrain.models.family import Family, ModelConfig

DTYPES = ("float32", "bfloat16", "float16")
# model.* keys every family reads; the others are dimensions some family's sizes name.
COMMON_KEYS = ("name", "size", "vocab_multiple", "dropout", "dtype", "param_dtype", "remat", "scan_layers",
               "attention", "context_attention")


def size_dims(m: ml_collections.ConfigDict) -> dict:
    """The dimensions named by model.size, with explicit model.* keys taking precedence."""
    fam = family.get(m.name)
    if m.size not in fam.sizes:
        raise UserError(f"model.size={m.size!r} is not a {fam.name} size; choose one of "
                        f"{', '.join(fam.sizes)} (or set the dimensions explicitly).")
    dims = dict(fam.sizes[m.size])
    unread = [k for k in m.keys() if k not in COMMON_KEYS and k not in dims and m[k] is not None]
    if unread:
        raise UserError(
            f"{', '.join(f'model.{k}={m[k]!r}' for k in unread)}: model {fam.name!r} has no such "
            f"dimension (it reads {', '.join(f'model.{k}' for k in dims if k in m)}). Unset it.")
    for k in dims:
        if k in m and m[k] is not None:
            dims[k] = m[k]
    return dims


def model_config(m: ml_collections.ConfigDict, *, vocab_size: int, vocab_shards: int = 1,
                 dims: dict | None = None, platform: attention.Platform | None = None,
                 sections: ml_collections.ConfigDict | None = None) -> ModelConfig:
    """Config keys -> the family's config. `model.size` fills dims; explicit keys win;
    `dims` (a checkpoint's architecture, see init.from) replaces both.

    `vocab_size` is the data's vocabulary; the table is padded to a multiple of
    lcm(model.vocab_multiple, vocab_shards) so any layout can split it evenly.
    `model.attention` is resolved for `platform` (default: the running backend); the
    reason for the choice is `attention_choice(m.attention, cfg)`. `sections` (the whole
    config) gives the sections the family's config names in RUN_FIELDS: how it runs, not
    its weights (a mixture of experts' `moe.*` keys).
    """
    fam = family.get(m.name)
    dims = dict(size_dims(m) if dims is None else dims)
    dims["vocab_size"] = vocab_size
    # A dim some size sets to 0 (a count of optional parts: shared experts) may be 0.
    may_be_zero = {f for size in fam.sizes.values() for f, v in size.items() if v == 0}
    for f, v in dims.items():
        if isinstance(v, int) and not isinstance(v, bool) and v < (0 if f in may_be_zero else 1):
            raise UserError(f"model.{f}={v}: must be a {'non-negative' if f in may_be_zero else 'positive'} integer.")
    for key in ("dtype", "param_dtype"):
        if m[key] not in DTYPES:
            raise UserError(f"model.{key}={m[key]!r}: choose one of {', '.join(DTYPES)}.")
    if not 0.0 <= m.dropout < 1.0:
        raise UserError(f"model.dropout={m.dropout}: must be in [0, 1).")
    remat.check(m.remat)
    attention.check_context_kind(m.context_attention)
    multiple = math.lcm(max(1, int(m.vocab_multiple)), vocab_shards)
    padded = -(-vocab_size // multiple) * multiple
    known = {f.name for f in dataclasses.fields(fam.config)}
    cfg = fam.config(**{k: v for k, v in dims.items() if k in known}, padded_vocab_size=padded,
                     dropout=float(m.dropout), dtype=m.dtype, param_dtype=m.param_dtype,
                     remat=m.remat, scan_layers=bool(m.scan_layers),
                     context_attention=m.context_attention)
    run = {f: sections[f].to_dict() for f in cfg.RUN_FIELDS if sections is not None and f in sections}
    cfg = dataclasses.replace(cfg, **run)  # the config's __post_init__ reads each section's dict
    impl, _ = attention_choice(m.attention, cfg, platform)
    cfg = dataclasses.replace(cfg, attention=impl)
    if fam.check is not None:
        fam.check(cfg)
    return cfg


def attention_choice(requested: str, cfg: ModelConfig,
                     platform: attention.Platform | None = None) -> tuple[str, str]:
    """(implementation, why) for `model.attention=requested` with this model (attention.choose)."""
    head_dim = getattr(cfg, "head_dim", None) or 0
    return attention.choose(requested, platform=platform or attention.Platform.current(),
                            dtype=cfg.dtype, head_dim=head_dim)


def family_of(cfg: ModelConfig) -> Family:
    """The registered family whose config class `cfg` is."""
    for name in family.names():
        fam = family.get(name)
        if type(cfg) is fam.config:
            return fam
    raise ValueError(f"{type(cfg).__name__} is not the config of a registered model family")


def architecture(cfg: ModelConfig) -> dict:
    """The fields that fix the parameters' shapes (what init.from and exports carry)."""
    # seq_len only for a family whose sizes have one: a classifier's is an unused 0.
    shaping = {"num_layers", "vocab_size"} | ({"seq_len"} & set(family_of(cfg).fields()))
    run_only = ({f.name for f in dataclasses.fields(ModelConfig)} - shaping) | set(cfg.RUN_FIELDS)
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in run_only}


__all__ = ["Family", "ModelConfig", "architecture", "family", "family_of", "model_config", "size_dims"]
