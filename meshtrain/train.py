"""Train a model on a device mesh.

    python -m meshtrain.train --config=gpt2_tiny_dp2_tp4 --workdir=runs/tiny [--config.key=value ...]

`--config.train.steps=0` builds, shards and compiles the step, writes run.json
(with the compiled per-device memory) and exits: a compile-only check of a layout.
Bad input exits with status 2 and one paragraph on stderr, never a traceback.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

from meshtrain import config as config_lib, mesh as mesh_lib
from meshtrain.errors import UserError, run_command

FLAGS = ("workdir",)


def _maybe_initialize_distributed() -> None:
    """Multi-process launches (SLURM, or an explicit coordinator) join one JAX runtime."""
    import jax
    if os.environ.get("JAX_COORDINATOR_ADDRESS") or int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        jax.distributed.initialize()


def _run_info(name, exp, compiled_memory, compile_s, simulated: str) -> dict:
    import flax
    import jax
    import optax

    from meshtrain import reporting
    device = jax.devices()[0]
    m = exp.model.cfg
    return {
        "config_name": name,
        "config": exp.cfg.to_dict(),
        "mesh": {"shape": dict(exp.mesh.shape), "axis_names": list(exp.mesh.axis_names)},
        "layout": {"name": exp.layout.name, "rules": exp.layout.describe()},
        "device_kind": device.device_kind, "platform": device.platform,
        "device_count": jax.device_count(), "devices_source": simulated,
        "process_count": jax.process_count(),
        "num_params": exp.num_params(), "num_params_stored": exp.num_stored_params(),
        "vocab_size": m.vocab_size, "padded_vocab_size": m.padded_vocab_size,
        "model": dataclasses.asdict(m),
        "tokens_per_step": exp.cfg.train.batch_size * m.seq_len,
        "flops_per_token": reporting.flops_per_token(m), "flops_convention": "llmc: 6N + 6LDT",
        "peak_flops_per_device": reporting.peak_flops(device),
        "compile_time_s": compile_s,
        "compiled_memory_per_device": compiled_memory,
        "data": exp.source.info,
        "pipeline": _pipeline_info(exp.model.pipeline),
        "versions": {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__},
    }


def _data_line(info: dict, vocab: int, windows: int) -> str:
    """What the run reads, and how far into it the run goes."""
    if "best_loss" in info:
        return (f"data: {info['kind']}, best possible loss {info['best_loss']:.4f} "
                f"(log vocab = {math.log(vocab):.4f})")
    what = info.get("name") or info.get("path")
    return (f"data: {info['kind']} {what} | tokenizer {info['tokenizer']} ({info['vocab_size']} ids, "
            f"log vocab = {math.log(vocab):.4f}) | train {info['train_tokens']:,} tokens, "
            f"eval {info['val_tokens']:,} | this run reads {windows / max(info['train_windows'], 1):.2f} "
            f"epochs{' of random-offset windows' if info.get('random_offsets') else ''}")


def _pipeline_info(pipe) -> dict | None:
    if pipe is None:
        return None
    return {"stages": pipe.stages, "microbatches": pipe.microbatches, "repeats": pipe.repeats,
            "ticks": pipe.ticks, "bubble": pipe.bubble}


def run(argv: list[str]) -> int:
    name, overrides, flags = config_lib.parse_args(argv)
    unknown = set(flags) - set(FLAGS)
    if unknown:
        raise UserError(f"Unknown flag(s) {', '.join('--' + f for f in sorted(unknown))}. The flags "
                        f"are --config=NAME, --config.key=value and --workdir=DIR.")
    cfg = config_lib.load(name)
    for key, value in overrides:
        config_lib.override(cfg, key, value)

    # The device count must be settled before JAX starts its backend.
    shape = mesh_lib.parse_shape(cfg.mesh.shape)
    _maybe_initialize_distributed()
    count, source = mesh_lib.simulate_cpu_devices(shape)
    mesh_lib.resolve_shape(shape, count, why=source)

    import jax

    from meshtrain import pipeline, reporting
    from meshtrain.experiment import Experiment
    from meshtrain.loop import train_loop

    exp = Experiment.build(cfg)
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    say(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} ({source}), "
        f"{jax.process_count()} process(es)")
    say(f"mesh: {mesh_lib.format_shape(exp.mesh.shape)} | layout {exp.layout.name}: {exp.layout.describe()}")
    say(f"model: {exp.num_params():,} parameters (closed form), vocab {exp.model.cfg.vocab_size} "
        f"padded to {exp.model.cfg.padded_vocab_size}")
    pipe = exp.model.pipeline
    if pipe is not None:
        say(f"pipeline: {pipe.stages} stages x {pipe.repeats} repeat(s), {pipe.microbatches} "
            f"microbatches, {pipe.ticks} ticks, bubble (S-1)/(r*M+S-1) = {pipe.bubble:.1%}")
    for warning in pipeline.warnings_for(pipe):
        print(f"meshtrain: warning: {warning}", file=sys.stderr)
    t0 = time.perf_counter()
    compiled = exp.compile()
    compile_s = time.perf_counter() - t0
    memory = reporting.memory_report(compiled)
    say(f"compiled train step in {compile_s:.1f}s; per device: "
        + ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in memory.items()))

    workdir = flags.get("workdir")
    m = exp.model.cfg
    tokens_per_step = cfg.train.batch_size * m.seq_len
    log = reporting.RunLog(workdir, cfg.train.steps, tokens_per_step,
                           reporting.flops_per_token(m) * tokens_per_step,
                           reporting.peak_flops(jax.devices()[0]), jax.device_count())
    log.write_run(_run_info(name, exp, memory, compile_s, source))
    if cfg.train.steps == 0:
        say(f"train.steps=0: compile-only check done{f'; wrote {workdir}/run.json' if workdir else ''}.")
        log.close()
        return 0
    say(_data_line(exp.source.info, m.vocab_size, cfg.train.steps * cfg.train.batch_size))
    try:
        train_loop(exp, compiled, log)
    finally:
        log.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(run, argv, "meshtrain")


if __name__ == "__main__":
    sys.exit(main())
