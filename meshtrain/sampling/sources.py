"""Where sampling's model, params and tokenizer come from (meshtrain/sample.py):

  from_workdir(flags)     a training run: W/run.json's model on its mesh and layout, the
                          params of a committed step, the run's tokenizer (encoding
                          prompts as the step's meta says: prompt_tokenizer)
  from_checkpoint(flags)  a converted Hugging Face checkpoint (meshtrain.convert from_hf):
                          its architecture on --mesh under --layout, its tokenizer

Both return a `Loaded`; params are read only when `Loaded.restore()` is called, straight
into the layout's shardings.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable

from meshtrain import mesh as mesh_lib
from meshtrain.errors import UserError

# --checkpoint has no run to take them from: one device, data parallel, float32 compute.
CHECKPOINT_MESH, CHECKPOINT_LAYOUT, CHECKPOINT_DTYPE = "data:1", "dp", "float32"
DTYPES = ("float32", "bfloat16", "float16")


def read_run(workdir: str) -> dict:
    """W/run.json, which `meshtrain.train --workdir=W` writes before the first step."""
    path = pathlib.Path(workdir) / "run.json"
    try:
        run = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} does not exist: --workdir={workdir!r} is not the directory of a "
                        f"meshtrain run. Pass the --workdir a run was trained with.") from None
    except (OSError, ValueError) as e:
        raise UserError(f"Could not read {path}: {e}. It is written by `python -m meshtrain.train "
                        f"--workdir=DIR`; pass the directory of a run.") from None
    if not isinstance(run, dict) or not {"config", "model"} <= run.keys():
        raise UserError(f"{path} lacks the run's config or model: it was not written by "
                        f"meshtrain.train. Pass the --workdir a run was trained with.")
    return run


def run_config(run: dict, flags: dict):
    """The run's config (base() keys filled in for runs older than this code), on the mesh
    the run resolved, in one process; --mesh and --layout replace the run's."""
    import ml_collections

    from meshtrain import config as config_lib

    def merge(into: dict, saved: dict) -> dict:
        for k, v in saved.items():
            into[k] = merge(into[k], v) if isinstance(v, dict) and isinstance(into.get(k), dict) else v
        return into
    cfg = ml_collections.ConfigDict(merge(config_lib.base().to_dict(), config_lib.upgrade(run["config"])))
    # The mesh the run resolved (a -1 axis filled); DCN factors mean nothing in one process.
    resolved = (run.get("mesh") or {}).get("shape")
    cfg.mesh.shape = mesh_lib.format_shape(resolved) if resolved else cfg.mesh.shape
    cfg.mesh.dcn = ""
    if flags["mesh"] is not None:
        cfg.mesh.shape = flags["mesh"]
    if flags["layout"] is not None:
        cfg.layout = flags["layout"]
    cfg.lock()
    return cfg


@dataclasses.dataclass
class Loaded:
    """What sampling needs from a run: the model on its mesh, where its params come from,
    and its tokenizer (None: synthetic data, prompts and samples are ids)."""

    model: object            # an unpipelined state.ModelDef
    layout: object
    mesh: object
    shardings: object        # params-shaped NamedShardings under the layout's params rules
    tokenizer: object
    what: str                # for the log line: which params, from where
    devices: str             # where the device count came from
    restore: Callable[[], object]  # -> params in `shardings`


def mesh_devices(shape: dict) -> tuple[dict, list, str]:
    """(shape with a -1 axis filled, the devices to lay it on, where they came from).

    Simulates CPU devices to fit, as training does; must run before JAX starts its
    backend (which fixes the device count). A mesh of fewer devices than there are
    (say --mesh=data:1 on a host of 8) uses the first ones: sampling is one process.
    """
    import jax
    count, why = mesh_lib.simulate_cpu_devices(shape)
    want = math.prod(shape.values())
    if -1 not in shape.values() and want < count:
        return dict(shape), jax.devices()[:want], f"the first {want} of {count} devices; {why}"
    return mesh_lib.resolve_shape(shape, count, why=why), jax.devices(), why


