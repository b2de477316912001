"""Loss and perplexity of a trained run or a converted checkpoint over a split of its data,
on any mesh and layout.

    meshtrain eval (--workdir=W | --checkpoint=CKPT) [--step=N] [--split=validation]
        [--batches=N] [--json] [--dump_logits=FILE.npz] [--config.KEY=VALUE ...]

--workdir: the run's own config (W/run.json), on the mesh and layout it trained on, with
the params of its latest committed checkpoint (or --step). With no flags it repeats the
run's eval: the same batches, the same jitted eval step, so the loss is the run's last
eval_loss when that step is the latest checkpoint.

--checkpoint: a checkpoint `meshtrain convert from_hf` wrote (or any that init.from
reads): config.base() with init.from=CKPT, so the architecture and the tokenizer are the
checkpoint's; one device (data:1) under layout dp unless overridden.

Either way --config.KEY=VALUE overrides that config: the data (--config.data.kind=text
--config.data.path=FILE), the mesh (--config.mesh.shape=fsdp:8 --config.layout=fsdp),
--config.train.batch_size, --config.model.seq_len (at most the checkpoint's), the
compute dtype (--config.model.dtype). The loss is training's eval, `loop.evaluate`: the
mean over batches of each batch's mean next-token loss, in float32. CPU devices are
simulated to fit the mesh; a mesh of fewer devices than the host has uses the first ones.
The result goes to stdout (one line, or one JSON object with --json); what was loaded and
a progress bar go to stderr. Bad input exits with status 2 and one paragraph. See
docs/eval.md.
"""

from __future__ import annotations

import itertools
import json
import math
import pathlib
import sys
import time

from meshtrain import cli, config as config_lib, mesh as mesh_lib
from meshtrain.errors import UserError
from meshtrain.progress import Progress
from meshtrain.sampling.sources import (check_source, checkpoint_path, mesh_devices, read_run, run_config,
                                        workdir_step)

SPLITS = ("validation", "train")


def parser() -> cli.Parser:
    p = cli.command_parser("meshtrain eval", __doc__, overrides=True)
    src = p.add_argument_group("what to evaluate (one of)")
    src.add_argument("--workdir", metavar="DIR", help="a run's workdir (`meshtrain train --workdir=DIR`)")
    src.add_argument("--checkpoint", metavar="CKPT", help="a converted checkpoint (`meshtrain convert from_hf`)")
    src.add_argument("--step", type=int, metavar="N", help="this committed step instead of the latest")
    p.add_argument("--split", default="validation",
                   help="validation: the held-out split (data.eval_split for TFDS data); train: the "
                        "training split (data.split), its batches in training order")
    p.add_argument("--batches", type=int, metavar="N",
                   help="batches of train.batch_size windows (default: train.eval_steps, the run's own "
                        "eval); 0: the whole split (text and TFDS data)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object on stdout (loss, perplexity, tokens, batches, split, step, mesh, "
                        "layout, seconds) instead of the line")
    p.add_argument("--dump_logits", metavar="FILE.npz",
                   help="write the evaluated tokens [N, T], targets [N, T], the targets' loss weights [N, T] "
                        "(0 across a document's end under data.packing=documents) and float32 logits "
                        "[N, T, V] (vocabulary padding stripped) to FILE.npz, for parity checks")
    return p


def check_flags(args) -> dict:
    """The parsed flags as a dict, checked before anything is read."""
    flags = vars(args)
    check_source(flags)
    if flags["split"] not in SPLITS:
        raise UserError(f"--split={flags['split']!r} does not exist: the splits are validation (the "
                        f"held-out split) and train. To evaluate another split of a TFDS dataset, make "
                        f"it the held-out one: --split=validation --config.data.eval_split=NAME.")
    if flags["batches"] is not None and flags["batches"] < 0:
        raise UserError(f"--batches={flags['batches']}: must be >= 0, the number of batches to "
                        f"evaluate, or 0 for the whole split (leave it out for train.eval_steps).")
    if flags["dump_logits"] is not None:
        out = pathlib.Path(flags["dump_logits"]).expanduser().absolute()
        if not out.parent.is_dir():
            raise UserError(f"--dump_logits={flags['dump_logits']!r}: the directory {str(out.parent)!r} "
                            f"does not exist. Create it first, or give a path in an existing directory.")
        flags["dump_logits"] = str(out)
    return flags


