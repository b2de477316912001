"""Sample text from a trained run (nanoGPT's sample.py, on the run's mesh).

    python -m meshtrain.sample --workdir=W [--step=N] --prompt=TEXT [--num_samples=1]
        [--max_new_tokens=N] [--temperature=0.8] [--top_k=0] [--top_p=1.0] [--seed=0]
        [--mesh=SHAPE] [--layout=NAME]

The run is rebuilt from W/run.json: the model exactly as trained, the same mesh shape
and layout (CPU devices simulated to fit, as in training), the params of the latest
committed checkpoint (or --step) read straight into the layout's shardings, and the
tokenizer of the run's data config. The generation (meshtrain/generate.py) is
compiled once. Samples go to stdout, each followed by a separator line; what was
loaded and how fast it ran go to stderr. Bad input exits with status 2 and one
paragraph. See docs/sampling.md.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Callable

from meshtrain import mesh as mesh_lib
from meshtrain.errors import UserError, run_command

USAGE = ("python -m meshtrain.sample --workdir=DIR [--step=N] [--prompt=TEXT] [--num_samples=N] "
         "[--max_new_tokens=N] [--temperature=T] [--top_k=K] [--top_p=P] [--seed=S] "
         "[--mesh=SHAPE] [--layout=NAME]")
SEPARATOR = "---------------"
# Flag -> (type, default). max_new_tokens None: the rest of the context, at most 256.
FLAGS = {
    "workdir": (str, None), "step": (int, None), "prompt": (str, ""),
    "num_samples": (int, 1), "max_new_tokens": (int, None), "temperature": (float, 0.8),
    "top_k": (int, 0), "top_p": (float, 1.0), "seed": (int, 0),
    "mesh": (str, None), "layout": (str, None),
}
DEFAULT_MAX_NEW = 256


def parse_flags(argv: list[str]) -> dict:
    """`--name=value` or `--name value` for the FLAGS; anything else is a UserError."""
    given: dict[str, str] = {}
    args = list(argv)
    while args:
        arg = args.pop(0)
        name, sep, value = arg[2:].partition("=") if arg.startswith("--") else (arg, "", "")
        if not arg.startswith("--") or name not in FLAGS:
            raise UserError(f"Unknown argument {arg!r}. Usage: {USAGE}.")
        if not sep:
            if not args:
                raise UserError(f"Flag --{name} needs a value, e.g. --{name}=VALUE. Usage: {USAGE}.")
            value = args.pop(0)
        given[name] = value
    flags = {}
    for name, (kind, default) in FLAGS.items():
        if name not in given:
            flags[name] = default
            continue
        try:
            flags[name] = kind(given[name])
        except ValueError:
            what = {int: "an integer", float: "a number"}[kind]
            raise UserError(f"--{name}={given[name]!r}: expected {what}. Usage: {USAGE}.") from None
    if flags["workdir"] is None:
        raise UserError(f"No --workdir given: the directory of a run trained with "
                        f"`python -m meshtrain.train --workdir=DIR`. Usage: {USAGE}.")
    checks = [("num_samples", flags["num_samples"] >= 1, "at least 1"),
              ("max_new_tokens", flags["max_new_tokens"] is None or flags["max_new_tokens"] >= 1, "at least 1"),
              ("temperature", flags["temperature"] >= 0, ">= 0 (0 is greedy)"),
              ("top_k", flags["top_k"] >= 0, ">= 0 (0 keeps every token)"),
              ("top_p", 0 < flags["top_p"] <= 1, "in (0, 1] (1 keeps every token)"),
              ("seed", 0 <= flags["seed"] < 2**31, "in [0, 2**31)")]
    for name, ok, rule in checks:
        if not ok:
            raise UserError(f"--{name}={flags[name]}: must be {rule}.")
    return flags


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
    cfg = ml_collections.ConfigDict(merge(config_lib.base().to_dict(), run["config"]))
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


def from_workdir(flags: dict) -> Loaded:
    """A run trained with --workdir: run.json, its committed checkpoints, its data's tokenizer.

    (`--checkpoint=CKPT`, a converted Hugging Face checkpoint, will be a second function
    like this one; `run` below takes either.)
    """
    saved_run = read_run(flags["workdir"])
    cfg = run_config(saved_run, flags)
    shape = mesh_lib.parse_shape(cfg.mesh.shape)
    # Before JAX starts its backend, which fixes the device count.
    count, devices = mesh_lib.simulate_cpu_devices(shape)
    shape = mesh_lib.resolve_shape(shape, count, why=devices)

    from meshtrain import checkpoint as checkpoint_lib
    model, layout, mesh, shardings = build(cfg, saved_run, shape)
    # Absolute: Orbax wants it. A relative checkpoint.dir is relative to where we start.
    ckpt_dir = pathlib.Path(checkpoint_lib.checkpoint_dir(cfg, flags["workdir"])).absolute()
    step = pick_step(ckpt_dir, flags["step"])
    return Loaded(model, layout, mesh, shardings, tokenizer(cfg, flags["workdir"], model.cfg),
                  f"step {step} of {flags['workdir']}", devices,
                  lambda: restore_params(ckpt_dir, step, model, shardings))


def run(argv: list[str]) -> int:
    flags = parse_flags(argv)
    src = from_workdir(flags)
    from meshtrain import generate as gen
    model, layout, mesh = src.model, src.layout, src.mesh
    prompt = encode_prompt(flags["prompt"], src.tokenizer, model.cfg.vocab_size)
    n_new = new_tokens(len(prompt), flags["max_new_tokens"], model.cfg.seq_len)
    rows = gen.padded_rows(flags["num_samples"], layout, mesh)
    check_cache(model, layout, mesh, rows, len(prompt) + n_new)
    params = src.restore()

    say = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    say(f"meshtrain.sample: {src.what} | {model.family.describe(model.cfg)}")
    say(f"mesh {mesh_lib.format_factors(dict(mesh.shape))} ({src.devices}), layout {layout.name} | "
        f"{flags['num_samples']} sample(s) in {rows} rows, prompt {len(prompt)} tokens + {n_new} new")
    prompts = [prompt] * flags["num_samples"]
    t0 = time.perf_counter()
    fn = gen.compile_generate(gen.make_generate(model, layout, mesh, src.shardings, max_new_tokens=n_new),
                              params, rows, len(prompt), layout, mesh)
    t1 = time.perf_counter()
    out = gen.generate(fn, params, prompts, layout, mesh,
                       **{k: flags[k] for k in ("seed", "temperature", "top_k", "top_p")})
    t2 = time.perf_counter()
    say(f"compiled in {t1 - t0:.1f}s; generated {out.size} tokens in {t2 - t1:.2f}s "
        f"({out.size / (t2 - t1):,.0f} tokens/s)")
    for row in out:
        print(decode(src.tokenizer, prompt, row))
        print(SEPARATOR, flush=True)
    return 0


def new_tokens(prompt_len: int, asked: int | None, seq_len: int) -> int:
    """--max_new_tokens, or the rest of the context (at most DEFAULT_MAX_NEW); the prompt
    and the new tokens must fit in the model's seq_len (its position table, for GPT-2)."""
    if prompt_len >= seq_len:
        raise UserError(f"The prompt is {prompt_len} tokens, but the model's context is "
                        f"model.seq_len={seq_len} tokens, and at least one new token must fit. "
                        f"Shorten the prompt.")
    n_new = asked or min(DEFAULT_MAX_NEW, seq_len - prompt_len)
    if prompt_len + n_new > seq_len:
        raise UserError(f"The prompt ({prompt_len} tokens) plus --max_new_tokens={n_new} is "
                        f"{prompt_len + n_new} tokens, more than the model's context, "
                        f"model.seq_len={seq_len}. Use --max_new_tokens={seq_len - prompt_len} "
                        f"or less, or a shorter prompt.")
    return n_new