def from_workdir(flags: dict) -> Loaded:
    """A run trained with --workdir: run.json, its committed checkpoints, its data's tokenizer."""
    saved_run = read_run(flags["workdir"])
    cfg = run_config(saved_run, flags)
    shape, devices, why = mesh_devices(mesh_lib.parse_shape(cfg.mesh.shape))

    from meshtrain.checkpoints import init_from, steps as steps_lib
    model, layout, mesh, shardings = build(cfg, saved_run, shape, devices, flags["dtype"])
    ckpt_dir, step = workdir_step(cfg, flags["workdir"], flags["step"])
    meta = step_meta(ckpt_dir / f"{steps_lib.STEP_PREFIX}_{step}")
    tok = prompt_tokenizer(tokenizer(cfg, flags["workdir"], model.cfg), init_from.prompt_special_tokens(meta))
    return Loaded(model, layout, mesh, shardings, tok, f"step {step} of {flags['workdir']}", why,
                  lambda: restore_params(ckpt_dir, step, model, shardings))


def from_checkpoint(flags: dict) -> Loaded:
    """A checkpoint `meshtrain.convert from_hf` wrote (or any checkpoint init.from reads):
    its architecture on --mesh under --layout, its params, its tokenizer."""
    path = checkpoint_path(flags["checkpoint"])
    shape, devices, why = mesh_devices(mesh_lib.parse_shape(flags["mesh"] or CHECKPOINT_MESH))

    from meshtrain.checkpoints import init_from
    from meshtrain.parallel import layouts
    layout = layouts.get(flags["layout"] or CHECKPOINT_LAYOUT)
    src = init_from.read(path, flags["step"])
    model, mesh, shardings = build_from_source(src, layout, shape, devices, flags["dtype"] or CHECKPOINT_DTYPE)
    return Loaded(model, layout, mesh, shardings, checkpoint_tokenizer(src),
                  f"{src.step_dir} ({src.source})", why, lambda: load_source_params(src, model, shardings))


def build(cfg, saved_run: dict, shape: dict, devices, dtype: str | None = None):
    """(unpipelined ModelDef, layout, mesh, params shardings) as the run trained them.

    The model config is the run's own (run.json "model"), so no data is read to size
    the vocabulary; `dtype` (--dtype) replaces its compute dtype. A pipelined run's
    layers are put back in layer order: its layout's `stage:stage` rule then places
    nothing, and the stage devices split the batch.
    """
    from meshtrain import models
    from meshtrain.parallel import layouts
    from meshtrain.step import state as state_lib
    fam = models.family.get(cfg.model.name)
    saved = saved_run["model"]
    known = {f.name for f in dataclasses.fields(fam.config)}
    model_cfg = fam.config(**{k: v for k, v in saved.items() if k in known})
    model_cfg = dataclasses.replace(model_cfg, dropout=0.0, remat="none", dtype=dtype or model_cfg.dtype)
    model = state_lib.abstract_model(model_cfg, None)
    layout = layouts.get(cfg.layout)
    mesh = mesh_lib.make_mesh(shape, devices)
    return model, layout, mesh, state_lib.param_shardings(model, layout, mesh, "params")


def build_from_source(src, layout, shape: dict, devices, dtype: str):
    """(unpipelined ModelDef, mesh, params shardings) for a checkpoint's model.

    The model is the checkpoint's architecture (its seq_len included), with the
    vocabulary padded to a multiple of model.vocab_multiple and of the layout's vocab
    shards, as a training run pads it (models.model_config). Compute in `dtype`; params
    are kept in the dtype most of them are stored in (a bf16 model stays bf16).
    """
    import ml_collections
    import numpy as np

    from meshtrain import config as config_lib, models
    from meshtrain.checkpoints import reading
    from meshtrain.run.experiment import vocab_shards
    from meshtrain.step import state as state_lib
    mesh = mesh_lib.make_mesh(shape, devices)
    stored = [np.dtype(m.dtype).name for m in reading.saved_params(src).values()]
    param_dtype = max(set(stored), key=stored.count) if stored else "float32"
    m = ml_collections.ConfigDict(config_lib.base().model.to_dict())
    m.update(name=src.family, dtype=dtype, param_dtype=param_dtype if param_dtype in DTYPES else "float32")
    model_cfg = models.model_config(m, vocab_size=src.architecture["vocab_size"],
                                    vocab_shards=vocab_shards(layout, mesh), dims=src.architecture)
    model = state_lib.abstract_model(model_cfg, None)
    return model, mesh, state_lib.param_shardings(model, layout, mesh, "params")


