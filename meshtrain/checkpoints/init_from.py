"""Starting a run from a checkpoint's params (`init.from`): a model converted from
Hugging Face (`python -m meshtrain.convert from_hf`) or another run's checkpoint.

    src = init_from.read(cfg.init["from"])   # family, architecture, tokenizer, where from
    cfg = init_from.resolve(cfg, src)        # a copy: model.* and data.tokenizer follow it
    dims = init_from.model_dims(src, cfg.model)        # replaces models.size_dims
    vocab = init_from.vocab_size(src, data_vocab)      # the checkpoint's rows
    ...                                                # Experiment.build as usual
    state = reading.init_state(src, exp)     # its params at step 0 (checkpoints/reading.py)

Params are read by Orbax straight into the run's shardings (any layout, mesh or
pipeline arrangement, every process reading only its shards), cast to
model.param_dtype, with the vocabulary rows padded to the run's padded size.

A converted checkpoint is a checkpoint directory like a training run's:

    CKPT/step_0/state   {"params": params}: OCDBT arrays in the source's dtype, unpadded
                        vocabulary, block leaves stacked [L, ...]
    CKPT/step_0/meta    JSON {"format", "family", "architecture", "tokenizer",
                        "prompt_special_tokens", "source"}
    CKPT/tokenizer/     the model's tokenizer files; meta "tokenizer" names them relative
                        to CKPT (e.g. "hf:tokenizer")

What a tokenizer does to a prompt travels with the checkpoint too: "prompt_special_tokens"
(a converted model's meta, a training checkpoint's meta["run"]) says that prompts are
encoded with the special tokens its tokenizer.json's post-processor adds (Llama's BOS),
as transformers' `tokenizer(prompt)` does. Conversion sets it; a run started from a
checkpoint (init.from) or resumed from its own inherits it, so sampling a fine-tuned run
encodes a prompt as sampling the model it came from does (`prompt_special_tokens`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time

import jax

from meshtrain import models, tree_paths
from meshtrain.checkpoints import steps as steps_lib
from meshtrain.checkpoints import restage
from meshtrain.errors import UserError

FORMAT = 1
CONVERTED_STEP = 0
TOKENIZER_DIR = "tokenizer"
PROMPT_SPECIAL_TOKENS = "prompt_special_tokens"  # the meta key (see the module docstring)
# The dims a run may set differently from the checkpoint it starts from.
FREE_DIMS = ("seq_len",)


@dataclasses.dataclass(frozen=True)
class InitSource:
    step_dir: pathlib.Path           # .../step_N, holding state/ and meta/
    family: str                      # a registered model family
    architecture: dict               # models.architecture() of the saved model
    tokenizer: str | None            # a data.tokenizer spec, paths absolute; None: unknown
    source: str                      # one line: what the params are
    pipeline: tuple[int, int] | None = None  # (stages, repeats) the params were saved in
    meta: dict = dataclasses.field(default_factory=dict)  # the checkpoint's meta JSON
    # Prompts get the special tokens the tokenizer's post-processor adds (Llama's BOS).
    prompt_special_tokens: bool = False

    def model_config(self, **run) -> models.ModelConfig:
        return config_of(self.family, self.architecture, **run)

    def hf_source(self) -> dict:
        """meta["source"] of the converted model these params came from, following a
        training run's meta["run"]["init_from"] back to it; {} when there is none."""
        if "source" in self.meta:
            return self.meta["source"] or {}
        origin = (self.meta.get("run") or {}).get("init_from")
        try:
            return read(origin).hf_source() if origin else {}
        except UserError:  # moved or deleted since: the export falls back to defaults
            return {}


def config_of(family: str, architecture: dict, **run) -> models.ModelConfig:
    """The family's config with this architecture (vocabulary unpadded unless `run` pads it)."""
    run.setdefault("padded_vocab_size", architecture["vocab_size"])
    return models.family.get(family).config(**architecture, **run)


# --- finding and describing a checkpoint ------------------------------------------

