"""Train a config on its device mesh: checkpoints, eval and metrics in --workdir, a
summary at the end; rerunning the same command resumes.

    meshtrain train --config=gpt2_tiny_dp2_tp4 --workdir=runs/tiny [--config.key=value ...]
    python -m meshtrain.train ...   (the same)

`--config.train.steps=0` builds, shards and compiles the step, writes run.json
(with the compiled per-device memory) and exits: a compile-only check of a layout.
Bad input exits with status 2 and one paragraph on stderr, never a traceback.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import sys
import time

from meshtrain import cli, mesh as mesh_lib, xla_flags
from meshtrain.cluster import distributed, launch as launch_lib, shared_dir
from meshtrain.errors import UserError, warn
from meshtrain.run import watchdog as watchdog_lib


def parser() -> cli.Parser:
    p = cli.command_parser("meshtrain train", __doc__, config=True)
    p.add_argument("--workdir", metavar="DIR",
                   help="where run.json, metrics.jsonl, TensorBoard events and checkpoints go; "
                        "rerunning with the same DIR resumes (none: nothing is saved)")
    multi = p.add_argument_group("one of several processes (under srun: found, no flags needed)")
    multi.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (JAX_COORDINATOR_ADDRESS)")
    multi.add_argument("--num_processes", metavar="N", help="how many processes (JAX_NUM_PROCESSES)")
    multi.add_argument("--process_id", metavar="I", help="this one, 0..N-1 (JAX_PROCESS_ID)")
    return p


FLAGS = ("workdir", "coordinator", "num_processes", "process_id")


def execute(args, started: dict | None = None) -> int:
    """The command, phase by phase, each a function below in this order: join the
    processes, build the run and say what it is, open its checkpoints, compile, open the
    run log, train, summarise. `started["cluster"]` receives the joined processes, so
    `main` can tell the others how this process ended."""
    started_at = time.perf_counter()
    flags = {k: getattr(args, k) for k in FLAGS if getattr(args, k) is not None}
    workdir = flags.get("workdir")
    xla_line = xla_flags.apply(os.environ)  # before join() starts the backend, which reads XLA_FLAGS once
    launch, cluster, source = join(args.config, flags, started)

    from meshtrain.cluster.preemption import Preemption
    from meshtrain.run import memory_check

    preemption = Preemption()  # from here on, SIGTERM and Ctrl-C save at the next step
    try:
        with contextlib.ExitStack() as stack:  # what a phase opens, closed in reverse whatever happens
            exp, node, say = build(args.config, workdir, launch, cluster, source, xla_line)
            cfg = exp.cfg
            checkpointer, resume_step, saved_run = open_checkpoints(cfg, exp, workdir, cluster, stack, say)
            end = cfg.train.stop_at or cfg.train.steps
            if resume_step is not None and resume_step >= end:
                say(f"checkpoint step {resume_step} is already at train.stop_at/train.steps ({end}): nothing to train.")
                return 0
            compiled, memory, compile_s = compile_step(exp, say)
            # Before init_state or a restore allocates: a step that cannot fit stops here, with fixes.
            memory_check.check(exp, memory, say, skip=cfg.train.skip_memory_check, compile_only=not cfg.train.steps)
            log, clock = open_log(exp, workdir, resume_step, compile_s, started_at, stack)
            info = run_json(args.config_name, exp, memory, compile_s, source, launch, cluster, compiled, node, say)
            info["checkpoint"] = {"dir": None if checkpointer is None else str(checkpointer.dir),
                                  "resumed_from_step": resume_step, "saved_by": saved_run}
            log.write_run(info)
            save_tokenizer(exp, workdir)
            if not cfg.train.steps:
                say(f"train.steps=0: compile-only check done{f'; wrote {workdir}/run.json' if workdir else ''}.")
                return 0
            saved = train(exp, compiled, log, clock, checkpointer, resume_step, saved_run, cluster, preemption,
                          stack, say)
            summarise(args, exp, log, clock, saved, workdir, started_at, say)
        return 0
    except Exception as e:
        if not isinstance(e, UserError):
            cluster.settle()  # a collective's error may be a lost peer's: that is named instead
        raise
    finally:
        preemption.close()


def join(cfg, flags: dict, started: dict | None):
    """Who we are and how many, before JAX starts its backend (which fixes the device
    count): -> (launch, cluster, where the devices come from)."""
    shape = mesh_lib.parse_shape(cfg.mesh.shape)
    launch = launch_lib.detect(flags, os.environ)
    cluster = distributed.start(launch, cfg, flags)
    if started is not None:
        started["cluster"] = cluster
    count, source = mesh_lib.simulate_cpu_devices(shape, launch.num_processes)
    mesh_lib.resolve_shape(shape, count, why=source)
    return launch, cluster, source


def build(cfg, workdir: str | None, launch, cluster, source: str, xla_line: str):
    """The experiment (train.accum_gather="auto" decided against this run's devices before
    its step is built), the start-up report, and the checks before anything is locked:
    -> (experiment, device id -> node, say)."""
    import jax

    from meshtrain.checkpoints import store as checkpoint_lib
    from meshtrain.planner import accumulation
    from meshtrain.run import memory_check
    from meshtrain.run.experiment import Experiment
    exp = Experiment.build(cfg, choose_gather=accumulation.choose)
    cfg = exp.cfg  # resolved: init.from's model and tokenizer filled in
    memory_check.check_config(cfg.train)
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    if xla_line:
        say(xla_line)
    node = describe(exp, launch, cluster, source, say)
    if cfg.train.grad_accum_steps > 1:
        say(accumulation.line(exp))
    lint_warnings(exp)
    if cfg.train.profile and not workdir and cfg.train.steps:
        raise UserError(f"train.profile={cfg.train.profile!r} writes its trace to WORKDIR/profile: "
                        f"give --workdir=DIR, or leave train.profile empty.")
    if cfg.train.steps:  # every process writes its part of each checkpoint into one directory
        shared_dir.check(checkpoint_lib.checkpoint_dir(cfg, workdir), cluster, cfg.distributed.init_timeout)
    return exp, node, say


def describe(exp, launch, cluster, source: str, say) -> dict[int, int]:
    """The start-up lines: devices, processes, mesh and layout, nodes, model, pipeline, how
    the gradients meet where a key changed it (Experiment.gradients_line), and host offload.
    -> device id -> node, for the collectives report."""
    import jax

    from meshtrain import models  # here: flax, which `--help` never needs
    from meshtrain.parallel import offload, sequence
    from meshtrain.parallel.pipeline import ticks as pipeline_ticks

    say(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} ({source})")
    if launch.multiprocess:
        for line in cluster.describe():
            say(line)
    say(f"mesh: {mesh_lib.format_shape(exp.mesh.shape)} | layout {exp.layout.name}: {exp.layout.describe()}")
    node, nodes = mesh_lib.nodes_of(jax.devices(), exp.dcn, cluster.hosts)
    _say_nodes(exp.dcn, nodes, cluster.hosts, say)
    m = exp.model.cfg
    say(f"model: {exp.model.family.describe(m)} | {exp.num_params():,} parameters (closed form), "
        f"vocab {m.vocab_size} padded to {m.padded_vocab_size}")
    impl, why = models.attention_choice(exp.cfg.model.attention, m)
    n, axes = sequence.split(exp.layout, exp.mesh.shape)
    if n > 1:  # the kernels run whole sequences; a split one is attended in XLA blocks
        say(f"attention: context parallelism, {m.context_attention} over {'+'.join(axes)}={n}, "
            f"positions in zigzag order (each device an early and a late chunk of {m.seq_len // (2 * n)}); "
            f"XLA blocks on each device (model.attention={impl} applies to whole sequences)")
    else:
        say(f"attention: {impl} ({why})")
    pipe = exp.model.pipeline
    if pipe is not None:
        say(f"pipeline: {pipeline_ticks.describe(pipe)}")
    gradients = exp.gradients_line()
    if gradients:
        say(gradients)
    if exp.offload:
        say(exp.offload.describe(offload.streams(exp.offload, exp.model)))
    return node


def _say_nodes(dcn, nodes: str, hosts: list[str], say) -> None:
    """How the mesh meets the nodes (`nodes`: how they were found), and a warning when several
    hosts have no mesh.dcn (tensor across nodes is the linter's tensor-on-dcn, see lint_warnings)."""
    if dcn:
        say(f"dcn: {mesh_lib.format_factors(dcn)} across nodes ({nodes}); the rest of each axis stays "
            f"inside a node")
    if dcn is None and len(set(hosts)) > 1:
        warn(f"the run spans {len(set(hosts))} hosts but mesh.dcn is empty, so any axis may "
             f"cross the slow links between them. Set mesh.dcn, e.g. --config.mesh.dcn="
             f"data:{len(set(hosts))}, to keep tensor parallelism inside a node.")


def lint_warnings(exp) -> None:
    """The layout linter's warnings (meshtrain/planner/lint.py), once each; they include what
    pipeline.warnings_for and mesh.dcn_warnings say, which are therefore not printed too.
    Its errors were already raised by validation."""
    from meshtrain.planner import lint
    for finding in lint.lint(exp.cfg, dict(exp.mesh.shape), exp.dcn, exp.model):
        if finding.severity == "warning":
            warn(str(finding))


def open_checkpoints(cfg, exp, workdir: str | None, cluster, stack: contextlib.ExitStack, say):
    """The directories locked and the checkpoints opened, their closing on `stack`:
    -> (Checkpointer or None, step to resume from or None, meta["run"] of that checkpoint)."""
    import jax

    from meshtrain.checkpoints import disk_space, steps as steps_lib, store as checkpoint_lib
    from meshtrain.checkpoints.lock import DirectoryLock
    ckpt_dir = checkpoint_lib.checkpoint_dir(cfg, workdir)
    if jax.process_index() == 0:  # process 0 locks the workdir, and the checkpoint dir when it lies elsewhere
        if workdir:
            stack.callback(DirectoryLock(workdir, "workdir").release)
        if ckpt_dir and not (workdir and os.path.abspath(ckpt_dir).startswith(os.path.abspath(workdir) + os.sep)):
            stack.callback(DirectoryLock(ckpt_dir, "checkpoint directory").release)
    c = cfg.checkpoint
    if ckpt_dir is None or cfg.train.steps == 0:
        if cfg.train.steps:
            say("checkpoints: off (give --workdir or checkpoint.dir to save and resume)")
        return None, None, None
    checkpointer = checkpoint_lib.Checkpointer(ckpt_dir, every=c.every, keep=c.keep, use_async=c["async"],
                                               every_minutes=c.every_minutes)
    stack.callback(checkpointer.close)  # waits for the last save; a failed one raises RunFailed
    cluster.set_note(functools.partial(checkpoint_lib.safe_on_disk, checkpointer.dir))
    every = [f"every {c.every} steps"] if c.every else []
    every += [f"every {c.every_minutes:g} min"] if c.every_minutes else []
    say(f"checkpoints: {checkpointer.dir}, {', '.join(every + ['at the end'])} and on "
        f"SIGTERM or Ctrl-C, keep "
        f"{c.keep or 'all'}, {'async' if c['async'] else 'sync'}")
    step = checkpointer.latest_step()
    saved = None if step is None else checkpointer.check_fits(step, exp).get("run", {})
    disk_space.check(checkpointer.dir, exp, c, present=len(steps_lib.committed_steps(checkpointer.dir)),
                     start=step or 0, end=cfg.train.stop_at or cfg.train.steps, say=say)
    if step is None:
        return checkpointer, None, None
    by = f" by {saved['processes']} processes" if saved.get("processes", 1) > 1 else ""
    say(f"resuming from step {step} ({checkpointer.where(step)}, saved{by} under layout "
        f"{saved.get('layout')!r} on mesh {saved.get('mesh')})")
    for key in ("steps", "batch_size"):
        if key in saved and saved[key] != cfg.train[key]:
            warn(f"train.{key} is {cfg.train[key]}, the checkpoint's run had {saved[key]}"
                 + (": the lr schedule now spans the new length." if key == "steps" else "."))
    return checkpointer, step, saved


def compile_step(exp, say):
    """AOT-compiles the train step: -> (compiled, per-device memory, seconds). A compile-only
    check (train.steps=0) runs nothing, so on CPU it compiles as `meshtrain plan` does
    (Experiment.compile(analysis=True): 2-4x faster, the memory figures the planner reads)."""
    from meshtrain.runlog import metrics
    t0 = time.perf_counter()
    compiled = exp.compile(analysis=not exp.cfg.train.steps)
    compile_s = time.perf_counter() - t0
    memory = metrics.memory_report(compiled)
    say(f"compiled train step in {compile_s:.1f}s; per device: "
        + ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in memory.items()))
    return compiled, memory, compile_s


