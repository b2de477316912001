"""Convert Hugging Face causal LMs to meshtrain checkpoints and back.

    meshtrain convert from_hf --model=HF_DIR --out=CKPT
    meshtrain convert to_hf --workdir=W [--step=N] --out=HF_DIR [--dtype=bfloat16]

from_hf reads config.json and the safetensors weights (one file or shards) of a
GPT2LMHeadModel, LlamaForCausalLM or MixtralForCausalLM directory, one tensor at a time,
and writes CKPT: a meshtrain checkpoint (init_from.py describes it) in the weights' own
dtype, with the tokenizer files beside it. Train from it with `--config.init.from=CKPT`.

to_hf reads a training workdir (or checkpoint directory, or a converted CKPT), one
params leaf at a time, and writes safetensors shards, config.json and
generation_config.json that `transformers.AutoModelForCausalLM.from_pretrained` loads,
with the vocabulary padding stripped, and the run's tokenizer (any kind) as a
tokenizer.json that `AutoTokenizer` loads; a run without one (synthetic data) gets a
one-line warning that says why. Token ids in the configs lie inside the vocabulary.

Memory: from_hf holds the whole converted model (the size of the weights in their
dtype) plus one source tensor; to_hf holds one stacked leaf plus one shard (5 GiB).
docs/huggingface.md has the numbers.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from meshtrain import cli

DTYPES = ("float32", "bfloat16", "float16")
# Orbax writes arrays in chunks, and OCDBT data files, of at most this many bytes: a run
# on many devices then reads each shard without decoding a whole leaf, and the writer
# buffers a few files instead of the whole model (measured: +0.3 GiB, not +0.8x).
CHUNK_BYTES = 64 * 2**20


def parser():
    p = cli.command_parser("meshtrain convert", __doc__)
    commands = p.add_subparsers(dest="command", metavar="{from_hf,to_hf}",
                                title="commands (`meshtrain convert COMMAND --help` for its flags)")
    hf_in = commands.add_parser("from_hf",
                                help="a Hugging Face GPT-2, Llama or Mixtral directory -> a meshtrain checkpoint",
                                description="Read config.json and the safetensors weights of a GPT2LMHeadModel, "
                                            "LlamaForCausalLM or MixtralForCausalLM directory, one tensor at a "
                                            "time, and write a checkpoint to fine-tune "
                                            "(--config.init.from=CKPT), evaluate or sample.")
    hf_in.add_argument("--model", required=True, metavar="HF_DIR", help="the Hugging Face model directory")
    hf_in.add_argument("--out", required=True, metavar="CKPT", help="a new directory for the checkpoint")
    hf_out = commands.add_parser("to_hf", help="a run or a checkpoint -> a directory transformers loads",
                                 description="Write safetensors shards, config.json, generation_config.json "
                                             "and the tokenizer files of a run (or a converted checkpoint), "
                                             "the vocabulary padding stripped.")
    hf_out.add_argument("--workdir", required=True, metavar="W",
                        help="a training workdir, its checkpoint directory, one step_N, or a converted CKPT")
    hf_out.add_argument("--step", type=int, metavar="N", help="this committed step instead of the latest")
    hf_out.add_argument("--out", required=True, metavar="HF_DIR", help="a new directory for the model")
    hf_out.add_argument("--dtype", choices=DTYPES, help="the weights' dtype (default: the checkpoint's)")
    return p


def _fresh_dir(out: Path, flag: str) -> None:
    from meshtrain.errors import UserError
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--{flag}={str(out)!r} already exists and is not empty. Give a new "
                        f"directory (nothing is overwritten).")


def from_hf(model_dir: str, out: str, say=print) -> None:
    """HF_DIR -> CKPT (a converted meshtrain checkpoint). A failure leaves no CKPT."""
    from meshtrain import hf
    model_dir, out = Path(model_dir).expanduser().absolute(), Path(out).expanduser().absolute()
    config = hf.read_config(model_dir)
    where = str(model_dir / "config.json")
    conv = hf.converter_for(config, where)
    arch = conv.architecture(config, where)
    _fresh_dir(out, "out")
    try:
        _from_hf(model_dir, out, config, conv, arch, say)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # it was new or empty: nothing of the user's
        raise


def _from_hf(model_dir: Path, out: Path, config: dict, conv, arch: dict, say) -> None:
    from meshtrain import hf, tree_paths
    from meshtrain.checkpoints import init_from, reading
    from meshtrain.hf import safetensors_io, tensors
    from meshtrain.hf import tokenizer_files
    from meshtrain.step import state as state_lib
    t0 = time.perf_counter()
    where = str(model_dir / "config.json")
    # The tokenizer first: it is small, and a broken one should fail before the weights.
    spec, copied = tokenizer_files.copy_files(model_dir, out / init_from.TOKENIZER_DIR)
    reader = safetensors_io.Reader(model_dir)
    try:
        names = reader.keys()
        layers = arch["num_layers"]
        table = hf.import_table(conv, arch, names)
        tensors.check_names(table, layers, names, conv.ignored_for(arch), str(model_dir), conv.SUPPORTED)
        model_cfg = init_from.config_of(conv.FAMILY, arch)
        model = state_lib.abstract_model(model_cfg)
        shapes = {k: v.shape for k, v in tree_paths.flat(model.shapes).items()}
        assert set(shapes) == {t.ours for t in table}, (sorted(shapes), [t.ours for t in table])
        total = sum(reader.nbytes(n) for n in {n for t in table for n in t.names(layers)})
        say(f"from_hf: {model_dir} ({conv.ARCHITECTURE}) -> {out}")
        say(f"  {model.family.describe(model_cfg)}; {total / 2**30:.2f} GiB of weights, all held "
            f"in memory until written")
        flat = tensors.import_params(table, layers, reader.get, reader.nbytes, shapes, say)
    finally:
        reader.close()
    dtypes = sorted({a.dtype.name for a in flat.values()})
    generation = model_dir / "generation_config.json"
    meta = {"family": conv.FAMILY, "architecture": init_from.normalize(conv.FAMILY, arch, where),
            "tokenizer": spec,
            # Prompts are encoded as transformers' tokenizer(prompt) does: with the special
            # tokens the post-processor adds (Llama's BOS); runs trained from it inherit this.
            init_from.PROMPT_SPECIAL_TOKENS: spec is not None,
            "source": {"path": str(model_dir), "architecture": conv.ARCHITECTURE,
                       "model_type": conv.MODEL_TYPE, "dtype": dtypes, "config": config,
                       "generation_config": json.loads(generation.read_text()) if generation.is_file() else None}}
    say(f"  writing {out}/step_0 ...")
    write_checkpoint(out, reading.nest(flat), meta)
    del flat
    say(f"  tokenizer: {copied}{f' -> data.tokenizer {spec!r} (relative to {out})' if spec else ''}")
    say(f"done in {time.perf_counter() - t0:.1f}s: {out} ({', '.join(dtypes)}). Fine-tune with "
        f"--config.init.from={out}")


def write_checkpoint(out: Path, params: dict, meta: dict) -> None:
    """CKPT/step_0 with {"params": params} (nested dict of numpy arrays) and meta, in the
    layout init_from.py describes."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from meshtrain.checkpoints import steps as steps_lib
    from meshtrain.checkpoints import init_from
    # No deep copy of numpy leaves (Orbax's default copies the whole model first: we hold
    # the only reference); the jax.Array entry only keeps Orbax from warning it has none.
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, ocp.type_handlers.ArrayHandler()))
    manager = ocp.CheckpointManager(
        out, options=ocp.CheckpointManagerOptions(step_prefix=steps_lib.STEP_PREFIX, create=True,
                                                  enable_async_checkpointing=False),
        item_handlers={"state": ocp.PyTreeCheckpointHandler(type_handler_registry=registry),
                       "meta": ocp.JsonCheckpointHandler()})
    tree = {"params": params}
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), tree)
    manager.save(init_from.CONVERTED_STEP, args=ocp.args.Composite(
        state=ocp.args.PyTreeSave(tree, save_args=save_args, ocdbt_target_data_file_size=CHUNK_BYTES),
        meta=ocp.args.JsonSave({"format": init_from.FORMAT, **meta})))
    manager.wait_until_finished()
    manager.close()


