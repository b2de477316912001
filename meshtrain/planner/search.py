"""Search layouts for N devices: enumerate, drop what cannot work, compile, rank.

    python -m meshtrain.plan --config=gpt2_medium_dp8_tp4 --search --devices=32 --hardware=h100

1. Enumerate: every factorisation of N into (data, stage, fsdp, tensor), each layout preset
   that uses exactly the axes above 1 (so no two candidates are the same program), each
   remat policy, and for a stage axis S the pipeline microbatches S, 2S and 4S; with
   --nodes=K the inter-node factor K goes on data (or fsdp), never on tensor or stage.
2. Drop, counting why: the linter's errors and the config checks (what does not divide),
   then the formulas' memory against the hardware's usable memory (what does not fit).
3. Order the survivors by the roofline on the formulas alone, then compile them in that
   order (on simulated CPU devices, `jobs` processes, each result cached on disk) until
   the time budget is spent.
4. Rank the compiled by predicted step time and say why each wins.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import pathlib
import time

from meshtrain import config as config_lib, mesh as mesh_lib
from meshtrain.layouts import presets
from meshtrain.errors import UserError
from meshtrain.planner import hardware as hardware_lib, text
from meshtrain.progress import Progress, format_duration

# preset -> (axes that must be above 1, axes it may use)
REMAT = ("none", "save_dots", "full")
REMAT_FLOPS = {"none": 1.0, "save_dots": 1.1, "full": 4 / 3}  # executed / model, for ordering only


@dataclasses.dataclass(frozen=True)
class Candidate:
    mesh: tuple[tuple[str, int], ...]
    layout: str
    remat: str
    microbatches: int = 0
    dcn: str = ""

    def overrides(self) -> list[tuple[str, str]]:
        out = [("mesh.shape", ",".join(f"{a}:{n}" for a, n in self.mesh)), ("mesh.dcn", self.dcn),
               ("layout", self.layout), ("model.remat", self.remat)]
        return out + [("pipeline.microbatches", str(self.microbatches))]

    def describe(self) -> str:
        mesh = ",".join(f"{a}:{n}" for a, n in self.mesh if n > 1) or "data:1"
        pipe = f" pp-micro {self.microbatches}" if self.microbatches else ""
        return f"{mesh} {self.layout} remat={self.remat}{pipe}" + (f" dcn {self.dcn}" if self.dcn else "")


def factorizations(n: int, k: int = 4):
    """Ordered k-tuples of positive integers whose product is n."""
    if k == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in factorizations(n // d, k - 1):
                yield (d, *rest)


def _dcn_for(shape: dict, nodes: int | None) -> str | None:
    """The inter-node factor on data, else fsdp, else split over both; None if impossible."""
    if not nodes or nodes == 1:
        return ""
    for kd in sorted((d for d in range(1, nodes + 1) if nodes % d == 0), reverse=True):
        kf = nodes // kd
        if shape["data"] % kd == 0 and shape["fsdp"] % kf == 0:
            return ",".join(f"{a}:{k}" for a, k in (("data", kd), ("fsdp", kf)) if k > 1)
    return None


def enumerate_candidates(devices: int, num_layers: int, nodes: int | None, layouts=None,
                         remats=REMAT) -> tuple[list[Candidate], collections.Counter]:
    """Candidates for `devices`, restricted to the `layouts` presets (default all) and
    `remats` policies; and the counts of those dropped on sight, by reason."""
    out, dropped = [], collections.Counter()
    for sizes in factorizations(devices):
        shape = dict(zip(mesh_lib.AXES, sizes))
        used = {a for a, n in shape.items() if n > 1}
        for layout, (required, allowed) in presets.PRESET_AXES.items():
            if (layouts and layout not in layouts) or not (required <= used <= allowed):
                continue
            dcn = _dcn_for(shape, nodes)
            if dcn is None:
                dropped["cannot keep tensor and stage inside a node (--nodes)"] += len(remats)
                continue
            stages = shape["stage"]
            micro = [m * stages for m in (1, 2, 4)] if stages > 1 else [0]
            if stages > 1 and num_layers % stages:
                dropped["stages do not divide the layers"] += len(remats) * len(micro)
                continue
            for remat, m in itertools.product(remats, micro):
                out.append(Candidate(tuple(shape.items()), layout, remat, m, dcn))
    return out, dropped


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


def _build(name: str, base: list, extra: list):
    cfg = config_lib.load(name)
    for key, value in list(base) + list(extra):
        config_lib.override(cfg, key, value)
    return cfg


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
    from meshtrain.experiment import Experiment, read_inputs
    from meshtrain.planner import report as report_lib
    key = (name, tuple(map(tuple, base)))
    if key not in _WORKER_INPUTS:
        _WORKER_INPUTS[key] = read_inputs(_build(name, base, []))
    exp = Experiment.build(_build(name, base, cand_overrides), inputs=_WORKER_INPUTS[key])
    r = report_lib.plan(exp, hardware_lib.Hardware(**hw_fields))
    r.pop("config", None)
    return r


def run(name: str, cfg, overrides: list, hw, *, devices: int, nodes: int | None, budget_s: int,
        top: int, jobs: int, cache_dir: str | None, layouts=None, remats=REMAT, say=print) -> dict:
    """The search (module docstring). -> {"ranked": [...], "dropped": {...}, ...} for --json."""
    t0 = time.perf_counter()
    if nodes and devices % nodes:
        raise UserError(f"--devices={devices} is not divisible by --nodes={nodes}.")
    mesh_lib.simulate_cpu_devices({"data": devices})
    from meshtrain import models
    from meshtrain.planner import lint
    from meshtrain.experiment import Experiment, read_inputs, resolve
    from meshtrain.planner import analytic, roofline
    inputs = read_inputs(cfg)  # the data and init.from, once for every candidate
    dims = models.size_dims(resolve(cfg, inputs.init).model)
    candidates, dropped = enumerate_candidates(devices, dims["num_layers"], nodes, layouts, remats)
    say(f"search: {len(candidates)} candidates for {devices} devices"
        + (f" on {nodes} nodes" if nodes else "") + f" ({hw.name}); checking them against the formulas")
    survivors = []
    progress = Progress("checking", len(candidates), unit="", stream=None)
    for cand in candidates:
        progress.update(1)
        c = resolve(_build(name, overrides, cand.overrides()), inputs.init)
        shape = dict(cand.mesh)
        errors = [f for f in lint.lint(c, shape, mesh_lib.parse_dcn(c.mesh.dcn, shape)) if f.severity == "error"]
        if errors:
            dropped[f"does not divide: {errors[0].code}"] += 1
            continue
        try:
            exp = Experiment.build(c, inputs=inputs)
        except UserError as e:
            dropped[f"does not divide: {str(e).split(':')[0][:60]}"] += 1
            continue
        memory = analytic.memory(exp, hw)
        total = sum(v or 0.0 for v in memory.values())
        if total > hw.hbm_bytes * hw.usable_memory:
            dropped[f"does not fit {hw.hbm_bytes * hw.usable_memory / 2**30:.0f} GiB (formulas)"] += 1
            continue
        survivors.append((cand, c, _estimate(exp, hw, memory, analytic, roofline)))
    progress.close()
    survivors.sort(key=lambda s: s[2])
    say(f"{len(survivors)} feasible; dropped " + (", ".join(f"{n} {why}" for why, n in dropped.most_common())
                                                   or "none"))
    reports, skipped = _compile_all(name, overrides, survivors, hw, devices, budget_s - (time.perf_counter() - t0),
                                    jobs, cache_dir, say)
    ranked = sorted(reports, key=lambda r: r["predicted_step_time_s"])
    rows = [_summary(i, r, ranked) for i, r in enumerate(ranked[:top])]
    for line in _table(rows):
        say(line)
    say(f"compiled {len(reports)} of {len(survivors)} feasible layouts"
        + (f" ({skipped} left when the {budget_s}s budget ran out)" if skipped else "")
        + f" in {format_duration(time.perf_counter() - t0)}")
    return {"devices": devices, "nodes": nodes, "hardware": hw.describe(), "candidates": len(candidates),
            "feasible": len(survivors), "compiled": len(reports), "not_compiled": skipped,
            "dropped": dict(dropped), "ranked": rows}


def _estimate(exp, hw, memory, analytic, roofline) -> float:
    """Step time from the formulas alone: the order in which to compile."""
    from meshtrain import metrics
    cfg, pipe = exp.model.cfg, exp.model.pipeline
    n = exp.mesh.devices.size
    model_flops = metrics.flops_per_token(cfg) * exp.cfg.train.batch_size * cfg.seq_len
    waste = pipe.ticks / (pipe.microbatches * pipe.repeats) if pipe else 1.0
    node_of = roofline.node_of_position(exp.mesh, hw.devices_per_node, exp.dcn)
    rows = [{**r, "crosses_nodes": roofline.crosses_nodes(exp.mesh, r["mesh_axes"], node_of)}
            for r in analytic.collective_bounds(exp)]
    return roofline.predict(hw, cfg.dtype, model_flops / n * REMAT_FLOPS[cfg.remat] * waste, memory, rows,
                            model_flops, n)["step_time_s"]


def _compile_all(name, overrides, survivors, hw, devices, budget_s, jobs, cache_dir, say):
    cache = pathlib.Path(cache_dir if cache_dir is not None else
                         os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                      "meshtrain", "plan")) if cache_dir != "" else None
    salt = code_hash()
    reports, todo = [], []
    for cand, c, _ in survivors:
        key = _cache_key(c, hw, salt)
        hit = cache / f"{key}.json" if cache else None
        if hit is not None and hit.exists():
            reports.append({**json.loads(hit.read_text()), "candidate": cand.describe(), "remat": cand.remat,
                            "cached": True})
        else:
            todo.append((cand, key))
    if reports:
        say(f"{len(reports)} found in the cache ({cache})")
    progress = Progress("compiling", len(todo), unit="", stream=None)
    deadline = time.perf_counter() + max(budget_s, 0)
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
                    continue
                if cache is not None:
                    cache.mkdir(parents=True, exist_ok=True)
                    tmp = cache / f"{key}.json.tmp"
                    tmp.write_text(json.dumps(r, default=str))
                    tmp.replace(cache / f"{key}.json")
                reports.append({**r, "candidate": cand.describe(), "remat": cand.remat, "cached": False})
    finally:
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()  # a compile past the budget is not waited for
        pool.shutdown(wait=False, cancel_futures=True)
    progress.close()
    return reports, len(queue) + len(pending)


def _summary(i: int, r: dict, ranked: list[dict]) -> dict:
    p = r["prediction"]
    mem = r["analytic_memory_per_device_bytes"]["total"]
    return {"rank": i + 1, "candidate": r["candidate"], "mesh": r["mesh"], "layout": r["layout"],
            "remat": r["remat"], "cached": r["cached"],
            "predicted_step_time_s": r["predicted_step_time_s"], "predicted_mfu": r["predicted_mfu"],
            "memory_per_device_bytes": mem, "compiled_peak_estimate_bytes": r["memory_per_device_bytes"]["peak_estimate"],
            "collective_bytes_per_step": r["collective_bytes_per_step"], "bound_by": p["bound_by"],
            "why": _why(i, r, ranked)}


TERMS = {"matmul_s": "matmul time (less remat or bubble)", "memory_s": "memory traffic",
         "exposed_collectives_s": "tensor/stage collectives", "overlapped_collectives_s": "data/fsdp traffic"}


def _why(i: int, r: dict, ranked: list[dict]) -> str:
    """What sets this layout apart: against the runner-up for the best, against the best otherwise."""
    p = r["prediction"]
    if len(ranked) == 1:
        return f"the only one compiled; bound by {p['bound_by']}"
    other = ranked[1] if i == 0 else ranked[0]
    q = other["prediction"]
    diffs = {k: q[k] - p[k] for k in TERMS}
    if i == 0:
        k = max(diffs, key=diffs.get)
        return (f"{100 * (q['step_time_s'] / p['step_time_s'] - 1):.1f}% faster than #2: "
                f"{TERMS[k]} {1e3 * p[k]:.3g} ms vs {1e3 * q[k]:.3g} ms")
    k = min(diffs, key=diffs.get)
    return (f"{100 * (p['step_time_s'] / q['step_time_s'] - 1):.1f}% slower than #1: "
            f"{TERMS[k]} {1e3 * p[k]:.3g} ms vs {1e3 * q[k]:.3g} ms")


def _table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["no layout compiled: raise --budget or check the dropped counts above"]
    head = ["#", "layout", "step ms", "MFU", "GiB/device", "MiB sent", "why"]
    body = [[str(r["rank"]), r["candidate"], f"{1e3 * r['predicted_step_time_s']:.4g}",
             f"{100 * r['predicted_mfu']:.1f}%", f"{r['memory_per_device_bytes'] / 2**30:,.2f}",
             f"{r['collective_bytes_per_step'] / 2**20:,.0f}", r["why"]] for r in rows]
    return text.table([head] + body, right={0, 2, 3, 4, 5})
