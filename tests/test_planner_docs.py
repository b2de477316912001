"""docs/planner.md's generated tables (tools/docs_tables.py): every marker names a
registered table, and the page holds what the code writes today (one subprocess runs every
table once: it simulates the 32 devices the acceptance configs need)."""

import re
import subprocess
import sys

import pytest

from support.processes import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import docs_tables  # noqa: E402  (tools/ is no package)

MARKER = re.compile(r"^<!-- (end )?generated: ([\w-]+) -->$", re.M)


def test_every_marker_pairs_up_and_names_a_registered_table():
    text = docs_tables.DOC.read_text()
    marks = MARKER.findall(text)
    starts = [name for end, name in marks if not end]
    assert [name for end, name in marks if end] == starts  # each block closes, in order
    assert sorted(starts) == sorted(docs_tables.TABLES)    # each table is on the page, once


def test_regenerate_rewrites_only_between_markers(monkeypatch):
    monkeypatch.setitem(docs_tables.TABLES, "demo", "planner_tables:hardware_table")
    text = "before\n<!-- generated: demo -->\nstale\n<!-- end generated: demo -->\nafter\n"
    new, changed = docs_tables.regenerate(text, ["demo"])
    assert changed == ["demo"] and new.startswith("before\n") and new.endswith("after\n")
    assert "| `h100` |" in new and "stale" not in new
    assert docs_tables.regenerate(new, ["demo"]) == (new, [])  # idempotent
    with pytest.raises(KeyError, match="names no table"):
        docs_tables.regenerate("<!-- generated: nope -->\n<!-- end generated: nope -->\n")


def test_docs_planner_md_is_up_to_date():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "docs_tables.py"), "--check"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr + r.stdout