def load_config(flags: dict, overrides: list[tuple[str, str]]):
    """The run's config (--workdir) or config.base() (--checkpoint), overrides applied."""
    if flags["workdir"] is not None:
        cfg = run_config(read_run(flags["workdir"]), {"mesh": None, "layout": None})
    else:
        cfg = config_lib.base()
    for key, value in overrides:
        config_lib.override(cfg, key, value)
    if flags["batches"] == 0 and cfg.data.kind == "synthetic":
        raise UserError("--batches=0 evaluates the whole split, but data.kind='synthetic' is an endless "
                        "stream of Markov-chain windows. Give --batches=N, or evaluate a finite dataset: "
                        "--config.data.kind=text --config.data.path=FILE.")
    return cfg


def execute(args) -> int:
    flags = check_flags(args)
    cfg = load_config(flags, args.overrides)
    if flags["workdir"] is not None:  # found before JAX starts: a missing step fails fast
        from meshtrain.checkpoints.steps import STEP_PREFIX
        ckpt_dir, step = workdir_step(cfg, flags["workdir"], flags["step"])
        where, step_arg = ckpt_dir / f"{STEP_PREFIX}_{step}", None
    else:
        where, step_arg = checkpoint_path(flags["checkpoint"]), flags["step"]
    shape, devices, why = mesh_devices(mesh_lib.parse_shape(cfg.mesh.shape))

    from meshtrain.checkpoints import init_from, reading
    from meshtrain.run.experiment import Experiment
    # init.from names the step: its architecture and tokenizer (experiment.resolve), and
    # reading.load_params reads its params into any layout, mesh or pipeline arrangement.
    config_lib.override(cfg, "init.from", str(init_from.read(where, step_arg).step_dir))
    exp = Experiment.build(cfg, devices=devices, mesh_shape=shape)
    step = int(exp.init.step_dir.name.rpartition("_")[2])
    what = f"step {step} of {flags['workdir'] or flags['checkpoint']}"
    loaded = what if flags["workdir"] is not None else f"{what} ({exp.init.source})"
    n, note = num_batches(exp, flags["split"], flags["batches"])
    say = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    m = exp.model.cfg
    say(f"meshtrain eval: {loaded} | {exp.model.family.describe(m)}, compute {m.dtype}")
    mesh = mesh_lib.format_factors(dict(exp.mesh.shape))
    mesh = "data:1" if mesh == "1" else mesh
    unit, per_row = exp.task.unit, exp.task.units_per_example(m)
    rows_text = f"{cfg.train.batch_size} x {m.seq_len} tokens" if unit == "tokens" else f"{cfg.train.batch_size} {unit}"
    say(f"mesh {mesh} ({why}), layout {exp.layout.name} | "
        f"split {flags['split']}: {n} batches of {rows_text} ({note})")
    if flags["dump_logits"] and unit != "tokens":
        raise UserError(f"--dump_logits writes a language model's logits; {exp.model.family.name} is a "
                        f"{exp.task.name} model. Leave --dump_logits out.")
    params = reading.load_params(exp.init, exp.model, exp.shardings.params)
    stats = reading.load_stats(exp.init, exp.model, exp.shardings.stats)

    results, seconds, dumped = run_eval(exp, params, flags["split"], n, flags["dump_logits"], say, stats)
    result = results["loss"]
    # A finite image split's last batch is padded; its padding rows are not scored (count).
    units = results.pop("count", n * cfg.train.batch_size * per_row)
    try:
        perplexity = math.exp(result)
    except OverflowError:
        perplexity = math.inf
    if dumped:
        say(dumped)
    scores = (f"perplexity {perplexity:,.2f}" if unit == "tokens" else
              " | ".join(f"{k} {100 * results[k]:.2f}%" for k in exp.task.eval_metrics))
    line = (f"eval: loss {result:.4f} | {scores} | {units:,} {unit} in {n} batches of "
            f"split {flags['split']} | {what} | mesh {mesh}, layout {exp.layout.name} | {seconds:.1f}s")
    if flags["json"]:
        say(line)
        print(json.dumps({**results, "perplexity": perplexity, unit: units, "batches": n,
                          "split": flags["split"], "step": step, "mesh": dict(exp.mesh.shape),
                          "layout": exp.layout.name, "seconds": round(seconds, 3),
                          "checkpoint": str(exp.init.step_dir), "dump_logits": flags["dump_logits"]}),
              flush=True)
    else:
        print(line, flush=True)
    return 0