def load_source_params(src, model, shardings):
    """The checkpoint's params straight into `shardings` (reading.load_params: each
    device reads its shards, vocabulary rows past the checkpoint's are zero, a pipelined
    training checkpoint's stacks are put back in layer order)."""
    from meshtrain.checkpoints import reading
    return reading.load_params(src, model, shardings)


def checkpoint_tokenizer(src):
    """The checkpoint's tokenizer (checkpoints/tokenizer.py: a training run's saved
    WORKDIR/tokenizer.json, a converted model's files), or None when it has none: the
    prompt and the samples are then ids. A converted model's tokenizer.json, and that of
    every run trained from one, encodes the prompt as transformers' `tokenizer(prompt)`
    does (src.prompt_special_tokens, PromptTokenizer)."""
    from meshtrain.checkpoints import tokenizer as checkpoint_tokenizer_lib
    tok, why = checkpoint_tokenizer_lib.of(src)
    if tok is None and src.tokenizer is not None:  # it had one: prompts are not ids
        raise UserError(f"{src.step_dir} has no tokenizer to read: {why}. Sample the run with "
                        f"--workdir=W, its directory, which rebuilds it from the run's corpus.")
    return prompt_tokenizer(tok, src.prompt_special_tokens)


def prompt_tokenizer(tok, special_tokens: bool):
    """`tok`, encoding prompts with the special tokens its model was trained to see first
    where the checkpoint says so (init_from.prompt_special_tokens): a tokenizer.json's
    post-processor's, or Llama 3's BOS for Meta's tokenizer.model."""
    from meshtrain.data.hf_tokenizer import HFTokenizer, TiktokenTokenizer
    return PromptTokenizer(tok) if special_tokens and isinstance(tok, (HFTokenizer, TiktokenTokenizer)) else tok


def step_meta(where: pathlib.Path) -> dict:
    """The meta JSON of the committed step directory `where`."""
    return json.loads((where / "meta" / "metadata").read_text())


class PromptTokenizer:
    """A Hugging Face model's tokenizer.json that encodes with the special tokens its
    post-processor adds (Llama's BOS first; none for GPT-2), as transformers'
    `tokenizer(text)` does, or Meta's Llama 3 tokenizer.model with <|begin_of_text|> first:
    the model was trained on text that starts so. Training data
    is tokenized without them (docs/huggingface.md), but a run trained from such a model
    samples so too (init_from.prompt_special_tokens); everything else is the tokenizer's."""

    def __init__(self, tok):
        self.tok = tok

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text: str):
        import numpy as np
        if hasattr(self.tok, "hf"):
            return np.asarray(self.tok.hf.encode(text, add_special_tokens=True).ids, np.int32)
        # Meta's tokenizer.model has no post-processor: its reference encodes a completion's
        # prompt with bos=True, and the tokenizer.json transformers converts it to prepends
        # <|begin_of_text|> (a TemplateProcessing), so the model has always seen it first.
        from meshtrain.data.hf_tokenizer import special_id
        return np.concatenate([[special_id(self.tok, "<|begin_of_text|>")], self.tok.encode(text)]).astype(np.int32)


def check_source(flags: dict) -> None:
    """Exactly one of flags["workdir"] and flags["checkpoint"] (sample's and eval's flags)."""
    if (flags["workdir"] is None) == (flags["checkpoint"] is None):
        given = "Both --workdir and --checkpoint were given" if flags["workdir"] else "No --workdir or --checkpoint given"
        raise UserError(f"{given}: pass exactly one, --workdir=DIR for a run trained with "
                        f"`meshtrain train --workdir=DIR`, or --checkpoint=CKPT for a model converted "
                        f"with `meshtrain convert from_hf --model=HF_DIR --out=CKPT`.")


def checkpoint_path(given: str) -> pathlib.Path:
    """--checkpoint=CKPT as an absolute path; a UserError when it does not exist."""
    path = pathlib.Path(given).expanduser().absolute()
    if not path.exists():
        raise UserError(f"--checkpoint={given!r} does not exist. Give the --out directory of "
                        f"`python -m meshtrain.convert from_hf --model=HF_DIR --out=CKPT`.")
    return path


