"""The search's ranking (planner/search.py): every feasible candidate by its best figure,
the winner as the command that runs it, and where the config's own layout stands.

    rows = merge(feasible, compiled)      # compiled figures where compiled, else the formulas'
    winner(name, cfg, overrides, rows)    # {"candidate", "overrides", "command", ...}
    own_layout(cfg, rows)                 # the config's own candidate and its layout's best

A row is {"entry", "candidate", "compiled", "cached", "prediction", "memory_bytes",
"compiled_peak_bytes", "collective_bytes"}; `prediction` is roofline.predict's dict, from
the compiled report (`compiled`) or from the formulas alone.
"""

from __future__ import annotations

import shlex

from meshtrain import config as config_lib, mesh as mesh_lib
from meshtrain.errors import GiB, MiB, UserError
from meshtrain.pictures import text


def merge(feasible: list[dict], compiled: dict) -> list[dict]:
    """All feasible candidates, fastest first; those that failed to compile are left out."""
    rows = []
    for entry in feasible:
        cand = entry["candidate"]
        r = compiled.get(cand)
        if r is not None and "error" in r:
            continue
        if r is not None:
            rows.append({"entry": entry, "candidate": cand, "compiled": True, "cached": r.get("cached", False),
                         "prediction": r["prediction"],
                         "memory_bytes": r["analytic_memory_per_device_bytes"]["total"],
                         "compiled_peak_bytes": r["memory_per_device_bytes"]["peak_estimate"],
                         "collective_bytes": r["collective_bytes_per_step"]})
        else:
            rows.append({"entry": entry, "candidate": cand, "compiled": False, "cached": False,
                         "prediction": entry["prediction"], "memory_bytes": entry["memory_bytes"],
                         "compiled_peak_bytes": None, "collective_bytes": entry["bound_bytes"]})
    return sorted(rows, key=lambda r: r["prediction"]["step_time_s"])


def own_candidates(cfg, feasible: list[dict]) -> list[dict]:
    """The entries to compile so the config's own layout can be ranked: its exact candidate
    (when its mesh has the searched device count) and its layout's best by the formulas."""
    out = [e for e in feasible if _is_own(cfg, e["candidate"])][:1]
    same = [e for e in feasible if e["candidate"].layout == cfg.layout]
    if same and same[0] not in out:  # `feasible` is sorted by the formula prediction
        out.append(same[0])
    return out


def _is_own(cfg, cand) -> bool:
    try:
        shape = mesh_lib.parse_shape(cfg.mesh.shape)
    except UserError:
        return False
    micro = cfg.pipeline.microbatches if shape["stage"] > 1 else 0
    p = cfg.pipeline
    schedule = not micro or (cand.schedule == p.schedule and cand.repeats == p.repeats
                             and cand.stash in ("", p.stash))
    return (dict(cand.mesh) == shape and cand.layout == cfg.layout and cand.remat == cfg.model.remat
            and cand.microbatches == micro and schedule)


def command_overrides(cfg, cand) -> list[tuple[str, str]]:
    """The candidate's overrides that differ from `cfg` (the config with the user's overrides)."""
    out = []
    for key, value in cand.overrides():
        if key == "mesh.shape":
            shape = dict(cand.mesh)
            value = mesh_lib.format_factors(shape) if any(n > 1 for n in shape.values()) else "data:1"
            try:
                same = mesh_lib.parse_shape(cfg.mesh.shape) == shape
            except UserError:
                same = False
        else:
            same = str(config_lib.get(cfg, key)) == value
        if not same:
            out.append((key, value))
    return out


def winner(name: str, cfg, overrides: list, rows: list[dict]) -> dict | None:
    """The best row as a command: the user's overrides, then the candidate's (where they
    differ from the config), as `meshtrain train` takes them."""
    if not rows:
        return None
    best = rows[0]
    mine = command_overrides(cfg, best["candidate"])
    keys = {k for k, _ in mine}
    pairs = [(k, v) for k, v in overrides if k not in keys] + mine
    command = " ".join([f"meshtrain train --config={name}"]
                       + [f"--config.{k}={shlex.quote(str(v))}" for k, v in pairs])
    return {"candidate": best["candidate"].describe(), "by": _by(best),
            "predicted_step_time_s": best["prediction"]["step_time_s"], "overrides": [list(p) for p in pairs],
            "command": command}


def own_layout(cfg, rows: list[dict]) -> dict:
    """Where the config's own candidate and the best candidate of its layout rank; the
    layout's best is its best compiled candidate where one is (the formulas' figures run a
    little low against the compiled ones, so a formula row can edge ahead of its own compile)."""
    out = {"layout": cfg.layout, "mesh": cfg.mesh.shape, "exact": None, "best": None}
    same = [(i, r) for i, r in enumerate(rows) if r["candidate"].layout == cfg.layout]
    best = next(((i, r) for i, r in same if r["compiled"]), same[0] if same else None)
    if best is not None:
        out["best"] = _place(*best, rows)
    exact = next(((i, r) for i, r in same if _is_own(cfg, r["candidate"])), None)
    if exact is not None:
        out["exact"] = _place(*exact, rows)
    return out