def _step_dir(path: pathlib.Path, step: int | None) -> pathlib.Path:
    """A committed step directory under `path` (a step dir, a checkpoint dir, a workdir)."""
    if steps_lib.STEP_NAME.fullmatch(path.name) and steps_lib.is_committed(path):
        if step is not None and int(path.name.split("_")[1]) != step:
            raise UserError(f"{path} is step {path.name.split('_')[1]}, not --step={step}.")
        return path
    for where in (path, path / "checkpoints"):
        steps = steps_lib.committed_steps(where) if where.is_dir() else []
        if steps:
            if step is None:
                return where / f"{steps_lib.STEP_PREFIX}_{steps[-1]}"
            if step not in steps:
                raise UserError(f"{where} has no committed step {step}; its steps are "
                                f"{', '.join(map(str, steps))}.")
            return where / f"{steps_lib.STEP_PREFIX}_{step}"
    raise UserError(
        f"{path} holds no meshtrain checkpoint: no committed step_N in it or in "
        f"{path / 'checkpoints'}. Give a directory written by `python -m meshtrain.convert "
        f"from_hf`, a training --workdir, its checkpoints/ directory (or checkpoint.dir), or "
        f"one step_N in them.")


def _read_json_item(directory: pathlib.Path) -> dict:
    import orbax.checkpoint as ocp
    return ocp.JsonCheckpointHandler().restore(directory, args=ocp.args.JsonRestore())


def normalize(family: str, architecture: dict, where: str) -> dict:
    """The architecture as `models.architecture` gives it, checked against the family."""
    fam = models.family.get(family)
    fields = {f.name for f in dataclasses.fields(fam.config)}
    unknown = sorted(set(architecture) - fields)
    try:
        if unknown:
            raise TypeError(f"unknown fields {', '.join(unknown)}")
        cfg = config_of(family, architecture)
    except (TypeError, KeyError) as e:
        raise UserError(f"{where} records a {family} architecture that this meshtrain's "
                        f"{family} cannot build ({e}). Convert or save it again with this "
                        f"version.") from None
    return models.architecture(cfg)


def _resolve_tokenizer(spec: str | None, base: pathlib.Path) -> str | None:
    """'hf:tokenizer' -> 'hf:/abs/CKPT/tokenizer' (paths in a spec are relative to CKPT)."""
    if not spec or ":" not in spec:
        return spec or None
    kind, _, arg = spec.partition(":")
    return f"{kind}:{(base / arg) if not pathlib.Path(arg).is_absolute() else arg}"


def _training_model(step_dir: pathlib.Path, meta: dict) -> tuple[str, dict, str | None]:
    """(family, architecture, tokenizer) of a training checkpoint: from meta["run"], or
    from the run.json of its workdir (checkpoints written before meta carried them)."""
    run = meta.get("run") or {}
    if "family" in run and "architecture" in run:
        return run["family"], run["architecture"], run.get("tokenizer")
    run_json = step_dir.parent.parent / "run.json"
    try:
        info = json.loads(run_json.read_text())
        family = info["config"]["model"]["name"]
        fields = {f.name for f in dataclasses.fields(models.family.get(family).config)}
        run_only = {f.name for f in dataclasses.fields(models.ModelConfig)} - {"num_layers", "vocab_size", "seq_len"}
        arch = {k: v for k, v in info["model"].items() if k in fields and k not in run_only}
        data = info["config"]["data"]
        return family, arch, None if data["kind"] == "synthetic" else data["tokenizer"]
    except (OSError, ValueError, KeyError) as e:
        raise UserError(
            f"The checkpoint {step_dir} does not say what model it holds: its meta has no "
            f"run.family/run.architecture, and {run_json} (the run.json of its workdir) "
            f"could not be read ({type(e).__name__}: {e}). Point at the workdir of the run, "
            f"or copy its run.json beside the checkpoints/ directory.") from None


