"""The tables of docs/planner.md, written from the code: each sits between markers

    <!-- generated: NAME -->
    ...
    <!-- end generated: NAME -->

and is the markdown a function of TABLES returns. Regenerate them all, or check them:

    python tools/docs_tables.py            # rewrites docs/planner.md
    python tools/docs_tables.py --check    # exit 1 and name the stale tables

A table is registered with one line in TABLES, "NAME": "module:function" (a module of
tools/ or of meshtrain), the function taking no arguments and returning markdown. The generator simulates SIMULATED_DEVICES CPU
devices before any table runs, so a table may build and compile configs of up to that many
devices (`devices=jax.devices()[:n]`); keep them cheap: tests/test_planner_docs.py runs
them all once.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import re
import sys

# name -> "module:function"; the docs' markers name the key.
TABLES: dict[str, str] = {
    "hardware": "planner_tables:hardware_table",
    "ring-bandwidth": "planner_tables:ring_table",
    "survey-tp16": "planner_tables:survey_table",
    "acceptance": "planner_tables:acceptance_table",
    "zero-stages": "zero_table:markdown",
    "pipeline-schedules": "pipeline_table:markdown",
}
SIMULATED_DEVICES = 32
TOOLS = pathlib.Path(__file__).resolve().parent
DOC = TOOLS.parent / "docs" / "planner.md"
# A marker is a line of its own (prose may quote one inside backticks).
_BLOCK = re.compile(r"^(<!-- generated: ([\w-]+) -->\n)(.*?)^(<!-- end generated: \2 -->)$", re.S | re.M)


def render(name: str) -> str:
    """The markdown of table `name`, ending in a newline."""
    module, _, function = TABLES[name].partition(":")
    if str(TOOLS) not in sys.path:  # the tables of tools/, when this module is imported
        sys.path.insert(0, str(TOOLS))
    text = getattr(importlib.import_module(module), function)()
    return text.rstrip("\n") + "\n"


def regenerate(text: str, names=None) -> tuple[str, list[str]]:
    """`text` with every generated block (of `names`, default all) rewritten; and the names
    of the blocks that changed. A marker naming no registered table is an error."""
    changed: list[str] = []

    def replace(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise KeyError(f"docs marker 'generated: {name}' names no table; registered: {', '.join(TABLES)}")
        if names is not None and name not in names:
            return m.group(0)
        body = "\n" + render(name) + "\n"
        if body != m.group(3):
            changed.append(name)
        return m.group(1) + body + m.group(4)
    return _BLOCK.sub(replace, text), changed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/docs_tables.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table is out of date")
    p.add_argument("--doc", default=str(DOC), help="the markdown file (default: docs/planner.md)")
    p.add_argument("names", nargs="*", help="only these tables (default all)")
    args = p.parse_args(argv)
    from meshtrain import mesh as mesh_lib
    from meshtrain.planner import fast_compile
    fast_compile()
    mesh_lib.simulate_cpu_devices({"data": SIMULATED_DEVICES})
    path = pathlib.Path(args.doc)
    text, changed = regenerate(path.read_text(), args.names or None)
    if args.check:
        if changed:
            print(f"{path}: out of date: {', '.join(changed)}; run python tools/docs_tables.py",
                  file=sys.stderr)
        return 1 if changed else 0
    path.write_text(text)
    print(f"{path}: " + (f"rewrote {', '.join(changed)}" if changed else "up to date"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