def open_log(exp, workdir: str | None, resume_step: int | None, compile_s: float, started_at: float,
             stack: contextlib.ExitStack):
    """The run log (closed on `stack`) and its goodput clock, the compile counted: -> (log, clock)."""
    import jax

    from meshtrain.runlog import goodput, metrics
    cfg, units = exp.cfg, exp.units_per_step  # tokens, or images (exp.task.unit)
    log = metrics.RunLog(workdir, cfg.train.steps, units, metrics.flops_per_unit(exp.model.cfg) * units,
                         metrics.peak_flops(jax.devices()[0]), jax.device_count(),
                         resume_step=resume_step, trackers=cfg.train.trackers, unit=exp.task.unit,
                         task_metrics=exp.task.eval_metrics, model_metrics=exp.model.family.metrics)
    stack.callback(log.close)
    called = time.time() - (time.perf_counter() - started_at)  # when execute began
    clock = goodput.Clock(workdir if log.enabled and cfg.train.steps else None, goodput.piece_start(called))
    clock.add("compile", compile_s)
    return log, clock


def run_json(config_name, exp, memory: dict, compile_s: float, source: str, launch, cluster, compiled,
             node: dict[int, int], say) -> dict:
    """run.json but its checkpoint entry (metrics.run_info), with the processes and, across
    nodes or processes, the collectives by mesh axes (said too)."""
    from meshtrain.runlog import metrics
    info = metrics.run_info(config_name, exp, memory, compile_s, source)
    info["distributed"] = cluster.info()
    if exp.dcn or launch.multiprocess:
        info["collectives_by_axes"] = _traffic(compiled, exp.mesh, node, say)
    return info