def workdir_step(cfg, workdir: str, step: int | None) -> tuple[pathlib.Path, int]:
    """(the run's checkpoint directory, absolute, the committed step to read: `step` or
    the latest) of the run trained with --workdir=`workdir` and config `cfg`."""
    from meshtrain.checkpoints import store as checkpoint_lib
    # Absolute: Orbax wants it. A relative checkpoint.dir is relative to where we start.
    ckpt_dir = pathlib.Path(checkpoint_lib.checkpoint_dir(cfg, workdir)).absolute()
    return ckpt_dir, pick_step(ckpt_dir, step)


def pick_step(ckpt_dir: pathlib.Path, step: int | None) -> int:
    """The committed step to read: `step`, or the latest; a damaged one is a UserError naming
    the file and the newest intact step (steps.check_readable). Read-only: the directory may
    belong to a run still training, so nothing in it is moved or cleaned."""
    from meshtrain.checkpoints import steps as steps_lib
    steps = steps_lib.committed_steps(ckpt_dir) if ckpt_dir.is_dir() else []
    if not steps:
        raise UserError(f"No committed checkpoint in {ckpt_dir}: the run has not saved one yet "
                        f"(checkpoints are saved every checkpoint.every steps, at the end and on "
                        f"SIGTERM; train.steps=0 saves none). Train the run first, or pass the "
                        f"--workdir of a run that saved one.")
    if step is not None and step not in steps:
        raise UserError(f"--step={step}: {ckpt_dir} has no committed step {step}; it has "
                        f"{', '.join(map(str, steps))}. Pass one of them, or leave --step out "
                        f"for the latest.")
    step = steps[-1] if step is None else step
    steps_lib.check_readable(ckpt_dir / f"{steps_lib.STEP_PREFIX}_{step}")
    return step


def restore_params(ckpt_dir: pathlib.Path, step: int, model, shardings):
    """Only the params of step `step` (not the optimizer state), read straight into
    `shardings`; a pipelined run's [S, r*Lc, ...] stacks are put back in layer order.
    A failed read is a UserError naming the step, the file and the step to pass instead."""
    from meshtrain.checkpoints import integrity, steps as steps_lib
    where = ckpt_dir / f"{steps_lib.STEP_PREFIX}_{step}"
    with integrity.reading(where, lambda: steps_lib.older_intact(where)):
        return _read_params(where, model, shardings)


def _read_params(where: pathlib.Path, model, shardings):
    import logging

    import jax
    import orbax.checkpoint as ocp

    from meshtrain.checkpoints import store as checkpoint_lib
    from meshtrain.checkpoints import restage
    meta = step_meta(where)
    saved_arr = restage.arrangement((meta.get("run") or {}).get("pipeline"))
    target = {"params": jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                     model.shapes, shardings)}
    if saved_arr is not None:
        target = restage.saved_target(target, None, saved_arr, model.stacked)
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax logs every read at INFO
    saved = ocp.PyTreeCheckpointHandler().metadata(where / "state")
    saved = getattr(saved, "tree", saved)
    checkpoint_lib.check_fits({"params": saved["params"]}, target, str(where), meta.get("run"))
    restored = ocp.PyTreeCheckpointer().restore(where / "state", args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True))
    params = restored["params"]
    if saved_arr is not None:
        params = restage.restack(params, None, saved_arr, shardings, model.stacked)
    return params


def tokenizer(cfg, workdir: str, model_cfg):
    """The run's tokenizer, or None for synthetic data (prompts and samples are then ids).

    W/tokenizer.json when the run saved one; else rebuilt from data.tokenizer without
    reading the data, except for the char tokenizer (its vocabulary is the corpus's
    characters) and TFDS datasets (which carry their own tokenizer).
    """
    from meshtrain.data import load_tokenizer, make_source
    from meshtrain.data.tokenizers import make_tokenizer
    saved = pathlib.Path(workdir) / "tokenizer.json"
    d = cfg.data
    if saved.exists():
        tok = load_tokenizer(saved)
    elif d.kind == "synthetic":
        return None
    elif d.kind == "text" and d.tokenizer != "char":
        tok = make_tokenizer(d.tokenizer)
    else:
        tok = make_source(d, vocab_size=model_cfg.vocab_size, seq_len=model_cfg.seq_len,
                          seed=cfg.train.seed).tokenizer
    if tok.vocab_size > model_cfg.vocab_size:
        raise UserError(f"The tokenizer rebuilt from the run's data config ({tok.describe()}) "
                        f"has more ids than the model was trained with ({model_cfg.vocab_size}): "
                        f"the data changed since training. Restore the data the run used.")
    return tok
