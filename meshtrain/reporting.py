"""What a run writes: run.json, metrics.jsonl, TensorBoard events, and progress lines.

Only process 0 writes files. FLOPs follow the llm.c convention (6 N + 6 L D T per
token: causal attention, tied embedding counted once); MFU divides by the dense
bf16 peak of the device when it is known, and is null otherwise (e.g. on CPU).
"""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import time

import jax

from meshtrain.models import ModelConfig, family_of
from meshtrain.progress import format_duration

# Dense bf16 peak FLOP/s by device kind substring (vendor data sheets).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12,
              "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v4": 275e12}


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token as the model's family counts them (llm.c: 6 N + 6 L D T)."""
    return family_of(cfg).flops_per_token(cfg)


def flops_convention(cfg: ModelConfig) -> str:
    """How the family counts FLOPs: the first line of its flops_per_token docstring."""
    fn = family_of(cfg).flops_per_token
    doc = inspect.getdoc(fn)
    return doc.splitlines()[0] if doc else f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


def peak_flops(device: jax.Device) -> float | None:
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


def memory_report(compiled) -> dict:
    """Per-device bytes from the compiled step (see docs/benchmarks.md for caveats)."""
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    out = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    out["peak_estimate"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


class RunLog:
    """Writes the run's outputs under `workdir` (process 0 only) and prints progress."""

    def __init__(self, workdir: str | None, total_steps: int, tokens_per_step: int,
                 flops_per_step: float, peak_per_device: float | None, num_devices: int,
                 resume_step: int | None = None):
        """`resume_step`: the checkpoint this run continues from. Rows the earlier run
        logged after it are dropped (this run logs those steps again), so metrics.jsonl
        reads as one run; TensorBoard purges them the same way."""
        self.enabled = jax.process_index() == 0
        self.dir = pathlib.Path(workdir) if workdir else None
        self.total = total_steps
        self.tokens_per_step = tokens_per_step
        self.flops_per_step = flops_per_step
        self.peak = None if peak_per_device is None else peak_per_device * num_devices
        self.started = time.perf_counter()
        self.time_offset = 0.0  # a resumed run's clock goes on from its last kept row
        self.tb = None
        if self.enabled and self.dir:
            self.dir.mkdir(parents=True, exist_ok=True)
            from tensorboardX import SummaryWriter  # imported lazily: slow to import
            purge = None if resume_step is None else resume_step + 1
            self.tb = SummaryWriter(str(self.dir / "tb"), purge_step=purge)
        self.resume_step = resume_step
        self.metrics = None  # opened at the first row, so a compile-only run leaves it alone

    def write_run(self, info: dict) -> None:
        if self.enabled and self.dir:
            (self.dir / "run.json").write_text(json.dumps(info, indent=2, default=str) + "\n")

    def log_train(self, step: int, metrics: dict, step_time: float, skipped: int = 0) -> dict:
        """Records one logged step; `step_time` is the mean seconds per step since the last
        log; `skipped` counts the steps skipped for non-finite values so far."""
        tokens_per_s = self.tokens_per_step / step_time
        mfu = None if self.peak is None else self.flops_per_step / step_time / self.peak
        row = {"step": step, "loss": float(metrics["loss"]), "lr": float(metrics["lr"]),
               "grad_norm": float(metrics["grad_norm"]), "tokens_per_s": tokens_per_s,
               "step_time_s": step_time, "mfu": mfu, "skipped": skipped}
        self._write(row)
        remaining = (self.total - step) * step_time
        mfu_text = "" if mfu is None else f" | MFU {100 * mfu:.1f}%"
        self.say(f"step {step:>{len(str(self.total))}}/{self.total} ({100 * step / max(self.total, 1):3.0f}%)"
                 f" | loss {row['loss']:.4f} | lr {row['lr']:.2e} | grad_norm {row['grad_norm']:.3f}"
                 f" | {tokens_per_s:,.0f} tok/s | {1e3 * step_time:.1f} ms/step{mfu_text}"
                 f" | ETA {format_duration(remaining)}")
        return row

    def log_eval(self, step: int, eval_loss: float) -> None:
        self._write({"step": step, "eval_loss": eval_loss})
        self.say(f"eval  step {step} | eval_loss {eval_loss:.4f}")

    def _open_metrics(self):
        path = self.dir / "metrics.jsonl"
        if self.resume_step is not None and path.exists():
            keep_rows_up_to(path, self.resume_step)
            self.time_offset = last_time_s(path)
        elif path.exists():  # a fresh start in a used workdir: keep the old rows apart
            path.replace(path.with_name(f"metrics.{time.strftime('%Y%m%d-%H%M%S')}.jsonl"))
        return open(path, "a", buffering=1)

    def _write(self, row: dict) -> None:
        """Adds `time_s`: seconds since this RunLog was made (after the train step's
        compile), plus the last kept row's `time_s` when resuming, to the millisecond."""
        if self.metrics is None and self.enabled and self.dir:
            self.metrics = self._open_metrics()
        row["time_s"] = round(self.time_offset + time.perf_counter() - self.started, 3)
        if self.metrics is not None:
            self.metrics.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k not in ("step", "time_s") and v is not None:  # TensorBoard keeps its own wall time
                    self.tb.add_scalar(k, v, row["step"])

    def say(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.tb is not None:
            self.tb.close()


def keep_rows_up_to(path: pathlib.Path, step: int) -> None:
    """Rewrites a metrics.jsonl without the rows after `step` (atomically: a crash keeps the old file)."""
    rows = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(r + "\n" for r in rows))
    os.replace(tmp, path)


def last_time_s(path: pathlib.Path) -> float:
    """The `time_s` of the last row of a metrics.jsonl that has one (0.0 for none, as in
    runs logged before `time_s` existed)."""
    for line in reversed(path.read_text().splitlines()):
        if line.strip() and "time_s" in (row := json.loads(line)):
            return float(row["time_s"])
    return 0.0