def _warn(line: str) -> None:
    print(f"meshtrain convert: warning: {line}", file=sys.stderr, flush=True)


def to_hf(path: str, out: str, step: int | None = None, dtype: str | None = None, say=print,
          warn=_warn) -> None:
    """A meshtrain checkpoint (workdir, checkpoint dir, step dir or converted CKPT) -> HF_DIR;
    `warn` gets one line for what the export lacks (a tokenizer, an id past the vocabulary)."""
    import numpy as np

    from meshtrain import hf, tree_paths
    from meshtrain.checkpoints import init_from, reading, tokenizer as checkpoint_tokenizer
    from meshtrain.errors import UserError
    from meshtrain.hf import safetensors_io, tensors
    from meshtrain.hf import tokenizer_files
    from meshtrain.step import state as state_lib
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype={dtype!r}: choose one of {', '.join(DTYPES)} (or leave it out "
                        f"to keep the checkpoint's).")
    out = Path(out).expanduser().absolute()
    src = init_from.read(path, step)
    conv = hf.converter_of_family(src.family)
    arch = src.architecture
    model = state_lib.abstract_model(src.model_config())
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    axes, shapes = tree_paths.flat(model.axes, is_leaf=is_axes), tree_paths.flat(model.shapes)
    saved = reading.saved_params(src)
    table = conv.table(arch)
    if set(saved) != {t.ours for t in table}:
        raise UserError(f"{src.step_dir} holds params {sorted(saved)}, not those of its "
                        f"{src.family} architecture ({sorted(t.ours for t in table)}). Export a "
                        f"complete checkpoint.")
    _fresh_dir(out, "out")
    stored = sorted({np.dtype(m.dtype).name for m in saved.values()})
    out_dtype = dtype or max(stored, key=lambda d: sum(np.dtype(m.dtype).name == d for m in saved.values()))
    vocab = arch["vocab_size"]
    tok, no_tokenizer = checkpoint_tokenizer.of(src)

    def read_leaf(leaf_path: str) -> np.ndarray:
        x = reading.read_leaf(src, leaf_path, model.stacked)
        # The vocabulary padding (rows, or lm_head columns) is not part of the HF model.
        x = x[tuple(slice(0, vocab) if a == "vocab" else slice(None) for a in axes[leaf_path])]
        if x.shape != shapes[leaf_path].shape:
            raise UserError(f"{src.step_dir}: {leaf_path} is {list(x.shape)} without vocabulary "
                            f"padding, but its architecture implies {list(shapes[leaf_path].shape)}.")
        return x

    total = sum(int(np.prod(s.shape)) * np.dtype(out_dtype).itemsize for s in shapes.values())
    say(f"to_hf: {src.source} -> {out} ({conv.ARCHITECTURE}, {out_dtype}, {total / 2**30:.2f} GiB)")
    t0 = time.perf_counter()
    try:
        writer = safetensors_io.Writer(out)
        tensors.export_params(table, arch["num_layers"], read_leaf, writer.add,
                              None if dtype is None else _np_dtype(dtype), total, say)
        files = writer.close()
        source = src.hf_source()
        config = conv.hf_config(arch, source.get("config"), out_dtype, tokenizer_files.token_ids(tok))
        generation = dict(source.get("generation_config") or {"_from_model_config": True})
        for key in ("bos_token_id", "eos_token_id"):
            if config.get(key) is not None:
                generation.setdefault(key, config[key])
        dropped = tokenizer_files.keep_in_vocabulary([config, generation], vocab)
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
        tok_files = [] if tok is None else tokenizer_files.write_hf_files(tok, src.tokenizer, out)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # it was new or empty: nothing of the user's
        raise
    if tok is None:
        warn(f"{out} has no tokenizer: {no_tokenizer}.")
    if dropped:
        warn(f"{', '.join(dropped)} set to null in config.json/generation_config.json: outside "
             f"the vocabulary of {vocab} ids.")
    say(f"done in {time.perf_counter() - t0:.1f}s: {len(files)} safetensors file(s), config.json, "
        f"generation_config.json{', ' + ', '.join(tok_files) if tok_files else ' (no tokenizer files)'}")


def _np_dtype(name: str):
    import ml_dtypes
    import numpy as np
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def execute(args) -> int:
    from meshtrain.errors import UserError
    if args.command is None:
        raise UserError("Give a command, from_hf or to_hf: `meshtrain convert from_hf --model=HF_DIR "
                        "--out=CKPT` or `meshtrain convert to_hf --workdir=W --out=HF_DIR`.")
    if args.command == "from_hf":
        from_hf(args.model, args.out)
        return 0
    to_hf(args.workdir, args.out, args.step, args.dtype)
    return 0


run, main = cli.entry_points(parser, execute)


if __name__ == "__main__":
    sys.exit(main())
