"""List the shipped configs: what model each trains, on which mesh, under which layout.

    meshtrain configs [--json]

Names say model x mesh (`gpt2_medium_dp8_tp4`: GPT-2 medium on data=8 x tensor=4). Any
of them runs on a CPU-only machine on simulated devices; `meshtrain train
--config=NAME --print_config` shows every key of one.
"""

from __future__ import annotations

import json
import sys

from meshtrain import cli, config as config_lib


def parser() -> cli.Parser:
    p = cli.command_parser("meshtrain configs", __doc__)
    p.add_argument("--json", action="store_true", help="one JSON object per config instead of a table")
    return p


def describe(name: str) -> dict:
    """A config's headline: model (family, size, dims when set), mesh, layout, pipeline."""
    from meshtrain import models
    from meshtrain.parallel import layouts
    cfg = config_lib.load(name)
    m = cfg.model
    dims = models.size_dims(m)
    pipe = cfg.pipeline
    layout = layouts.get(cfg.layout)
    return {
        "name": name, "model": m.size if m.size.startswith(m.name) else f"{m.name} {m.size}",
        "size": (f"{dims['num_layers']} layers x {dims['embed_dim']}, {dims['seq_len']} tokens" if "seq_len" in dims
                 else f"{dims['num_layers']} layers, {dims['image_size']} px"),
        "mesh": cfg.mesh.shape, "layout": layout.name if layout.name in layouts.PRESETS else "own rules",
        "pipeline": (f"{pipe.schedule}, M={pipe.microbatches}" + (f", r={pipe.repeats}" if pipe.repeats > 1 else "")
                     if pipe.microbatches else ""),
        "dtype": m.dtype, "steps": cfg.train.steps,
    }


def execute(args) -> int:
    rows = [describe(name) for name in config_lib.available()]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    cols = ("name", "model", "size", "mesh", "layout", "pipeline", "dtype")
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols).rstrip())
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols).rstrip())
    print(f"\n{len(rows)} configs in {config_lib.CONFIG_DIR}. Run one: meshtrain train --config=NAME "
          f"--workdir=DIR; every key: meshtrain train --config=NAME --print_config")
    return 0


run, main = cli.entry_points(parser, execute)


if __name__ == "__main__":
    sys.exit(main())