def build(cfg, saved_run: dict, shape: dict):
    """(unpipelined ModelDef, layout, mesh, params shardings) as the run trained them.

    The model config is the run's own (run.json "model"), so no data is read to size
    the vocabulary. A pipelined run's layers are put back in layer order: its layout's
    `stage:stage` rule then places nothing, and the stage devices split the batch.
    """
    import jax

    from meshtrain import layouts, models, state as state_lib
    fam = models.family.get(cfg.model.name)
    saved = saved_run["model"]
    known = {f.name for f in dataclasses.fields(fam.config)}
    model_cfg = fam.config(**{k: v for k, v in saved.items() if k in known})
    model_cfg = dataclasses.replace(model_cfg, dropout=0.0, remat="none")
    model = state_lib.abstract_model(model_cfg, None)
    layout = layouts.get(cfg.layout)
    mesh = mesh_lib.make_mesh(shape, jax.devices())
    return model, layout, mesh, state_lib.param_shardings(model, layout, mesh, "params")


def check_cache(model, layout, mesh, rows: int, length: int) -> None:
    """Divisibility of the sampling batch's activations and of the cache, before tracing."""
    import jax

    from meshtrain import generate as gen, state as state_lib
    state_lib.check_activations(model, rows, layout, mesh)

    cache = jax.eval_shape(lambda p: model.bind(p).init_cache(rows, length), model.shapes)
    axes = gen.cache_axes(model.bind(model.shapes), cache, model.cfg)
    is_axes = lambda a: isinstance(a, tuple) and all(isinstance(n, (str, type(None))) for n in a)  # noqa: E731
    for i, (leaf, leaf_axes) in enumerate(zip(jax.tree.leaves(cache), jax.tree.leaves(axes, is_leaf=is_axes))):
        spec = layout.spec(leaf_axes, "activations", where="the KV cache")
        state_lib.check_divisible(leaf.shape, leaf_axes, spec, mesh, layout, f"KV cache leaf {i}",
                                  model.size_keys())