def _place(i: int, r: dict, rows: list[dict]) -> dict:
    step = r["prediction"]["step_time_s"]
    return {"rank": i + 1, "candidate": r["candidate"].describe(), "by": _by(r), "predicted_step_time_s": step,
            "times_the_best": step / rows[0]["prediction"]["step_time_s"]}


def _by(r: dict) -> str:
    return "compiled" if r["compiled"] else "formulas"


def verdict(best: dict | None, own: dict, n: int) -> list[str]:
    """The winner's command and the config's own layout's rank, for the terminal."""
    if best is None:
        return []
    lines = [f"best: {best['candidate']}, {1e3 * best['predicted_step_time_s']:.4g} ms predicted "
             f"({best['by']}); run it with:", f"  {best['command']}"]

    def where(p: dict) -> str:
        return (f"#{p['rank']} of {n}, {p['candidate']}, {1e3 * p['predicted_step_time_s']:.4g} ms "
                f"({p['by']}), {p['times_the_best']:.2f}x the best's step")
    head = f"the config's own layout {own['layout']!r}"
    if own["exact"] is not None:
        lines.append(f"{head} as configured (mesh {own['mesh']}): {where(own['exact'])}")
        if own["best"]["rank"] < own["exact"]["rank"]:
            lines.append(f"  its best: {where(own['best'])}")
    elif own["best"] is not None:
        lines.append(f"{head} (mesh {own['mesh']} is not among the candidates): its best is {where(own['best'])}")
    else:
        lines.append(f"{head}: no feasible candidate uses it (a preset that uses exactly the axes above 1 "
                     f"is tried on each mesh; see the dropped counts)")
    return lines


def summaries(shown: list[dict], rows: list[dict]) -> list[dict]:
    """The JSON rows of the ranking."""
    out = []
    for i, r in enumerate(shown):
        cand, p = r["candidate"], r["prediction"]
        out.append({"rank": i + 1, "candidate": cand.describe(), "mesh": dict(cand.mesh), "layout": cand.layout,
                    "remat": cand.remat, "overrides": [list(o) for o in cand.overrides()], "by": _by(r),
                    "cached": r["cached"], "predicted_step_time_s": p["step_time_s"], "predicted_mfu": p["mfu"],
                    "memory_per_device_bytes": r["memory_bytes"],
                    "compiled_peak_estimate_bytes": r["compiled_peak_bytes"],
                    "collective_bytes_per_step": r["collective_bytes"], "bound_by": p["bound_by"],
                    "why": _why(i, r, rows)})
    return out


TERMS = {"matmul_s": "matmul time (less remat or bubble)", "memory_s": "memory traffic",
         "exposed_collectives_s": "tensor/stage collectives", "overlapped_collectives_s": "data/fsdp traffic"}


def _why(i: int, r: dict, rows: list[dict]) -> str:
    """What sets this layout apart: against the runner-up for the best, against the best otherwise."""
    p = r["prediction"]
    if len(rows) == 1:
        return f"the only feasible one; bound by {p['bound_by']}"
    q = (rows[1] if i == 0 else rows[0])["prediction"]
    diffs = {k: q[k] - p[k] for k in TERMS}
    if i == 0:
        k = max(diffs, key=diffs.get)
        return (f"{100 * (q['step_time_s'] / p['step_time_s'] - 1):.1f}% faster than #2: "
                f"{TERMS[k]} {1e3 * p[k]:.3g} ms vs {1e3 * q[k]:.3g} ms")
    k = min(diffs, key=diffs.get)
    return (f"{100 * (p['step_time_s'] / q['step_time_s'] - 1):.1f}% slower than #1: "
            f"{TERMS[k]} {1e3 * p[k]:.3g} ms vs {1e3 * q[k]:.3g} ms")


def table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["no layout ranked: check the dropped counts above"]
    head = ["#", "layout", "by", "step ms", "MFU", "GiB/device", "MiB sent", "why"]
    body = [[str(r["rank"]), r["candidate"], r["by"], f"{1e3 * r['predicted_step_time_s']:.4g}",
             f"{100 * r['predicted_mfu']:.1f}%", f"{r['memory_per_device_bytes'] / GiB:,.2f}",
             f"{r['collective_bytes_per_step'] / MiB:,.0f}", r["why"]] for r in rows]
    return text.table([head] + body, right={0, 3, 4, 5, 6})
