"""Plan a layout before renting the hardware: memory, collectives and step time.

    python -m meshtrain.plan --config=gpt2_medium_dp8_tp4 [--config.key=value ...]
        [--hardware=h100|h200|a100|a100_40gb|FILE.json] [--json]
    python -m meshtrain.plan --config=NAME --search --devices=32 [--nodes=4]
        [--budget=600] [--top=10] [--jobs=2] [--layouts=dp,fsdp,...] [--remat=none,...]
        [--cache_dir=DIR] [--json]

The first form compiles the config's train step for its mesh on simulated CPU devices
(shapes only: no parameter memory) and reports per-device memory beside the formulas,
collectives per step by kind and mesh axis beside their lower bounds, FLOPs, and a
predicted step time and MFU on the hardware. The second enumerates meshes, layouts,
remat policies and pipeline microbatches for N devices and ranks the ones that fit.
The layout linter runs first. docs/planner.md explains every figure.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from meshtrain import config as config_lib, mesh as mesh_lib
from meshtrain.errors import UserError, run_command, warn

FLAGS = ("hardware", "devices", "nodes", "budget", "top", "jobs", "cache_dir", "layouts", "remat")
SEARCH_FLAGS = ("devices", "nodes", "budget", "top", "jobs", "cache_dir", "layouts", "remat")
SWITCHES = ("json", "search")
USAGE = ("Usage: python -m meshtrain.plan --config=NAME [--config.key=value ...] [--hardware=h100] "
         "[--json] [--search --devices=N [--nodes=K] [--budget=SECONDS] [--top=10] [--jobs=J] "
         "[--layouts=dp,fsdp,...] [--remat=none,full] [--cache_dir=DIR]]")


def parse(argv: list[str]):
    """argv -> (config name, config with overrides, overrides, flags, switches)."""
    switches = {s for s in SWITCHES if f"--{s}" in argv}
    rest = [a for a in argv if a.removeprefix("--") not in SWITCHES]
    name, overrides, flags = config_lib.parse_args(rest)
    unknown = set(flags) - set(FLAGS)
    if unknown:
        raise UserError(f"Unknown flag(s) {', '.join('--' + f for f in sorted(unknown))}. {USAGE}")
    if "search" not in switches and set(SEARCH_FLAGS) & set(flags):
        raise UserError(f"{', '.join('--' + f for f in SEARCH_FLAGS)} go with --search. {USAGE}")
    cfg = config_lib.load(name)
    for key, value in overrides:
        config_lib.override(cfg, key, value)
    return name, cfg, overrides, flags, switches


def int_flag(flags: dict, key: str, default: int | None, least: int = 1) -> int | None:
    if key not in flags:
        return default
    try:
        value = int(flags[key])
    except ValueError:
        value = None
    if value is None or value < least:
        raise UserError(f"--{key}={flags[key]!r}: give a whole number >= {least}. {USAGE}")
    return value


def list_flag(flags: dict, key: str, choices) -> tuple[str, ...] | None:
    """`--layouts=dp,fsdp` -> ("dp", "fsdp"), each checked against `choices`; None if absent."""
    if key not in flags:
        return None
    values = tuple(v.strip() for v in flags[key].split(",") if v.strip())
    bad = [v for v in values if v not in choices]
    if bad or not values:
        raise UserError(f"--{key}={flags[key]!r}: {', '.join(bad) or 'nothing given'} not among "
                        f"{', '.join(choices)}. Give a comma-separated list of them.")
    return values


def run(argv: list[str]) -> int:
    name, cfg, overrides, flags, switches = parse(argv)
    from meshtrain.planner import fast_compile, hardware
    hw = hardware.get(flags.get("hardware", "h100"))
    # Before JAX starts; it sets XLA_FLAGS in this process's environment, which search
    # workers inherit (and so would any other child: a caller in-process, like a test,
    # restores it).
    fast_compile()
    if "search" in switches:
        from meshtrain.planner import search
        devices = int_flag(flags, "devices", None)
        if devices is None:
            raise UserError(f"--search needs --devices=N, the device count to plan for. {USAGE}")
        result = search.run(name, cfg, overrides, hw, devices=devices, nodes=int_flag(flags, "nodes", None),
                            budget_s=int_flag(flags, "budget", 600), top=int_flag(flags, "top", 10),
                            jobs=int_flag(flags, "jobs", 2), cache_dir=flags.get("cache_dir"),
                            layouts=list_flag(flags, "layouts", tuple(search.PRESET_AXES)),
                            remats=list_flag(flags, "remat", search.REMAT) or search.REMAT,
                            say=(lambda *a, **k: None) if "json" in switches else print)
        if "json" in switches:
            print(json.dumps(result, indent=2, default=str))
        return 0
    report = plan_config(name, cfg, hw, say=warn if "json" in switches else print)
    if "json" in switches:
        print(json.dumps(report, indent=2, default=str))
    else:
        from meshtrain.planner import text
        print(text.render(report))
    return 0


def plan_config(name: str, cfg, hw, say=print, devices=None) -> dict:
    """Lint, simulate the mesh's devices, build, compile and report one config. `devices`:
    the devices to build on (default all; a notebook with more simulated devices than
    the mesh passes `jax.devices()[:n]`)."""
    from meshtrain import lint
    shape = mesh_lib.parse_shape(cfg.mesh.shape)
    if -1 in shape.values():
        raise UserError(f"mesh.shape={cfg.mesh.shape!r} has an axis of size -1: the planner needs "
                        f"every size, e.g. --config.mesh.shape=data:8,tensor:4.")
    dcn = mesh_lib.parse_dcn(cfg.mesh.dcn, shape)
    findings = lint.lint(cfg, shape, dcn)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise UserError(" ".join(str(f) for f in errors))
    mesh_lib.simulate_cpu_devices(shape)
    from meshtrain.experiment import Experiment
    from meshtrain.planner import report as report_lib
    exp = Experiment.build(cfg, devices=devices)
    findings = _unique(findings + lint.lint(cfg, dict(exp.mesh.shape), exp.dcn, exp.model))
    for f in findings:
        say(f"lint: {f}")
    report = report_lib.plan(exp, hw)
    report["config_name"] = name
    report["lint"] = [dataclasses.asdict(f) for f in findings]
    return report


def _unique(findings: list) -> list:
    seen, out = set(), []
    for f in findings:
        if str(f) not in seen:
            seen.add(str(f))
            out.append(f)
    return out


def main(argv: list[str] | None = None) -> int:
    return run_command(run, argv, "meshtrain.plan")


if __name__ == "__main__":
    sys.exit(main())