def _traffic(compiled, mesh, node: dict[int, int], say) -> dict:
    """Says which collectives cross nodes (`node`: device id -> node); returns them for run.json."""
    from meshtrain.planner import hlo
    traffic = hlo.collectives_by_axes(compiled, mesh, lambda d: node[d.id])
    parts = []
    for axes, entry in traffic.items():
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(entry["count"].items()))
        where = "inside nodes" if entry["nodes"] == 1 else f"across {entry['nodes']} nodes"
        parts.append(f"{'+'.join(axes) or 'no axis'}: {kinds} ({where})")
    say("collectives per step by mesh axis: " + " | ".join(parts))
    return {"+".join(axes): {"count": dict(e["count"]), "nodes": e["nodes"]} for axes, e in traffic.items()}


def save_tokenizer(exp, workdir: str | None) -> None:
    """WORKDIR/tokenizer.json: what meshtrain.sample and exports read, so they need neither
    the corpus nor the network (process 0; synthetic data has no tokenizer)."""
    import jax
    tokenizer = getattr(exp.source, "tokenizer", None)
    if workdir and tokenizer is not None and jax.process_index() == 0:
        tokenizer.save(os.path.join(workdir, "tokenizer.json"))


def train(exp, compiled, log, clock, checkpointer, resume_step: int | None, saved_run: dict | None, cluster,
          preemption, stack: contextlib.ExitStack, say):
    """What the run will do, said; the state restored; the loop, watched; the last save
    waited for: -> where the last checkpoint is, or None."""
    from meshtrain.checkpoints import init_from, store as checkpoint_lib
    from meshtrain.run.loop import train_loop
    from meshtrain.runlog import metrics
    from meshtrain.step import optim
    cfg = exp.cfg
    say(metrics.data_line(exp.source.info, exp.model.cfg.vocab_size, cfg.train.steps * cfg.train.batch_size,
                          cfg.data.packing))
    lr_line, lr_warnings = optim.describe(cfg.optim, cfg.train.steps, cfg.train.stop_at,
                                          batch_size=cfg.train.batch_size)
    say(lr_line)
    for w in lr_warnings:
        warn(w)
    if resume_step is None and exp.init is not None:
        say(f"init.from: {exp.init.source} ({exp.init.step_dir}): step 0, fresh optimizer")
    state, meta = checkpointer.restore(resume_step, exp) if resume_step is not None else (None, None)
    watchdog = watchdog_lib.Watchdog.for_run(cfg.train, cluster.liveness, cluster.table)
    stack.callback(watchdog.stop)
    if checkpointer is not None:  # for a hang report: what a rerun resumes from
        watchdog.note = functools.partial(checkpoint_lib.safe_on_disk, checkpointer.dir)
    watchdog.on_fire = clock.hung
    train_loop(exp, compiled, log, state, checkpointer=checkpointer, resume_meta=meta,
               run_summary=init_from.run_summary(exp, resumed=saved_run),
               preemption=preemption, clock=clock, watchdog=watchdog.start(resume_step or 0))
    watchdog.stop()  # before the wait for the last save, which is no step
    log.update_run(stragglers=watchdog.stragglers())
    if checkpointer is None:
        return None
    with clock.time("checkpoint"):
        checkpointer.wait()  # the last save committed before the summary names it
    last = checkpointer.latest_step()
    return None if last is None else checkpointer.where(last)


