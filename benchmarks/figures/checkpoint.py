"""Reproduces docs/benchmarks.md, "Checkpoint save blocking time".

How long a training step is held up by an async checkpoint save vs a sync one.

    python benchmarks/figures/checkpoint.py [--config gpt2_small_dp8] [--repeats 3]
                                    [--batch_size 2] [--seq_len 128] [--dir DIR]
    python benchmarks/figures/checkpoint.py --quick      # gpt2_tiny_dp8, one repeat: a smoke test

Builds the config's full training state (gpt2_small: 124M params + two Adam moments,
float32, about 1.4 GiB) on one CPU device (mesh data:1); only batch_size and seq_len
are cut down so a step takes a second or two on a small CPU: the state, which is what a
checkpoint writes, keeps its real size. Then, per repeat and for each mode, async
(Orbax writes in background threads) and sync, alternated in one process, into a
fresh temporary directory each time:

    save() blocks   wall time of `Checkpointer.save` with the step's state already
                    computed (block_until_ready first, so step compute is not counted):
                    what the training loop waits before it can dispatch the next step
    commit          save() + wait(), with nothing else running: when the step is on disk
    step            a train step with no save in flight, then the step right after a
                    save() (for async the write runs behind it and competes for the cores;
                    for sync the save is over, so this is a control)
    lost per save   save() blocks + (step after save - step): training time one save costs

Every figure is the median over --repeats. The page cache is flushed (os.sync) before
each timed phase: in a real run the previous save is long on disk by the next one.

The training loop (meshtrain/run/loop.py) has the same pattern: `checkpointer.save(step,
state, meta)` on the state a step returned, then the next step, which donates that state.
The "donated" column says whether that next step could reuse the saved state's buffers.
On CPU Orbax's "copy off the device" is `np.asarray`, a view of the buffer rather than a
copy; while the background write holds such views the next step silently does not
donate, so it allocates a second state (the saved values stay intact). A control step
with such views held and no save running separates that cost from the write's
competition for the cores. Timings on a shared CPU are noisy; compare rows of one run.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODES = (("async", True), ("sync", False))
QUICK = dict(config="gpt2_tiny_dp8", repeats=1, batch_size=8, seq_len=64)
FULL = dict(config="gpt2_small_dp8", repeats=3, batch_size=2, seq_len=128)


def tree_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def settle() -> None:
    """Flushes what earlier saves left in the page cache. Otherwise the kernel writes it back
    during the next timed phase, or throttles the next save once dirty pages pass its limit;
    a real run saves every thousand steps or so and never meets its previous save's pages."""
    if hasattr(os, "sync"):
        os.sync()


def quiet_explicit_waits() -> None:
    """Orbax adds the time spent in an explicit wait() to its "Waiting for previous save to
    complete took N seconds" warning at the next save(), though that save did not wait. The
    benchmark waits explicitly between its saves (the training loop does not), so the
    warning would report commit times as blocking; they are measured here instead."""
    logging.getLogger("absl").addFilter(
        lambda record: "Waiting for previous save" not in record.getMessage())


class Bench:
    """The compiled step, the state it threads through, and the timed operations on them."""

    def __init__(self, exp, compiled, tokens, parent: str | None):
        from meshtrain.checkpoints.init_from import run_summary
        self.exp, self.compiled, self.tokens, self.parent = exp, compiled, tokens, parent
        self.state = exp.init_state()
        self.n = 0  # steps run, also the checkpoint step numbers (Orbax wants them increasing)
        self.meta = {"data": {"position": 0}, "skipped": 0, "run": run_summary(exp)}

    def step(self) -> tuple[float, bool]:
        """One train step, blocked on: (wall seconds, whether its input state was donated)."""
        before = jax.tree.leaves(self.state)
        t0 = time.perf_counter()
        self.state, metrics = self.compiled(self.state, self.tokens[self.n % len(self.tokens)])
        jax.block_until_ready((self.state, metrics))
        seconds = time.perf_counter() - t0
        self.n += 1
        # A donated input is deleted; one that could not be donated survives the step.
        return seconds, all(x.is_deleted() for x in before)

    def save(self, ckpt) -> float:
        """Wall seconds `ckpt.save` blocks, the state being computed beforehand."""
        jax.block_until_ready(self.state)
        t0 = time.perf_counter()
        ckpt.save(self.n, self.state, {"step": self.n, **self.meta})
        return time.perf_counter() - t0

    def measure(self, use_async: bool) -> dict[str, float]:
        """One repeat of one mode, in a directory of its own that is removed afterwards."""
        from meshtrain.checkpoints.store import Checkpointer
        directory = tempfile.mkdtemp(prefix="meshtrain-ckpt-bench-", dir=self.parent)
        try:
            # keep=0 keeps every step: no old checkpoint is deleted inside a timed save.
            ckpt = Checkpointer(directory, every=1, keep=0, use_async=use_async)
            try:
                # Commit time alone: save() then wait(), nothing else running.
                self.step()
                settle()
                t0 = time.perf_counter()
                self.save(ckpt)
                ckpt.wait()
                commit = time.perf_counter() - t0
                settle()
                plain, _ = self.step()
                # Control: a step whose input cannot be donated (numpy views of it held, as
                # an async save holds them on CPU), with no save running.
                views = [np.asarray(x) for x in jax.tree.leaves(self.state)]
                held, _ = self.step()
                del views
                # The training loop's pattern: step, save its state, next step at once.
                blocks = self.save(ckpt)
                after, donated = self.step()
                t0 = time.perf_counter()
                ckpt.wait()
                tail = time.perf_counter() - t0  # what was left of the write after that step
            finally:
                ckpt.close()
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return dict(blocks=blocks, commit=commit, plain=plain, held=held, after=after,
                    lost=blocks + after - plain, tail=tail, donated=float(donated))


