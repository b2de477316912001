"""The search's compiles: candidates built, compiled and reported in worker processes
(`jobs` of them, spawned, each with its simulated CPU devices), each report cached on disk
under a key of the config, the hardware, JAX's version and meshtrain's source.

    compile_all(name, overrides, entries, hw, devices, deadline, jobs, cache_dir, say)
        -> {candidate: report}; stops submitting at `deadline`, and a compile running past
        it is not waited for
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import pathlib
import time

from meshtrain import config as config_lib
from meshtrain.errors import UserError
from meshtrain.planner import hardware as hardware_lib
from meshtrain.progress import Progress


def code_hash() -> str:
    """Changes whenever meshtrain's source does: the cache's invalidation."""
    h = hashlib.sha256()
    root = pathlib.Path(__file__).resolve().parent.parent
    for path in sorted(root.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _cache_key(cfg, hw, salt: str) -> str:
    import jax
    blob = json.dumps([cfg.to_dict(), dataclasses.asdict(hw), jax.__version__, salt], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _worker_init(devices: int) -> None:
    # XLA's partitioner warns on stderr about resharding it finds inefficient; the compiled
    # collectives already count what it costs, and the warnings would bury the progress bar.
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)


_WORKER_INPUTS: dict = {}  # a worker reads the config's data and init.from once, not per candidate


def compile_one(name: str, base: list, cand_overrides: list, hw_fields: dict) -> dict:
    """In a worker: build, compile and report one candidate (the parts the ranking needs)."""
    from meshtrain.planner import accumulation, report as report_lib
    from meshtrain.run.experiment import Experiment, read_inputs
    key = (name, tuple(map(tuple, base)))
    if key not in _WORKER_INPUTS:
        _WORKER_INPUTS[key] = read_inputs(config_lib.load(name, base))
    hw = hardware_lib.Hardware(**hw_fields)
    exp = Experiment.build(config_lib.load(name, [*base, *cand_overrides]), inputs=_WORKER_INPUTS[key],
                           choose_gather=accumulation.for_hardware(hw))
    r = report_lib.plan(exp, hw)
    r.pop("config", None)
    return r


def compile_all(name, overrides, entries, hw, devices, deadline, jobs, cache_dir, say) -> dict:
    """Compiles the `entries` (from `_check`) until `deadline` (perf_counter seconds), each
    from the cache when it is there. -> {candidate: its report}."""
    cache = pathlib.Path(cache_dir if cache_dir is not None else
                         os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                      "meshtrain", "plan")) if cache_dir != "" else None
    salt = code_hash()
    reports, todo = {}, []
    for entry in entries:
        cand = entry["candidate"]
        key = _cache_key(entry["cfg"], hw, salt)
        hit = cache / f"{key}.json" if cache else None
        if hit is not None and hit.exists():
            reports[cand] = {**json.loads(hit.read_text()), "cached": True}
        else:
            todo.append((cand, key))
    if reports:
        say(f"{len(reports)} found in the cache ({cache})")
    if not todo:
        return reports
    progress = Progress("compiling", len(todo), unit="", stream=None)
    fields = dataclasses.asdict(hw)
    pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=_worker_init, initargs=(devices,))
    pending, queue = {}, list(todo)
    try:
        while queue or pending:
            while queue and len(pending) < jobs and time.perf_counter() < deadline:
                cand, key = queue.pop(0)
                pending[pool.submit(compile_one, name, overrides, cand.overrides(), fields)] = (cand, key)
            if not pending:
                break
            done, _ = concurrent.futures.wait(pending, timeout=max(deadline - time.perf_counter(), 1),
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            if not done and time.perf_counter() >= deadline:
                break
            for f in done:
                cand, key = pending.pop(f)
                progress.update(1)
                try:
                    r = f.result()
                except UserError as e:
                    say(f"  {cand.describe()}: {e}")
                    reports[cand] = {"error": str(e)}
                    continue
                if cache is not None:
                    cache.mkdir(parents=True, exist_ok=True)
                    tmp = cache / f"{key}.json.tmp"
                    tmp.write_text(json.dumps(r, default=str))
                    tmp.replace(cache / f"{key}.json")
                reports[cand] = {**r, "cached": False}
    finally:
        if pending or queue:  # the budget ran out: a compile past it is not waited for
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.terminate()
            pool.shutdown(wait=False, cancel_futures=True)
        else:  # all done: a clean shutdown, so that a later pool's exit finds no stale pipe
            pool.shutdown(wait=True)
    progress.close()
    return reports
