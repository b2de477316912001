"""Where the suite's time goes, and its budget: a pytest plugin that tests/conftest.py loads.

Every test report carries the seconds JAX spent in that test's process (xdist worker)
tracing, lowering and compiling, read from jax.monitoring's duration events; compiling
includes reading the persistent compilation cache, and `jax_cache_hits` counts the programs
taken from it. Subprocesses a test starts are not seen: their time is the test's alone.

The files run longest first (`pytest_collection_modifyitems`, by the seconds each took in
the last whole run, tests/support/seconds_by_file.json), and pyproject's `--dist loadfile
--no-loadscope-reorder` gives each xdist worker whole files in that order: a file's
module-scoped programs are built once, and the two workers finish together.

Options (the controller reads them; .ci/run passes all three):
  --suite-report=N     after the run, the N slowest tests (setup + call + teardown) with their
                       in-process JAX share, and the seconds by file;
  --suite-budget=MIN   the run fails, with one line saying so, past MIN minutes of wall time;
  --suite-figures=check|write   README.md's "N tests" and "M min S s" figures against this
                       run: `check` fails a whole-suite run whose test count differs,
                       `write` puts this run's figures in README.md and its seconds by
                       file in seconds_by_file.json.
"""

from __future__ import annotations

import collections
import json
import statistics
import re
import time

import jax
import pytest

PHASES = {"/jax/core/compile/jaxpr_trace_duration": "jax_trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "jax_lower_s",
          "/jax/core/compile/backend_compile_duration": "jax_compile_s"}
CACHE_HIT = "/jax/compilation_cache/cache_hits"
# Both under the run's root directory (the repository's, for the suite).
README = "README.md"
SECONDS_BY_FILE = "tests/support/seconds_by_file.json"
# The README's figures: "**1,332 tests**" and "last whole run took **12 min 5 s**".
COUNT = re.compile(r"(?<=\*\*)(\d[\d,]*)(?= tests\*\*)")
MINUTES = re.compile(r"(?<=last whole run took \*\*)\d+ min \d+ s(?=\*\*)")

_seconds: collections.Counter = collections.Counter()


def _on_duration(event: str, duration: float, **_) -> None:
    if event in PHASES:
        _seconds[PHASES[event]] += duration


def _on_event(event: str, **_) -> None:
    if event == CACHE_HIT:
        _seconds["jax_cache_hits"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def pytest_addoption(parser):
    group = parser.getgroup("suite", "the suite's clock (tests/support/suite_clock.py)")
    group.addoption("--suite-report", type=int, default=0, metavar="N",
                    help="print the N slowest tests with their in-process JAX trace/lower/compile seconds")
    group.addoption("--suite-budget", type=float, default=0.0, metavar="MIN",
                    help="fail the run when it takes longer than MIN minutes of wall time")
    group.addoption("--suite-figures", choices=("check", "write"), default=None,
                    help="check README.md's test count against this run, or write this run's figures there")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries that phase's JAX seconds (xdist sends them to the controller)."""
    outcome = yield
    report = outcome.get_result()
    report.user_properties.extend((k, round(v, 3)) for k, v in sorted(_seconds.items()))
    _seconds.clear()


def pytest_collection_modifyitems(config, items):
    """Longest files first (a file not yet timed counts as the median file); within a file
    the order is the file's own."""
    table = config.rootpath / SECONDS_BY_FILE
    seconds = json.loads(table.read_text()) if table.exists() else {}
    default = statistics.median(seconds.values()) if seconds else 0.0
    first_seen = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::")[0], len(first_seen))
    items.sort(key=lambda item: (-seconds.get(path := item.nodeid.split("::")[0], default), first_seen[path]))


def _controller(config) -> bool:
    return not hasattr(config, "workerinput")


def pytest_sessionstart(session):
    session.config._suite_t0 = time.monotonic()


def _tests(terminalreporter) -> dict[str, dict[str, float]]:
    """{nodeid: {"s": setup + call + teardown seconds, "jax_compile_s": ..., ...}}"""
    out: dict[str, dict[str, float]] = collections.defaultdict(collections.Counter)
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "when", None) in ("setup", "call", "teardown"):
                out[r.nodeid]["s"] += r.duration
                for k, v in r.user_properties:
                    if k.startswith("jax_"):
                        out[r.nodeid][k] += v
    return out