def read(path, step: int | None = None) -> InitSource:
    """The checkpoint at `path`: a converted model, a training workdir, a checkpoint
    directory or a step directory (latest committed step unless `step` is given)."""
    path = pathlib.Path(path).expanduser().absolute()
    if not path.exists():
        raise UserError(f"init.from={str(path)!r} does not exist. Give a directory written by "
                        f"`python -m meshtrain.convert from_hf` or a training --workdir.")
    step_dir = _step_dir(path, step)
    steps_lib.check_readable(step_dir)  # a damaged step: one paragraph, the step to pick instead
    meta = _read_json_item(step_dir / "meta")
    if "family" in meta:  # converted
        family, arch = meta["family"], meta["architecture"]
        tokenizer = _resolve_tokenizer(meta.get("tokenizer"), step_dir.parent)
        src = meta.get("source") or {}
        source = f"{src.get('architecture', family)} converted from {src.get('path', '?')}"
        pipe = None
    else:
        family, arch, tokenizer = _training_model(step_dir, meta)
        source = f"training checkpoint {step_dir}"
        pipe = restage.arrangement((meta.get("run") or {}).get("pipeline"))
    arch = normalize(family, arch, str(step_dir))
    return InitSource(step_dir, family, arch, tokenizer, source, pipe, meta, prompt_special_tokens(meta))


def prompt_special_tokens(meta: dict) -> bool:
    """Whether a checkpoint's prompts get the special tokens its tokenizer's post-processor
    adds (Llama's BOS), from its meta: a converted model's "prompt_special_tokens", a
    training checkpoint's meta["run"]'s. Written before they carried it: a converted model
    did (as transformers encodes), and a training checkpoint does as its init.from did,
    followed back; False when that is gone, or for a run started from scratch, whose
    model never saw those tokens (training data is tokenized without them)."""
    if "family" in meta:  # converted
        return bool(meta.get(PROMPT_SPECIAL_TOKENS, meta.get("tokenizer") is not None))
    run = meta.get("run") or {}
    if PROMPT_SPECIAL_TOKENS in run:
        return bool(run[PROMPT_SPECIAL_TOKENS])
    try:
        return bool(run.get("init_from")) and read(run["init_from"]).prompt_special_tokens
    except UserError:  # moved or deleted since
        return False


def inherited_prompt_special_tokens(init: InitSource | None, resumed: dict | None) -> bool:
    """A training run's "prompt_special_tokens" (meta["run"]): how prompts are encoded is
    the model's, not the run's, so it comes from init.from, else from meta["run"] of the
    checkpoint the run resumes (a rerun may leave init.from out); False from scratch."""
    return init.prompt_special_tokens if init is not None else prompt_special_tokens({"run": resumed or {}})


