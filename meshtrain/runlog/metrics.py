"""What a run writes: run.json, progress lines, and its rows to the trackers
(metrics.jsonl, TensorBoard events, W&B: meshtrain/runlog/trackers.py).

Only process 0 writes files. FLOPs follow the llm.c convention (6 N + 6 L D T per
token: causal attention, tied embedding counted once); MFU divides by the dense
bf16 peak of the device when it is known, and is null otherwise (e.g. on CPU).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import pathlib
import time

import jax

from meshtrain.errors import warn
from meshtrain.models import ModelConfig, family_of
from meshtrain.progress import format_duration
from meshtrain.runlog import trackers as trackers_lib
from meshtrain.step import tasks

# Dense bf16 peak FLOP/s by device kind substring (vendor data sheets).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12,
              "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v4": 275e12}


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token as the model's family counts them (llm.c: 6 N + 6 L D T)."""
    return family_of(cfg).flops_per_token(cfg)


def flops_per_unit(cfg: ModelConfig) -> float:
    """Training FLOPs per throughput unit of the family's task: per token for a language
    model, per image for a classifier (tasks/: the task names the family's function)."""
    return _flops_fn(cfg)(cfg)


def flops_convention(cfg: ModelConfig) -> str:
    """How the family counts FLOPs: the first line of its FLOPs function's docstring."""
    fn = _flops_fn(cfg)
    doc = inspect.getdoc(fn)
    return doc.splitlines()[0] if doc else f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


def _flops_fn(cfg: ModelConfig):
    fam = family_of(cfg)
    return tasks.kind(fam.task).flops(fam)


def peak_flops(device: jax.Device) -> float | None:
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


def memory_report(compiled) -> dict:
    """Per-device bytes of the compiled step in device memory (argument, output, temp,
    alias, peak_estimate) and in host memory ("host": the state train.offload keeps
    there, read from the step's input shardings). See docs/benchmarks.md for caveats."""
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    out = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    host = host_argument_bytes(compiled)
    if host and not ma.host_argument_size_in_bytes:
        # The CPU has one memory and reports host arguments as device ones; the step takes
        # them donated and returns them in host memory too, aliased (parallel/offload.py).
        out = {k: v - (host if k != "temp" else 0) for k, v in out.items()}
    out["peak_estimate"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    out["host"] = host
    return out


def host_argument_bytes(compiled) -> int:
    """Per-device bytes of the compiled step's arguments that live in host memory."""
    return sum(math.prod(sh.shard_shape(a.shape)) * a.dtype.itemsize
               for a, sh in zip(jax.tree.leaves(compiled.args_info), jax.tree.leaves(compiled.input_shardings))
               if sh.memory_kind == "pinned_host")


def run_info(name, exp, compiled_memory, compile_s, simulated: str) -> dict:
    """run.json (docs/architecture.md, "Outputs"): the resolved config, mesh, devices, model,
    memory, data and versions of a built Experiment `exp`."""
    import flax
    import optax

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
        "model": {"family": exp.model.family.name, **dataclasses.asdict(m)},
        "task": exp.task.name,
        f"{exp.task.unit}_per_step": exp.units_per_step,
        f"flops_per_{exp.task.unit[:-1]}": flops_per_unit(m), "flops_convention": flops_convention(m),
        "peak_flops_per_device": peak_flops(device),
        "compile_time_s": compile_s,
        "compiled_memory_per_device": compiled_memory,
        "data": exp.source.info,
        "pipeline": pipeline_info(exp.model.pipeline),
        "versions": {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__},
    }