def build(args):
    """(Experiment, compiled step, device batches) for the config with the benchmark's overrides."""
    from meshtrain import config as config_lib
    from meshtrain.run.experiment import Experiment

    cfg = config_lib.load(args.config)
    # One device, one process; prefetch 0 keeps reader threads off the cores being measured
    # (the batches are read once, before any timing).
    for key, value in (("mesh.shape", "data:1"), ("train.batch_size", str(args.batch_size)),
                       ("model.seq_len", str(args.seq_len)), ("data.prefetch", "0")):
        config_lib.override(cfg, key, value)
    exp = Experiment.build(cfg)
    t0 = time.perf_counter()
    compiled = exp.compile()
    print(f"compiled the train step in {time.perf_counter() - t0:.1f} s", flush=True)
    batches = exp.train_batches()
    tokens = [exp.put_batch(next(batches)) for _ in range(2)]
    return exp, compiled, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help=f"default {FULL['config']}")
    p.add_argument("--repeats", type=int, default=None, help=f"default {FULL['repeats']}")
    p.add_argument("--batch_size", type=int, default=None, help=f"default {FULL['batch_size']}")
    p.add_argument("--seq_len", type=int, default=None, help=f"default {FULL['seq_len']}")
    p.add_argument("--dir", default=None,
                   help="where the temporary checkpoint directories go (default: the system's "
                        "temp dir); its disk is part of what is measured")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: {', '.join(f'{k}={v}' for k, v in QUICK.items())}")
    args = p.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():  # explicit flags win
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    jax.config.update("jax_num_cpu_devices", 1)  # before any JAX operation: mesh data:1

    import orbax.checkpoint as ocp
    quiet_explicit_waits()
    exp, compiled, tokens = build(args)
    bench = Bench(exp, compiled, tokens, args.dir)
    m = exp.model.cfg
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"machine: {os.cpu_count()} CPUs ({cores} usable), {jax.device_count()} x "
          f"{jax.devices()[0].platform} device, jax {jax.__version__}, orbax-checkpoint "
          f"{getattr(ocp, '__version__', '?')}")
    print(f"config {args.config}: L={m.num_layers} D={m.embed_dim} V={m.padded_vocab_size}, "
          f"compute {m.dtype}, batch {args.batch_size} x seq_len {args.seq_len}")
    print(f"state: {exp.num_stored_params():,} params, {tree_bytes(bench.state) / 2**30:.3f} GiB "
          f"(params + optimizer state, {m.param_dtype})", flush=True)

    # Warm-up: the first steps wait for init and touch fresh memory; each mode's first save
    # pays one-time Orbax / TensorStore start-up. Neither is what a running job sees.
    for _ in range(3):
        bench.step()
    for _, use_async in MODES:
        bench.measure(use_async)

    results = {name: [] for name, _ in MODES}
    for r in range(args.repeats):
        # Alternate which mode goes first, so neither always runs on a warmer machine.
        for name, use_async in (MODES if r % 2 == 0 else MODES[::-1]):
            row = bench.measure(use_async)
            results[name].append(row)
            print(f"repeat {r + 1} {name:>5}: save() blocks {row['blocks']:.3f} s, commit "
                  f"{row['commit']:.2f} s, step {row['plain']:.3f} s, step after save "
                  f"{row['after']:.3f} s, write left after that step {row['tail']:.2f} s, "
                  f"donated {bool(row['donated'])}", flush=True)

    def med(name, key):
        return statistics.median(row[key] for row in results[name])

    print(f"\n| mode (median of {args.repeats}) | save() blocks (s) | commit: save + wait (s) "
          f"| step, no save in flight (s) | step right after save() (s) | slowdown of that step "
          f"| lost per save (s) | that step donated the state |")
    print("|---|---|---|---|---|---|---|---|")
    for name, _ in MODES:
        donated = sum(row["donated"] for row in results[name])
        print(f"| {name} | {med(name, 'blocks'):.3f} | {med(name, 'commit'):.2f} "
              f"| {med(name, 'plain'):.3f} | {med(name, 'after'):.3f} "
              f"| {med(name, 'after') / med(name, 'plain'):.2f}x | {med(name, 'lost'):.2f} "
              f"| {donated:.0f} of {args.repeats} |")
    ratio = med("sync", "blocks") / max(med("async", "blocks"), 1e-9)
    print(f"\nsave() blocking time sync/async: {ratio:.1f}x "
          f"({med('sync', 'blocks'):.3f} s / {med('async', 'blocks'):.3f} s); "
          f"training time lost per save sync/async: "
          f"{med('sync', 'lost'):.2f} s / {med('async', 'lost'):.2f} s")
    held = statistics.median(row["held"] for rows in results.values() for row in rows)
    print(f"control, no save: a step whose input state is held by numpy views (not donated, "
          f"so it allocates a new state) takes {held:.3f} s (median of all repeats and modes)")


if __name__ == "__main__":
    main()