def pick_step(ckpt_dir: pathlib.Path, step: int | None) -> int:
    """The committed step to read: `step`, or the latest. Read-only: the directory may
    belong to a run still training, so nothing in it is moved or cleaned."""
    from meshtrain import checkpoint as checkpoint_lib
    steps = checkpoint_lib.committed_steps(ckpt_dir) if ckpt_dir.is_dir() else []
    if not steps:
        raise UserError(f"No committed checkpoint in {ckpt_dir}: the run has not saved one yet "
                        f"(checkpoints are saved every checkpoint.every steps, at the end and on "
                        f"SIGTERM; train.steps=0 saves none). Train the run first, or pass the "
                        f"--workdir of a run that saved one.")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise UserError(f"--step={step}: {ckpt_dir} has no committed step {step}; it has "
                        f"{', '.join(map(str, steps))}. Pass one of them, or leave --step out "
                        f"for the latest.")
    return step


def restore_params(ckpt_dir: pathlib.Path, step: int, model, shardings):
    """Only the params of step `step` (not the optimizer state), read straight into
    `shardings`; a pipelined run's [S, r*Lc, ...] stacks are put back in layer order."""
    import logging

    import jax
    import orbax.checkpoint as ocp

    from meshtrain import checkpoint as checkpoint_lib, restage
    where = ckpt_dir / f"{checkpoint_lib.STEP_PREFIX}_{step}"
    meta = json.loads((where / "meta" / "metadata").read_text())
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


def encode_prompt(text: str, tok, vocab_size: int) -> list[int]:
    """The prompt's ids; an empty prompt starts from end of text (a document's start).
    Without a tokenizer (synthetic data) the prompt is ids: "3,17,42" or "3 17 42"."""
    if tok is not None:
        ids = [int(i) for i in tok.encode(text)]
        return ids or [tok.eot_id]
    parts = text.replace(",", " ").split()
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        ids = []
    if not ids or not all(0 <= i < vocab_size for i in ids):
        raise UserError(f"--prompt={text!r}: the run was trained on synthetic data, which has no "
                        f"tokenizer, so the prompt is token ids in [0, {vocab_size}), e.g. "
                        f"--prompt=3,17,42.")
    return ids


def decode(tok, prompt: list[int], new) -> str:
    """The sample as text: prompt and continuation (ids joined by spaces without a tokenizer)."""
    ids = list(prompt) + [int(i) for i in new]
    return " ".join(map(str, ids)) if tok is None else tok.decode(ids)


def main(argv: list[str] | None = None) -> int:
    return run_command(run, argv, "meshtrain.sample")


if __name__ == "__main__":
    sys.exit(main())