def data_line(info: dict, vocab: int, windows: int, packing: str = "concat") -> str:
    """What the run reads, and how far into it the run goes (`windows`: the examples it
    reads), and how its windows are packed (data.packing)."""
    if "best_accuracy" in info:
        return (f"data: {info['kind']} images, {vocab} classes, best possible accuracy "
                f"{100 * info['best_accuracy']:.2f}%")
    if "train_examples" in info:
        what = info.get("name") or info.get("path")
        return (f"data: {info['kind']} {what} | {vocab} classes | train {info['train_examples']:,} images, "
                f"eval {info.get('eval_examples', 0):,} | this run reads "
                f"{windows / max(info['train_examples'], 1):.2f} epochs")
    if "best_loss" in info:
        return (f"data: {info['kind']}, best possible loss {info['best_loss']:.4f} "
                f"(log vocab = {math.log(vocab):.4f})")
    what = info.get("name") or info.get("path")
    return (f"data: {info['kind']} {what} | tokenizer {info['tokenizer']} ({info['vocab_size']} ids, "
            f"log vocab = {math.log(vocab):.4f}) | train {info['train_tokens']:,} tokens, "
            f"eval {info['val_tokens']:,} | this run reads {windows / max(info['train_windows'], 1):.2f} "
            f"epochs{' of random-offset windows' if info.get('random_offsets') else ''}"
            f"{' | documents kept apart at end-of-text id ' + str(info['eot_id']) if packing == 'documents' else ''}")


def pipeline_info(pipe) -> dict | None:
    if pipe is None:
        return None
    return {"stages": pipe.stages, "microbatches": pipe.microbatches, "repeats": pipe.repeats,
            "ticks": pipe.ticks, "bubble": pipe.bubble}