def summarise(args, exp, log, clock, saved, workdir: str | None, started_at: float, say) -> None:
    """The summary lines, and run.json's and the trackers' last entries."""
    import jax

    from meshtrain.runlog import goodput, metrics
    info = exp.source.info
    wall_s = time.perf_counter() - started_at
    clock.save()
    for line in metrics.summary(log, best_loss=info.get("best_loss"), vocab=exp.model.cfg.vocab_size,
                                best_accuracy=info.get("best_accuracy"), wall_s=wall_s, checkpoint=saved,
                                workdir=workdir, command=f"{args.prog} {shlex.join(args.argv)}",
                                processes=jax.process_count(), goodput=goodput.line(clock.total())):
        say(line)
    log.finish({**metrics.final_summary(log, wall_s=wall_s, checkpoint=saved),
                "goodput": {"this_run": clock.save(), "all_pieces": clock.total()}})


def run(argv: list[str], started: dict | None = None) -> int:
    """The command on `argv`; bad input raises UserError (`main` prints it)."""
    return cli.run(lambda a: execute(a, started), parser(), argv)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Runs the command. One of several processes tells the others how it ended, so a
    failure on one stops them all, and leaves at once: waiting in JAX's shutdown barrier
    for processes that will not come would only delay the exit."""
    started: dict = {}
    ended: dict = {}
    try:
        status = cli.main(lambda a: execute(a, started), parser(), argv, prog, ended)
    except BaseException as e:  # a bug, or Ctrl-C: still tell the others before going
        cluster = started.get("cluster")
        if cluster is None or not cluster.launch.multiprocess:
            raise
        import traceback
        traceback.print_exc()
        cluster.leave(1, f"{type(e).__name__}: {e}")
        _exit_now(1)
    cluster = started.get("cluster")
    if cluster is not None and cluster.launch.multiprocess:
        cluster.leave(status, ended.get("message", ""))
        if status != 0:
            _exit_now(status)
    return status


def _exit_now(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
