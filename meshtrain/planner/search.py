"""Search layouts for N devices: enumerate, drop what cannot work, rank by formula,
compile the few that can win, rank (docs/planner.md, "Search", says each step and why).

    python -m meshtrain.plan --config=gpt2_medium_dp8_tp4 --search --devices=32 --hardware=h100

1. Enumerate: every factorisation of N into the mesh axes x each preset that uses exactly the
   axes above 1 (layouts.presets.PRESET_AXES) x each remat policy x, on a stage axis S,
   M = S, 2S, 4S under each of PIPELINE_SCHEDULES; --nodes=K puts K on data (or fsdp). A
   context axis only from CONTEXT_MIN_SEQ positions, an expert axis only with experts.
2. Drop, counting why: the linter's errors and the config checks, then the formulas'
   memory against the hardware's usable memory.
3. Predict every survivor by the roofline on the formulas alone (`_estimate`), and compile
   (compile_pool, cached) those within `margin` of the best, one pipeline schedule of each,
   plus the config's own layout's best, until the time budget is spent.
4. Rank by each row's best figure (compiled, else formulas), the best PODIUM compiled ones;
   the winner as a command and the config's own layout's rank (planner/ranking.py).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time

from meshtrain import config as config_lib, mesh as mesh_lib
from meshtrain.errors import GiB, UserError
from meshtrain.parallel.layouts import presets
from meshtrain.planner import compile_pool, pipeline_memory, ranking
from meshtrain.progress import Progress, format_duration

REMAT = ("none", "save_dots", "full")
# Matmul FLOPs executed under each remat policy over remat=none's, as compiled for GPT-2
# medium (flops_per_step of the compiled programs: 1.107 and 1.284 against 1.063 the
# model's): save_dots recomputes the attention's batched matmuls, full the block's forward
# but for the last matmul, whose output the backward does not read.
REMAT_FLOPS = {"none": 1.0, "save_dots": 1.04, "full": 1.21}
# Pipeline schedules tried on a stage axis: (schedule, repeats v, stash); those with v > 1
# only where v S divides the layers (the microbatches S, 2S, 4S are multiples of S). Under
# gpipe/circular the stash means nothing and is left out of the overrides. zb with its
# residuals (W's stash is about a stash of residuals again; with inputs it would add the
# recompute to that).
PIPELINE_SCHEDULES = (("gpipe", 1, ""), ("circular", 2, ""), ("1f1b", 1, "inputs"), ("1f1b", 1, "residuals"),
                      ("interleaved", 2, "inputs"), ("interleaved", 2, "residuals"), ("zb", 1, "residuals"))
# Context parallelism is searched from this many positions: a ring step's 8 c K E bytes of k and
# v against its 8 c^2 H E FLOPs, c H / K FLOPs a byte, pass an H100's ~2,200 per NVLink byte only
# from T ~ 8,800 for Llama 3 (H/K = 4) on 8 devices (docs/planner.md, "Sequence parallelism").
CONTEXT_MIN_SEQ = 8192
MARGIN = 0.10  # compile what the formulas predict within this share of the best step time
PODIUM = 3     # the best rows, compiled whatever the formulas said


@dataclasses.dataclass(frozen=True)
class Candidate:
    mesh: tuple[tuple[str, int], ...]
    layout: str
    remat: str
    microbatches: int = 0
    dcn: str = ""
    schedule: str = "gpipe"  # with microbatches: pipeline.schedule, .repeats, .stash ("" unset)
    repeats: int = 1
    stash: str = ""

    def overrides(self) -> list[tuple[str, str]]:
        out = [("mesh.shape", ",".join(f"{a}:{n}" for a, n in self.mesh)), ("mesh.dcn", self.dcn),
               ("layout", self.layout), ("model.remat", self.remat)]
        out.append(("pipeline.microbatches", str(self.microbatches)))
        if self.microbatches:
            out += [("pipeline.schedule", self.schedule), ("pipeline.repeats", str(self.repeats))]
            out += [("pipeline.stash", self.stash)] if self.stash else []
        return out

    def describe(self) -> str:
        mesh = ",".join(f"{a}:{n}" for a, n in self.mesh if n > 1) or "data:1"
        pipe = ""
        if self.microbatches:
            pipe = (f" pp-micro {self.microbatches} {self.schedule}" + (f" v={self.repeats}" * (self.repeats > 1))
                    + (f" stash={self.stash}" if self.stash else ""))
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


def pipeline_options(stages: int, num_layers: int) -> list[tuple[int, str, int, str]]:
    """(microbatches, schedule, repeats, stash) tried on a stage axis of `stages`: M = S, 2S,
    4S under each of PIPELINE_SCHEDULES that chunks the layers evenly; one plain entry
    (0, "gpipe", 1, "") without a stage axis."""
    if stages == 1:
        return [(0, "gpipe", 1, "")]
    return [(m * stages, schedule, v, stash) for m in (1, 2, 4) for schedule, v, stash in PIPELINE_SCHEDULES
            if num_layers % (v * stages) == 0]


def enumerate_candidates(devices: int, num_layers: int, nodes: int | None, layouts=None,
                         remats=REMAT, seq_len: int | None = None,
                         num_experts: int | None = None) -> tuple[list[Candidate], collections.Counter]:
    """Candidates for `devices`, restricted to the `layouts` presets (default all) and
    `remats` policies, a context axis only when `seq_len` >= CONTEXT_MIN_SEQ, an expert axis
    only when `num_experts` > 1; and the counts of those dropped on sight, by reason."""
    out, dropped = [], collections.Counter()
    for sizes in factorizations(devices, len(mesh_lib.AXES)):
        shape = dict(zip(mesh_lib.AXES, sizes))
        used = {a for a, n in shape.items() if n > 1}
        if "context" in used and (seq_len or 0) < CONTEXT_MIN_SEQ:
            continue  # not counted as dropped: never a candidate (module docstring)
        if "expert" in used and (num_experts or 0) <= 1:
            continue  # a dense model has no experts to split: expert would only repeat the work
        if num_experts and num_experts % shape["expert"]:
            dropped["expert axis does not divide model.num_experts"] += 1
            continue
        for layout, (required, allowed) in presets.PRESET_AXES.items():
            if (layouts and layout not in layouts) or not (required <= used <= allowed):
                continue
            dcn = _dcn_for(shape, nodes)
            if dcn is None:
                dropped["cannot keep tensor and stage inside a node (--nodes)"] += len(remats)
                continue
            stages = shape["stage"]
            if stages > 1 and num_layers % stages:
                dropped["stages do not divide the layers"] += len(remats) * 3 * len(PIPELINE_SCHEDULES)
                continue
            for remat, (m, schedule, v, stash) in itertools.product(remats, pipeline_options(stages, num_layers)):
                out.append(Candidate(tuple(shape.items()), layout, remat, m, dcn, schedule, v, stash))
    return out, dropped


def run(name: str, cfg, overrides: list, hw, *, devices: int, nodes: int | None, budget_s: int,
        top: int, jobs: int, cache_dir: str | None, layouts=None, remats=REMAT, margin: float = MARGIN,
        say=print) -> dict:
    """The search (module docstring). -> {"ranked": [...], "winner": {...}, "own_layout": {...},
    "dropped": {...}, ...} for --json."""
    t0 = time.perf_counter()
    if nodes and devices % nodes:
        raise UserError(f"--devices={devices} is not divisible by --nodes={nodes}.")
    mesh_lib.simulate_cpu_devices({"data": devices})
    from meshtrain import models
    from meshtrain.run.experiment import read_inputs, resolve
    inputs = read_inputs(cfg)  # the data and init.from, once for every candidate
    dims = models.size_dims(resolve(cfg, inputs.init).model)
    candidates, dropped = enumerate_candidates(devices, dims["num_layers"], nodes, layouts, remats,
                                               dims.get("seq_len"), dims.get("num_experts"))
    say(f"search: {len(candidates)} candidates for {devices} devices"
        + (f" on {nodes} nodes" if nodes else "") + f" ({hw.name}); predicting each by the formulas")
    feasible = _check(name, overrides, candidates, inputs, hw, dropped)
    # Ties (schedules that differ only in what they keep) go to the leaner.
    feasible.sort(key=lambda f: (f["prediction"]["step_time_s"], f["memory_bytes"]))
    say(f"{len(feasible)} feasible; dropped " + (", ".join(f"{n} {why}" for why, n in dropped.most_common())
                                                  or "none"))
    own = ranking.own_candidates(cfg, feasible)
    best = feasible[0]["prediction"]["step_time_s"] if feasible else 0.0
    chosen = one_schedule_each([f for f in feasible if f["prediction"]["step_time_s"] <= (1 + margin) * best])
    near = len(chosen)
    chosen += [f for f in own if f not in chosen]
    if feasible:
        say(f"compiling {len(chosen)}: {near} within {margin:.0%} of the best formula prediction"
            + (f", {len(chosen) - near} for the config's own layout" if len(chosen) > near else "")
            + f"; the other {len(feasible) - len(chosen)} are slower by the formulas and keep their figures")
    deadline = t0 + budget_s
    compiled = compile_pool.compile_all(name, overrides, chosen, hw, devices, deadline, jobs, cache_dir, say)
    # The podium must be compiled: a formula row can lead where the compiled figures of its
    # rivals carry the CPU compiler's excess collectives (docs/planner.md, "Collectives").
    while feasible and time.perf_counter() < deadline:
        todo = [r["entry"] for r in ranking.merge(feasible, compiled)[:PODIUM] if not r["compiled"]]
        if not todo:
            break
        say(f"compiling {len(todo)} more: formula rows among the best {PODIUM}")
        compiled.update(compile_pool.compile_all(name, overrides, todo, hw, devices, deadline, jobs, cache_dir, say))
    rows = ranking.merge(feasible, compiled)
    failed = sum(1 for r in compiled.values() if "error" in r)
    if failed:
        dropped["failed to compile"] += failed
    shown = ranking.summaries(rows[:top], rows)
    for line in ranking.table(shown):
        say(line)
    winner = ranking.winner(name, cfg, overrides, rows)
    own_row = ranking.own_layout(cfg, rows)
    for line in ranking.verdict(winner, own_row, len(rows)):
        say(line)
    done = sum(1 for r in compiled.values() if "error" not in r)
    skipped = sum(1 for f in chosen if f["candidate"] not in compiled)
    say(f"compiled {done} of {len(feasible)} feasible layouts"
        + (f" ({skipped} left when the {budget_s}s budget ran out)" if skipped else "")
        + f" in {format_duration(time.perf_counter() - t0)}")
    return {"devices": devices, "nodes": nodes, "hardware": hw.describe(), "candidates": len(candidates),
            "feasible": len(feasible), "compiled": done, "not_compiled": skipped,
            "margin": margin, "dropped": dict(dropped), "ranked": shown, "winner": winner, "own_layout": own_row}


def one_schedule_each(entries: list[dict]) -> list[dict]:
    """The first of `entries` (sorted: fastest, then leanest) of each group of candidates
    that differ only in their pipeline schedule: the formulas rank schedules well (their
    bubble, recompute and stash are arithmetic), so the group is compiled once."""
    seen, out = set(), []
    for entry in entries:
        key = dataclasses.replace(entry["candidate"], schedule="", repeats=1, stash="")
        if key not in seen:
            seen.add(key)
            out.append(entry)
    return out


def _check(name, overrides, candidates, inputs, hw, dropped) -> list[dict]:
    """The candidates that divide and fit by the formulas: [{candidate, cfg, prediction,
    memory_bytes, bound_bytes}] (the formula prediction: `_estimate`)."""
    from meshtrain.planner import accumulation, analytic, lint
    from meshtrain.run.experiment import Experiment, resolve
    out = []
    progress = Progress("checking", len(candidates), unit="", stream=None)
    for cand in candidates:
        progress.update(1)
        c = resolve(config_lib.load(name, [*overrides, *cand.overrides()]), inputs.init)
        shape = dict(cand.mesh)
        errors = [f for f in lint.lint(c, shape, mesh_lib.parse_dcn(c.mesh.dcn, shape)) if f.severity == "error"]
        if errors:
            dropped[f"does not divide: {errors[0].code}"] += 1
            continue
        try:
            # train.accum_gather="auto" as train would take it on this hardware
            exp = Experiment.build(c, inputs=inputs, choose_gather=accumulation.for_hardware(hw))
        except UserError as e:
            dropped[f"does not divide: {str(e).split(':')[0][:60]}"] += 1
            continue
        memory = analytic.memory(exp, hw)
        total = sum(v or 0.0 for v in memory.values())
        if total > hw.hbm_bytes * hw.usable_memory:
            dropped[f"do not fit {hw.hbm_bytes * hw.usable_memory / GiB:.0f} GiB (formulas)"] += 1
            continue
        prediction, bounds = _estimate(exp, hw, memory)
        out.append({"candidate": cand, "cfg": c, "prediction": prediction, "memory_bytes": total,
                    "bound_bytes": sum(r["bytes"] for r in bounds)})
    progress.close()
    return out


def _estimate(exp, hw, memory) -> tuple[dict, list[dict]]:
    """The roofline on the formulas alone: the matmul FLOPs from the model's (remat and a
    pipeline's bubble ticks added, and the attention's masked half, which the compiled
    program computes: 12 L D T a token against the model's 6 L D T), collectives at their
    lower bounds. -> (prediction, bounds)."""
    from meshtrain.planner import analytic, bounds as bounds_lib, roofline, work
    from meshtrain.runlog import metrics
    cfg, pipe = exp.model.cfg, exp.model.pipeline
    n = exp.mesh.devices.size
    model_flops = metrics.flops_per_unit(cfg) * exp.units_per_step
    waste = 1 / (1 - pipe.bubble) if pipe else 1.0  # the step over its work, idle ticks included
    node_of = roofline.node_of_position(exp.mesh, hw.devices_per_node, exp.dcn)
    bounds = roofline.place(bounds_lib.collective_bounds(exp), exp.mesh, node_of)
    tokens = exp.cfg.train.batch_size * cfg.seq_len
    square = 6.0 * getattr(cfg, "num_layers", 0) * getattr(cfg, "embed_dim", 0) * cfg.seq_len * tokens
    # 1F1B with stash=inputs runs each chunk's forward again: the layers', not the head's
    head = 6.0 * getattr(cfg, "padded_vocab_size", 0) * getattr(cfg, "embed_dim", 0) * tokens
    again = pipeline_memory.LAYER_FLOPS[pipe.stash] if pipe is not None and pipe.one_f_one_b else 1.0
    flops = (head + (model_flops + square - head) * again) / n * REMAT_FLOPS.get(cfg.remat, 1.0) * waste
    # The memory term reads the activations the step writes (1F1B keeps fewer at once).
    traffic = {**memory, "activations": analytic.activation_traffic(exp, hw)}
    return roofline.predict(hw, cfg.dtype, flops, traffic, bounds, model_flops, n, work.step_work(exp, hw)), bounds


