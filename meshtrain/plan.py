"""Plan a layout before renting the hardware: memory, collectives and step time per
device, from the real train step compiled on simulated devices.

    meshtrain plan --config=gpt2_medium_dp8_tp4 [--config.key=value ...]
        [--hardware=h100|h200|a100|a100_40gb|FILE.json] [--json]
    meshtrain plan --config=NAME --search --devices=32 [--nodes=4]
        [--budget=600] [--top=10] [--jobs=2] [--margin=10] [--layouts=dp,fsdp,...]
        [--remat=none,...] [--cache_dir=DIR] [--json]
    meshtrain plan --config=NAME --verify [--steps=3] [--json]
    meshtrain plan --config=NAME --largest [--hardware=...] [--json]

The first form compiles the config's train step for its mesh on simulated CPU devices
(shapes only: no parameter memory) and reports per-device memory beside the formulas,
collectives per step by kind and mesh axis beside their lower bounds, FLOPs, and a
predicted step time and MFU on the hardware. The second enumerates meshes, layouts,
remat policies and pipeline microbatches for N devices, predicts each by the formulas,
compiles those within --margin percent of the best, ranks them, and prints the winner as
the `meshtrain train` command that runs it. The layout linter runs first. The third runs
the config's mesh and layout on a shrunk model, in float32, against one device, and fails
(status 1) naming the parameters whose gradients differ. The fourth answers how deep a
model of the config's width fits its devices, without and with host offload (train.offload),
by the formulas alone. docs/planner.md explains every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys

from meshtrain import cli, mesh as mesh_lib
from meshtrain.errors import UserError, warn

SEARCH_FLAGS = ("devices", "nodes", "budget", "top", "jobs", "margin", "cache_dir", "layouts", "remat")
# Defaults of the search flags, applied in `execute`: argparse keeps None for "not given",
# so that giving one without --search is refused.
SEARCH_DEFAULTS = {"budget": 600, "top": 10, "jobs": 2, "margin": 10}
VERIFY_STEPS = 3


def parser() -> cli.Parser:
    from meshtrain.parallel.layouts.presets import PRESET_AXES
    from meshtrain.planner import hardware, search
    p = cli.command_parser("meshtrain plan", __doc__, config=True)
    p.add_argument("--hardware", default="h100",
                   help=f"the hardware table entry to predict for ({', '.join(hardware.TABLE)}) "
                        f"or a JSON file of the same fields")
    p.add_argument("--json", action="store_true", help="print the report (or the ranking) as JSON")
    s = p.add_argument_group("search (--search --devices=N)")
    s.add_argument("--search", action="store_true",
                   help="rank meshes, layouts, remat policies and microbatches for --devices")
    s.add_argument("--devices", type=_positive, metavar="N", help="the device count to plan for")
    s.add_argument("--nodes", type=_positive, metavar="K", help="nodes the devices are on (mesh.dcn)")
    s.add_argument("--budget", type=_positive, metavar="SECONDS",
                   help=f"wall time for compiling candidates, the rest ranked by formula "
                        f"(default {SEARCH_DEFAULTS['budget']})")
    s.add_argument("--top", type=_positive, metavar="N",
                   help=f"rows of the ranking to show (default {SEARCH_DEFAULTS['top']})")
    s.add_argument("--jobs", type=_positive, metavar="J",
                   help=f"compiling worker processes (default {SEARCH_DEFAULTS['jobs']})")
    s.add_argument("--margin", type=_percent, metavar="PCT",
                   help=f"compile the candidates the formulas predict within PCT%% of the best step time; "
                        f"the rest keep their formula figures (default {SEARCH_DEFAULTS['margin']})")
    s.add_argument("--layouts", type=_choices(tuple(PRESET_AXES)), metavar="A,B",
                   help=f"layout presets to try, from {', '.join(PRESET_AXES)} (default all)")
    s.add_argument("--remat", type=_choices(search.REMAT), metavar="A,B",
                   help=f"remat policies to try, from {', '.join(search.REMAT)} (default all)")
    s.add_argument("--cache_dir", metavar="DIR", help="keep compiled reports here between searches")
    p.add_argument("--largest", action="store_true",
                   help="the most layers of this width that fit the devices, without and with "
                        "train.offload (formulas only, nothing compiled)")
    v = p.add_argument_group("verify (--verify)")
    v.add_argument("--verify", action="store_true",
                   help="train a shrunk model on the config's mesh and layout and on one device, in "
                        "float32, and compare losses and gradients; status 1 when they differ")
    v.add_argument("--steps", type=_positive, metavar="N",
                   help=f"train steps to compare (default {VERIFY_STEPS})")
    return p


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"give a whole number >= 1, not {text!r}")
    return int(text)


def _percent(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"give a whole percentage >= 0, not {text!r}")
    return int(text)


def _choices(choices):
    """`dp,fsdp` -> ("dp", "fsdp"), each one of `choices`."""
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(",") if v.strip())
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{', '.join(bad) or 'nothing given'} not among "
                                             f"{', '.join(choices)}; give a comma-separated list of them")
        return values
    return parse


def execute(args) -> int:
    name, cfg = args.config_name, args.config
    given = [f for f in SEARCH_FLAGS if getattr(args, f) is not None]
    if not args.search and given:
        raise UserError(f"{', '.join('--' + f for f in given)} go with --search (--search --devices=N).")
    if args.steps is not None and not args.verify:
        raise UserError("--steps goes with --verify (--verify --steps=N).")
    if args.verify and args.search:
        raise UserError("--verify checks the config's own layout, --search ranks others: give one of them.")
    from meshtrain.planner import fast_compile, hardware
    hw = hardware.get(args.hardware)
    if args.largest:
        if args.search or args.verify:
            raise UserError("--largest answers for the config's own mesh and layout: give it without --search "
                            "or --verify.")
        from meshtrain.pictures import text
        from meshtrain.planner import capacity
        fits = capacity.largest(cfg, hw)
        print(json.dumps([dataclasses.asdict(f) for f in fits], indent=2) if args.json
              else text.largest(name, cfg, hw, fits))
        return 0
    # Before JAX starts; it sets XLA_FLAGS in this process's environment, which search
    # workers inherit (and so would any other child: a caller in-process, like a test,
    # restores it).
    fast_compile()
    if args.verify:
        return _verify(name, cfg, args.steps or VERIFY_STEPS, args.json)
    if args.search:
        from meshtrain.planner import search
        if args.devices is None:
            raise UserError("--search needs --devices=N, the device count to plan for.")
        result = search.run(name, cfg, args.overrides, hw, devices=args.devices, nodes=args.nodes,
                            budget_s=args.budget or SEARCH_DEFAULTS["budget"],
                            top=args.top or SEARCH_DEFAULTS["top"], jobs=args.jobs or SEARCH_DEFAULTS["jobs"],
                            cache_dir=args.cache_dir,
                            margin=(SEARCH_DEFAULTS["margin"] if args.margin is None else args.margin) / 100,
                            layouts=args.layouts, remats=args.remat or search.REMAT,
                            say=(lambda *a, **k: None) if args.json else print)
        if args.json:
            print(json.dumps(result, indent=2, default=str))
        return 0
    # The text report lists the linter's findings itself; with --json they go to stderr.
    report = plan_config(name, cfg, hw, say=warn if args.json else (lambda *a: None))
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        from meshtrain.pictures import text
        print(text.render(report))
    return 0


def _verify(name: str, cfg, steps: int, as_json: bool) -> int:
    """`--verify`: 0 when the layout matches one device, 1 when it does not."""
    from meshtrain.run import verify
    mesh_lib.simulate_cpu_devices(verify.mesh_shape(cfg))  # before anything starts the JAX backend
    say = functools.partial(print, file=sys.stderr if as_json else sys.stdout, flush=True)
    result = verify.run(name, cfg, steps, say=say)
    print(json.dumps(result, indent=2, default=str) if as_json else verify.render(result))
    return 0 if result["ok"] else 1


def plan_config(name: str, cfg, hw, say=print, devices=None) -> dict:
    """Lint, simulate the mesh's devices, build, compile and report one config. `devices`:
    the devices to build on (default all; a notebook with more simulated devices than
    the mesh passes `jax.devices()[:n]`)."""
    from meshtrain.planner import accumulation, lint, report as report_lib
    from meshtrain.run.experiment import Experiment, read_inputs, resolve
    shape = mesh_lib.parse_shape(cfg.mesh.shape)
    if -1 in shape.values():
        raise UserError(f"mesh.shape={cfg.mesh.shape!r} has an axis of size -1: the planner needs "
                        f"every size, e.g. --config.mesh.shape=data:8,tensor:4.")
    dcn = mesh_lib.parse_dcn(cfg.mesh.dcn, shape)
    mesh_lib.simulate_cpu_devices(shape)  # before anything starts the JAX backend
    inputs = read_inputs(cfg)
    cfg = resolve(cfg, inputs.init)
    findings = lint.lint(cfg, shape, dcn, hw=hw)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise UserError(" ".join(str(f) for f in errors))
    exp = Experiment.build(cfg, devices=devices, inputs=inputs, choose_gather=accumulation.for_hardware(hw))
    # Again with the model (and so the checks that need its parameters): it repeats every
    # check of the first run, whose warnings are therefore dropped, not printed twice.
    findings = lint.lint(cfg, dict(exp.mesh.shape), exp.dcn, exp.model, hw)
    for f in findings:
        say(f"lint: {f}")
    report = report_lib.plan(exp, hw)
    report["config_name"] = name
    report["lint"] = [dataclasses.asdict(f) for f in findings]
    report["accum_gather"] = accumulation.line(exp) if cfg.train.grad_accum_steps > 1 else None
    return report


run, main = cli.entry_points(parser, execute)


if __name__ == "__main__":
    sys.exit(main())