def num_batches(exp, split: str, asked: int | None) -> tuple[int, str]:
    """(batches to evaluate, where that number comes from) for --batches=`asked`. 0 is
    every window of the split once: ceil(windows / batch size) batches, the last one
    filled up with windows read again (both streams cycle)."""
    batch = exp.cfg.train.batch_size
    info = exp.source.info
    windows = (info.get("val_windows" if split == "validation" else "train_windows") if "eval_examples" not in info
               else info["eval_examples" if split == "validation" else "train_examples"])  # images
    if asked == 0:
        if windows is None:  # a source without a window count is endless
            raise UserError(f"--batches=0 evaluates the whole split, but the {exp.source.info.get('kind')!r} "
                            f"data has no end. Give --batches=N.")
        n = -(-windows // batch)
        note = f"the whole split, {windows} windows"
    else:
        n = exp.cfg.train.eval_steps if asked is None else asked
        note = "train.eval_steps" if asked is None else "--batches"
        if n < 1:
            raise UserError(f"train.eval_steps={n}: the run evaluated no batches, so there is no default "
                            f"to follow. Give --batches=N (0 for the whole split of text or TFDS data).")
    if windows is not None and n * batch > windows:
        note += f"; the split has {windows} windows, so {n * batch - windows} are read again"
    return n, note


def run_eval(exp, params, split: str, n: int, dump: str | None, say, stats=None) -> tuple[dict, float, str]:
    """({"loss", and the task's eval metrics} as training's eval computes them, seconds,
    the --dump_logits log line or "") over `n` batches of `split`, with a progress bar on
    stderr."""
    import jax
    import numpy as np

    from meshtrain.run import loop
    from meshtrain.step import train_step as step_lib
    rows = exp.eval_batches(n) if split == "validation" else itertools.islice(exp.train_batches(), n)
    b, t, vocab = exp.cfg.train.batch_size, exp.model.cfg.seq_len, exp.model.cfg.vocab_size
    per_batch = b * exp.task.units_per_example(exp.model.cfg)
    progress = Progress(f"eval {split}", n * per_batch, unit=f" {exp.task.unit}")
    kept: list = []
    if dump:
        # The run's task: under data.packing=documents its forward masks each document.
        logits_step = step_lib.make_logits_step(exp.model, exp.layout, exp.mesh, exp.shardings.params, exp.task,
                                                exp.offload)
        say(f"--dump_logits: {n * b} x {t} x {vocab} float32 logits, {mib(n * b * t * vocab * 4)}, are "
            f"kept in host memory and written to {dump} at the end")

    def each(tokens, loss):
        if dump:
            logits, weights = jax.device_get(logits_step(params, tokens))
            kept.append((np.asarray(jax.device_get(tokens)), np.asarray(logits)[..., :vocab], np.asarray(weights)))
        jax.block_until_ready(loss)
        progress.update(per_batch)

    t0 = time.perf_counter()
    loss = loop.evaluate(exp, params, rows, each, stats)
    seconds = time.perf_counter() - t0
    progress.close()
    if not dump:
        return loss, seconds, ""
    tokens = np.concatenate([k[0] for k in kept])
    with open(dump, "wb") as f:  # a file object: np.savez adds no second .npz
        np.savez(f, tokens=tokens[:, :-1], targets=tokens[:, 1:],
                 logits=np.concatenate([k[1] for k in kept]).astype(np.float32),
                 weights=np.concatenate([k[2] for k in kept]).astype(np.float32))
    size, rows = pathlib.Path(dump).stat().st_size, len(tokens)
    return loss, seconds, (f"--dump_logits: wrote {dump} ({mib(size)}: tokens, targets and weights "
                           f"[{rows}, {t}], logits [{rows}, {t}, {vocab}])")


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


run, main = cli.entry_points(parser, execute)


if __name__ == "__main__":
    sys.exit(main())
