"""The training loop: batches in, metrics out, eval on a schedule.

The host reads metrics only at log steps, and after the next step has been
dispatched, so the device is never idle waiting for Python.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from meshtrain.experiment import Experiment
from meshtrain.reporting import RunLog


def evaluate(exp: Experiment, params) -> float:
    losses = [exp.eval_step(params, exp.put_batch(b)) for b in exp.eval_batches()]
    return float(np.mean(jax.device_get(losses)))


def train_loop(exp: Experiment, compiled_step, log: RunLog, state=None) -> list[dict]:
    """Runs cfg.train.steps steps; returns the logged rows. `compiled_step` is exp.compile()."""
    t = exp.cfg.train
    state = exp.init_state() if state is None else state
    start = int(jax.device_get(state.step))
    batches = exp.train_batches(start_step=start)
    rows, pending = [], None
    last_time, last_step = time.perf_counter(), start

    def flush():
        nonlocal pending, last_time, last_step
        step, metrics, now = pending
        rows.append(log.log_train(step, jax.device_get(metrics), (now - last_time) / (step - last_step)))
        last_time, last_step, pending = now, step, None

    for step in range(start + 1, t.steps + 1):
        state, metrics = compiled_step(state, exp.put_batch(next(batches)))
        if pending is not None:  # the previous log step: read now that this step is queued
            flush()
        if step % t.log_every == 0 or step == t.steps:
            jax.block_until_ready(metrics)
            pending = (step, metrics, time.perf_counter())
        if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
            if pending is not None:
                flush()
            log.log_eval(step, evaluate(exp, state.params))
            # Eval time is not training time: restart the clock for tokens/s and ETA.
            last_time, last_step = time.perf_counter(), step
    if pending is not None:
        flush()
    return rows