def run_summary(exp, resumed: dict | None = None) -> dict:
    """What a checkpoint records about the run that saved it (meta["run"]); `resumed`:
    meta["run"] of the checkpoint the run resumes from, if any."""
    m, t = exp.model.cfg, exp.cfg.train
    pipe = exp.model.pipeline
    return {
        "layout": exp.layout.name, "mesh": dict(exp.mesh.shape),
        "pipeline": None if pipe is None else {"stages": pipe.stages, "repeats": pipe.repeats},
        "diloco": exp.cfg.diloco.every,  # its opt_state is the outer optimizer's, its comm the round
        "model": exp.model.family.describe(m),
        "family": exp.model.family.name, "architecture": models.architecture(m),
        "tokenizer": None if exp.cfg.data.kind == "synthetic" else exp.cfg.data.tokenizer,
        PROMPT_SPECIAL_TOKENS: inherited_prompt_special_tokens(exp.init, resumed),
        "init_from": os.path.abspath(exp.cfg.init["from"]) if exp.cfg.init["from"] else None,
        "steps": t.steps, "batch_size": t.batch_size, "seed": t.seed,
        "processes": jax.process_count(),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# --- the run's config follows the checkpoint -----------------------------------------

def resolve(cfg, src: InitSource):
    """A copy of `cfg` with what `src` implies, for the run to use and print: model.name
    and the architecture's model.* dims are the checkpoint's, and data.tokenizer too when
    the data is tokenized text and the tokenizer is the default ('byte'). A model.* dim set
    to another value, or another explicit tokenizer, is a UserError (model_dims says which)."""
    import copy
    dims = model_dims(src, cfg.model)
    cfg = copy.deepcopy(cfg)
    cfg.model.name = src.family
    for key in cfg.model.keys():
        if key not in models.COMMON_KEYS and key in dims:
            cfg.model[key] = dims[key]
    if src.tokenizer is None or cfg.data.kind == "synthetic":
        return cfg
    if cfg.data.tokenizer not in ("byte", src.tokenizer):
        raise UserError(
            f"data.tokenizer={cfg.data.tokenizer!r}, but init.from={str(src.step_dir)!r} was "
            f"trained with {src.tokenizer!r}: its embedding rows are that tokenizer's tokens. "
            f"Leave data.tokenizer unset (it follows the checkpoint) or set it to "
            f"{src.tokenizer!r}.")
    cfg.data.tokenizer = src.tokenizer
    return cfg


def model_dims(src: InitSource, m) -> dict:
    """The model dims of a run starting from `src` (models.model_config's `dims`): the
    checkpoint's architecture, with model.seq_len free; other model.* dims that are set
    must agree with it."""
    dims = dict(src.architecture)
    clash = []
    for key in m.keys():
        if key in models.COMMON_KEYS or m[key] is None:
            continue
        if key in FREE_DIMS:
            dims[key] = m[key]
        elif key not in dims:
            clash.append(f"model.{key}={m[key]!r} (a {src.family} model has no such dimension)")
        elif m[key] != dims[key]:
            clash.append(f"model.{key}={m[key]!r} (the checkpoint has {dims[key]!r})")
    if clash:
        raise UserError(
            f"init.from={str(src.step_dir)!r} fixes the model ({src.source}), but "
            f"{', '.join(clash)}. Unset them: the architecture comes from the checkpoint, and "
            f"only model.{' and model.'.join(FREE_DIMS)} may differ.")
    if "seq_len" in dims and dims["seq_len"] > src.architecture["seq_len"] and _length_shaped(src):
        raise UserError(
            f"model.seq_len={dims['seq_len']} is longer than the {src.architecture['seq_len']} "
            f"positions of init.from={str(src.step_dir)!r}, whose {src.family} has a learned "
            f"position table. Use model.seq_len <= {src.architecture['seq_len']}.")
    return dims


def vocab_size(src: InitSource, data_vocab: int) -> int:
    """The run's vocabulary: the checkpoint's; the data's ids must fit in it."""
    vocab = src.architecture["vocab_size"]
    if data_vocab > vocab:
        raise UserError(
            f"The data has {data_vocab} token ids but init.from={str(src.step_dir)!r} embeds "
            f"only {vocab}: it was trained with another tokenizer. Tokenize with the "
            f"checkpoint's ({src.tokenizer or 'the one it was trained with'}).")
    return vocab


def check_model(src: InitSource, cfg: models.ModelConfig) -> None:
    """A UserError naming every field in which the run's model differs from the checkpoint's."""
    ours = models.architecture(cfg)
    if models.family_of(cfg).name != src.family:
        raise UserError(f"The run's model is {models.family_of(cfg).name!r} but init.from="
                        f"{str(src.step_dir)!r} holds a {src.family!r} model. Set "
                        f"model.name={src.family} (init_from.resolve does).")
    diff = [f"{k}: run {ours.get(k)!r}, checkpoint {v!r}" for k, v in src.architecture.items()
            if ours.get(k) != v and k not in FREE_DIMS]  # load_params checks positions
    if diff:
        raise UserError(f"The run's {src.family} model does not match init.from="
                        f"{str(src.step_dir)!r} ({src.source}): {'; '.join(diff)}. Take the "
                        f"model dims from the checkpoint (init_from.model_dims).")


def _length_shaped(src: InitSource) -> bool:
    """Whether a param has a `length` axis (GPT-2's learned positions; not Llama's RoPE)."""
    from meshtrain.step import state as state_lib
    axes = state_lib.abstract_model(src.model_config()).axes
    return any("length" in a for a in tree_paths.flat(axes, is_leaf=lambda x: isinstance(x, tuple)).values())