def _jax(t) -> str:
    return (f"trace {t['jax_trace_s']:5.1f}  lower {t['jax_lower_s']:5.1f}  compile {t['jax_compile_s']:6.1f}"
            f"  hits {int(t['jax_cache_hits']):4d}")


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


def _whole_suite(config) -> bool:
    """A run of every test: no file or node named, nothing deselected by -k or -m."""
    return (config.args_source != pytest.Config.ArgsSource.ARGS and not config.getoption("keyword")
            and not config.getoption("markexpr"))


def _figures(mode: str, tests: dict, wall: float, config) -> tuple[str, bool]:
    """(what to say, whether the run fails) for --suite-figures."""
    count = len(tests)
    readme, table = config.rootpath / README, config.rootpath / SECONDS_BY_FILE
    text = readme.read_text() if readme.exists() else ""
    said = COUNT.search(text)
    if not said or not MINUTES.search(text):
        return "README.md has no '**N tests**' and 'last whole run took **M min S s**' to compare", True
    if not _whole_suite(config):
        return "not the whole suite: README.md not compared", False
    if mode == "write":
        readme.write_text(MINUTES.sub(minutes(wall), COUNT.sub(f"{count:,}", text, count=1), count=1))
        by_file = collections.Counter()
        for nodeid, t in tests.items():
            by_file[nodeid.split("::")[0]] += t["s"]
        table.parent.mkdir(parents=True, exist_ok=True)
        table.write_text(json.dumps({f: round(s, 1) for f, s in by_file.most_common()}, indent=0) + "\n")
        return f"README.md now says {count:,} tests in {minutes(wall)}; {SECONDS_BY_FILE} has its seconds by file", False
    if int(said.group(1).replace(",", "")) != count:
        return (f"README.md says {said.group(1)} tests, this run ran {count:,}: run the README's test command "
                f"with --suite-figures=write to put this run's figures there"), True
    return f"README.md's {said.group(1)} tests are this run's", False


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    """Runs before the terminal summary: measures, judges, and sets the exit status."""
    config = session.config
    if not _controller(config):
        return
    wall = time.monotonic() - config._suite_t0
    tests = _tests(config.pluginmanager.get_plugin("terminalreporter"))
    lines, failed = [], False
    if budget := config.getoption("suite_budget"):
        if wall > budget * 60:
            lines.append(f"SUITE OVER BUDGET: {minutes(wall)} of wall time, past the budget of {budget:g} min "
                         f"(--suite-budget); the slowest tests: --suite-report=25")
            failed = True
        else:
            lines.append(f"suite budget: {minutes(wall)} of {budget:g} min")
    if mode := config.getoption("suite_figures"):
        said, bad = _figures(mode, tests, wall, config)
        lines.append(("SUITE FIGURES: " if bad else "suite figures: ") + said)
        failed |= bad
    config._suite = (wall, tests, lines, failed)
    if failed and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    if not _controller(config) or not hasattr(config, "_suite"):
        return
    wall, tests, lines, failed = config._suite
    write = terminalreporter.write_line
    if n := config.getoption("suite_report"):
        terminalreporter.section(f"the {n} slowest tests (s: setup + call + teardown; JAX seconds in-process)")
        for nodeid, t in sorted(tests.items(), key=lambda kv: -kv[1]["s"])[:n]:
            write(f"{t['s']:7.1f} s  {_jax(t)}  {nodeid}")
        by_file = collections.defaultdict(collections.Counter)
        for nodeid, t in tests.items():
            by_file[nodeid.split("::")[0]].update(t)
        terminalreporter.section("seconds by file")
        for path, t in sorted(by_file.items(), key=lambda kv: -kv[1]["s"])[:n]:
            write(f"{t['s']:7.1f} s  {_jax(t)}  {path}")
        total = collections.Counter()
        for t in tests.values():
            total.update(t)
        write(f"{len(tests):,} tests: {total['s']:,.0f} s in tests ({_jax(total)}), {minutes(wall)} of wall time")
    for line in lines:
        write(line, red=failed, bold=failed)