class RunLog:
    """Writes the run's outputs under `workdir` (process 0 only) and prints progress."""

    def __init__(self, workdir: str | None, total_steps: int, tokens_per_step: int,
                 flops_per_step: float, peak_per_device: float | None, num_devices: int,
                 resume_step: int | None = None, trackers: str = "tensorboard,jsonl", unit: str = "tokens",
                 task_metrics: tuple[str, ...] = (), model_metrics: tuple[str, ...] = ()):
        """`tokens_per_step`: throughput units per step, `unit` names them (the task's:
        tokens, images); rows carry `<unit>_per_s` and the step's `task_metrics` (the
        task's eval_metrics, a classifier's top1 and top5, shown as percentages) and
        `model_metrics` (the family's statistics, a router's losses). `resume_step`: the checkpoint this run continues from. Rows the earlier run
        logged after it are dropped (this run logs those steps again), so metrics.jsonl
        reads as one run; TensorBoard purges them the same way. `trackers`: train.trackers,
        where the rows go besides the progress lines (meshtrain/runlog/trackers.py)."""
        self.enabled = jax.process_index() == 0
        self.dir = pathlib.Path(workdir) if workdir else None
        self.total = total_steps
        self.tokens_per_step = tokens_per_step
        self.unit, self.task_metrics, self.model_metrics = unit, task_metrics, model_metrics
        self.flops_per_step = flops_per_step
        self.peak = None if peak_per_device is None else peak_per_device * num_devices
        self.started = time.perf_counter()
        self.time_offset = 0.0  # a resumed run's clock goes on from its last kept row
        made = []
        if self.enabled and self.dir:
            self.dir.mkdir(parents=True, exist_ok=True)
            if resume_step is None and total_steps:
                self._start_over()
            made = trackers_lib.make(trackers_lib.parse(trackers), self.dir, resume_step)
        elif self.enabled and "wandb" in trackers_lib.parse(trackers):
            warn("train.trackers names wandb, but without --workdir there is nowhere to keep its "
                 "run id and files; this run is not tracked. Give --workdir=DIR to track it.")
        self.trackers = trackers_lib.Trackers(made)
        self.resume_step = resume_step
        self.opened = False  # trackers open at the first row, so a compile-only run leaves them alone
        self.info: dict | None = None  # run.json, rewritten with the summary by finish()
        # For the summary: the last rows, and how the loop ended (`ended`).
        self.last_train: dict | None = None
        self.last_eval: dict | None = None
        self.end_step: int | None = None
        self.preempted: str | None = None

    def _start_over(self) -> None:
        """A fresh start in a workdir an earlier run logged to (no checkpoint to resume):
        its rows move aside, so metrics.jsonl and goodput.jsonl hold one run, and it says so."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        moved = []
        for name in ("metrics.jsonl", "goodput.jsonl"):
            path = self.dir / name
            if path.exists():
                path.replace(path.with_name(f"{path.stem}.{stamp}.jsonl"))
                moved.append(f"{name} -> {path.stem}.{stamp}.jsonl")
        if moved:
            self.say(f"starting over at step 0: {self.dir} holds an earlier run's logs but no "
                     f"checkpoint to resume; kept as {', '.join(moved)}")

    def ended(self, step: int, preempted: str | None) -> None:
        """The training loop's last step, and what stopped it there early ("SIGTERM",
        "Ctrl-C"; None when nothing did)."""
        self.end_step, self.preempted = step, preempted or None

    def write_run(self, info: dict) -> None:
        """Writes run.json (after compiling) and hands it to the trackers."""
        self.info = info
        self._save_info()
        if self.enabled and self.dir:
            self.trackers.start(info)

    def update_run(self, **fields) -> None:
        """Adds `fields` to run.json, with what is known only at the end (stragglers)."""
        if self.info is not None:
            self.info.update(fields)
            self._save_info()

    def finish(self, summary: dict) -> None:
        """Adds `summary` (how the run ended: losses, tokens, wall time, goodput) to
        run.json's "summary" and hands it to the trackers; callable more than once, each
        adding keys."""
        if self.info is not None:
            self.info["summary"] = {**self.info.get("summary", {}), **summary}
            self._save_info()
        self.trackers.finish(summary)

    def _save_info(self) -> None:
        if self.enabled and self.dir and self.info is not None:
            tmp = self.dir / "run.json.tmp"  # a crash mid-write keeps the old file
            tmp.write_text(json.dumps(self.info, indent=2, default=str) + "\n")
            os.replace(tmp, self.dir / "run.json")

    def log_train(self, step: int, metrics: dict, step_time: float, skipped: int = 0) -> dict:
        """Records one logged step; `step_time` is the mean seconds per step since the last
        log; `skipped` counts the steps skipped for non-finite values so far."""
        per_s = self.tokens_per_step / step_time
        mfu = None if self.peak is None else self.flops_per_step / step_time / self.peak
        extra = {k: float(metrics[k]) for k in self.task_metrics + self.model_metrics}
        row = {"step": step, "loss": float(metrics["loss"]), **extra, "lr": float(metrics["lr"]),
               "grad_norm": float(metrics["grad_norm"]), f"{self.unit}_per_s": per_s,
               "step_time_s": step_time, "mfu": mfu, "skipped": skipped}
        self._write(row)
        self.last_train = row
        remaining = (self.total - step) * step_time
        mfu_text = "" if mfu is None else f" | MFU {100 * mfu:.1f}%"
        extra_text = "".join(f" | {k} {100 * v:.1f}%" for k, v in extra.items() if k in self.task_metrics)
        groups: dict[str, list[str]] = {}  # the model's statistics by prefix: "moe lb 2.001 z 1.95 ..."
        for k in self.model_metrics:
            head, _, tail = k.partition("_")
            groups.setdefault(head, []).append(f"{tail} {extra[k]:.4g}")
        extra_text += "".join(f" | {head} {' '.join(items)}" for head, items in groups.items())
        short = {"tokens": "tok", "images": "img"}.get(self.unit, self.unit)
        self.say(f"step {step:>{len(str(self.total))}}/{self.total} ({100 * step / max(self.total, 1):3.0f}%)"
                 f" | loss {row['loss']:.4f}{extra_text} | lr {row['lr']:.2e} | grad_norm {row['grad_norm']:.3f}"
                 f" | {per_s:,.0f} {short}/s | {1e3 * step_time:.1f} ms/step{mfu_text}"
                 f" | ETA {format_duration(remaining)}")
        return row

    def log_eval(self, step: int, eval_loss: float, metrics: dict | None = None) -> None:
        """An eval row: `eval_loss` and the task's eval metrics (`metrics`, e.g. top1 and
        top5, written as eval_top1, eval_top5)."""
        extra = {f"eval_{k}": float(v) for k, v in (metrics or {}).items() if k not in ("loss", "count")}
        self.last_eval = {"step": step, "eval_loss": eval_loss, **extra}
        if metrics and "count" in metrics:  # the examples a finite split's eval scored
            self.last_eval["eval_examples"] = int(metrics["count"])
        self._write(dict(self.last_eval))
        self.say(f"eval  step {step} | eval_loss {eval_loss:.4f}"
                 + "".join(f" | {k} {100 * v:.2f}%" if k[len("eval_"):] in self.task_metrics else f" | {k} {v:.4g}"
                           for k, v in extra.items()))

    def _write(self, row: dict) -> None:
        """Adds `time_s`: seconds since this RunLog was made (after the train step's
        compile), plus the last kept row's `time_s` when resuming, to the millisecond."""
        if not self.opened:
            self.opened = True
            self.time_offset = self.trackers.open()
        row["time_s"] = round(self.time_offset + time.perf_counter() - self.started, 3)
        self.trackers.log(row)

    def say(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def close(self) -> None:
        self.trackers.close()


def this_run(log: RunLog) -> tuple[int, int, int]:
    """(first step, last step, units: tokens or images) this run trained, resumed or not."""
    end = log.end_step if log.end_step is not None else (log.resume_step or 0)
    first = (log.resume_step or 0) + 1
    return first, end, (end - first + 1) * log.tokens_per_step


def final_summary(log: RunLog, *, wall_s: float, checkpoint: str | None) -> dict:
    """run.json's "summary" (and the trackers'): how far the run got, its last losses, the
    tokens and wall time of this run (RunLog.finish adds what others report)."""
    first, end, tokens = this_run(log)
    out = {"end_step": end, "steps": log.total, "preempted": log.preempted,
           "first_step_this_run": first, f"{log.unit}_this_run": tokens, "wall_s": round(wall_s, 3),
           "checkpoint": checkpoint}
    if log.last_train:
        out.update(train_loss=log.last_train["loss"], train_loss_step=log.last_train["step"])
    if log.last_eval:
        out.update({k: v for k, v in log.last_eval.items() if k.startswith("eval_")},
                   eval_loss_step=log.last_eval["step"])
    return out


def summary(log: RunLog, *, best_loss: float | None, vocab: int, wall_s: float, checkpoint: str | None,
            workdir: str | None, command: str, processes: int = 1, goodput: str | None = None,
            best_accuracy: float | None = None) -> list[str]:
    """The lines a run ends with: how far it got and how long it took, its last losses
    beside the data's best possible loss, what it left on disk, and what to run next.
    `command` reruns this process; a run of several processes is resumed by whatever
    started them (launch/local.sh, sbatch), which this process does not know."""
    steps = log.total
    first, end, tokens = this_run(log)
    how = {"SIGTERM": "preempted (SIGTERM) at", "Ctrl-C": "interrupted (Ctrl-C) at"}.get(
        log.preempted or "", "stopped at" if end < steps else "trained to")
    lines = [f"done: {how} step {end} of {steps}; this run: steps {first}-{end}, {tokens:,} {log.unit} "
             f"in {format_duration(wall_s)}"]
    losses = []
    if log.last_train:
        losses.append(f"train loss {log.last_train['loss']:.4f} (step {log.last_train['step']})")
    if log.last_eval:
        top1 = log.last_eval.get("eval_top1")
        losses.append(f"eval_loss {log.last_eval['eval_loss']:.4f}"
                      + ("" if top1 is None else f", top-1 {100 * top1:.2f}%") + f" (step {log.last_eval['step']})")
    if best_accuracy is not None:
        floor = f"best possible top-1 {100 * best_accuracy:.2f}% (the synthetic images' Bayes accuracy)"
    elif best_loss is not None:
        floor = f"best possible {best_loss:.4f} (the data's entropy rate)"
    else:
        floor = f"best possible unknown for this data; uniform guessing scores ln {vocab} = {math.log(vocab):.4f}"
    lines.append("  " + " | ".join(losses + [floor]))
    if goodput:
        lines.append(f"  {goodput}")
    if checkpoint:
        lines.append(f"  checkpoint: {checkpoint}")
    elif workdir:
        lines.append("  no checkpoint saved")
    else:
        lines.append("  nothing saved: give --workdir=DIR to keep checkpoints, metrics and the tokenizer")
    if workdir and checkpoint:
        if end < steps:
            lines.append(f"  resume: {command}" if processes == 1 else
                         f"  resume: rerun the command that started the {processes} processes "
                         f"(launch/local.sh, sbatch, srun) as it was")
        else:
            lines.append(f"  next: meshtrain eval --workdir={workdir}" if log.unit != "tokens" else
                         f"  next: meshtrain sample --workdir={workdir} | meshtrain eval --workdir={workdir} | "
                         f"meshtrain convert to_hf --workdir={workdir} --out=DIR")
    return lines
