"""Where the suite's time goes, and its budget: a pytest plugin that tests/conftest.py loads.

Every test report carries the seconds JAX spent in that test's process (xdist worker)
tracing, lowering and compiling, read from jax.monitoring's duration events; compiling
includes reading the persistent compilation cache, and `jax_cache_hits` counts the programs
taken from it. Subprocesses a test starts are not seen: their time is the test's alone.

The files run longest first (`pytest_collection_modifyitems`, by the seconds each took in
the last whole run, tests/support/seconds_by_file.json), and pyproject's `--dist loadfile
--no-loadscope-reorder` gives each xdist worker whole files in that order: a file's
module-scoped programs are built once, and the two workers finish together.

The budget is counted in references: before the tests start (in the controller, before
xdist starts its workers), a child process times the reference, one trace + lower + XLA
compile + run of a fixed program (a one-layer transformer's train step over 8 CPU devices,
with the suite's XLA flags and no compilation cache), REFERENCE_REPEATS times after one
warm-up, and keeps the median. N references are N times that: a host twice as slow gets
twice the minutes, so the run fails when the suite slows, not when the host does. A run
past its budget times the reference again before failing, and the slower of the two counts
(the host may have slowed, or got busier, during the run). A change to the suite's XLA
flags or to JAX moves the reference with the suite: the budget does not judge those.

Options (the controller reads them; .ci/run passes --suite-report, --suite-budget-refs and
--suite-figures):
  --suite-report=N     after the run, the N slowest tests (setup + call + teardown) with their
                       in-process JAX share, and the seconds by file;
  --suite-budget-refs=N  the run fails, with one line saying so, past N references of wall
                       time; the report gives the reference's seconds and the budget in minutes;
  --suite-budget=MIN   the same for an absolute MIN minutes of wall time (any host);
  --suite-figures=check|write   README.md's "N tests" and "M min S s" figures against this
                       run: `check` fails a whole-suite run whose test count differs,
                       `write` puts this run's figures in README.md and its seconds by
                       file in seconds_by_file.json.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import re
import subprocess
import sys
import time
from typing import NamedTuple

import jax
import pytest

COMPILE = "/jax/core/compile/backend_compile_duration"
PHASES = {"/jax/core/compile/jaxpr_trace_duration": "jax_trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "jax_lower_s", COMPILE: "jax_compile_s"}
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
    group.addoption("--suite-budget-refs", type=float, default=0.0, metavar="N",
                    help="fail the run when it takes longer than N references: N times the seconds of "
                         "one compile of a fixed program, timed on this host before the tests start")
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
    """Runs before xdist's own (trylast) starts the workers: the reference is timed alone."""
    config = session.config
    config._suite_t0 = time.monotonic()
    if _controller(config) and config.getoption("suite_budget_refs"):
        config._suite_reference = time_reference()


# The reference: a fixed program, built afresh and compiled REFERENCE_REPEATS times (after one
# warm-up) in a child process of its own, so nothing the suite's processes cached or
# started is in it: no persistent compilation cache, no program this process traced
# before. The child inherits the suite's XLA flags (tests/conftest.py), so it compiles as
# the tests compile; it counts its compiles and cache hits, and a reference that was not
# compiled every time is no reference (`Reference.error`).
REFERENCE_REPEATS = 5
REFERENCE_TIMEOUT_S = 300


class Reference(NamedTuple):
    seconds: tuple[float, ...] = ()      # each timed repeat's wall seconds
    cpu_seconds: tuple[float, ...] = ()  # and its process's CPU seconds: far less than the wall, a busy host
    error: str = ""                      # why there is no reference, else ""

    @property
    def value(self) -> float:
        """The median repeat: on a busy host the tests get the share of the cores that a
        typical repeat got, not the best moment's."""
        return statistics.median(self.seconds)

    def describe(self) -> str:
        cpu = statistics.median(self.cpu_seconds) if self.cpu_seconds else float("nan")
        if len(self.seconds) == 1:
            return f"{self.value:.3f} s (CPU {cpu:.3f} s), one compile of the reference program"
        return (f"{self.value:.3f} s (CPU {cpu:.3f} s), the median of {len(self.seconds)} compiles of the "
                f"reference program ({min(self.seconds):.3f}-{max(self.seconds):.3f} s)")


def time_reference(repeats: int = REFERENCE_REPEATS) -> Reference:
    """Times the reference in a child process (about 1 s of start-up, then ~0.6 s a compile on
    a 2-core host)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAX_ENABLE_COMPILATION_CACHE="false", JAX_PLATFORMS="cpu")
    try:
        # Run as a file, not a module, but without its folder first on sys.path (`python FILE`
        # puts it there, where tests/support's modules would shadow any of the same name).
        run = (f"import runpy, sys; sys.argv = ['', '--reference', '{repeats}']; "
               f"runpy.run_path({__file__!r}, run_name='__main__')")
        done = subprocess.run([sys.executable, "-c", run], env=env, capture_output=True, text=True,
                              timeout=REFERENCE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Reference(error=f"timing it took over {REFERENCE_TIMEOUT_S} s")
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return Reference(error=f"its process ended {done.returncode}: {why}")
    got = json.loads(lines[-1])
    if got["compiles"] != repeats + 1 or got["cache_hits"]:
        return Reference(error=f"{got['compiles']} XLA compiles and {got['cache_hits']} cache hits "
                               f"for {repeats + 1} fresh programs")
    return Reference(seconds=tuple(got["seconds"]), cpu_seconds=tuple(got["cpu_seconds"]))


def _reference_program():
    """A fresh jit (traced, lowered and compiled anew) of a one-layer transformer's train step
    on a data 2 x model 4 mesh of CPU devices, with its arguments."""
    import numpy as np
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    d, heads, t, b, vocab = 64, 4, 32, 8, 256
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    rng = np.random.default_rng(0)
    shapes = {"emb": ((vocab, d), P()), "q": ((d, heads, d // heads), P(None, "model")),
              "k": ((d, heads, d // heads), P(None, "model")), "v": ((d, heads, d // heads), P(None, "model")),
              "o": ((heads, d // heads, d), P("model")), "up": ((d, 4 * d), P(None, "model")),
              "down": ((4 * d, d), P("model"))}
    specs = {k: NamedSharding(mesh, spec) for k, (_, spec) in shapes.items()}
    params = {k: jax.device_put((rng.standard_normal(shape) * 0.02).astype(np.float32), specs[k])
              for k, (shape, _) in shapes.items()}
    moments = jax.tree.map(jnp.zeros_like, params)
    tokens = jax.device_put(rng.integers(0, vocab, (b, t + 1)).astype(np.int32), NamedSharding(mesh, P("data")))
    causal = np.tril(np.ones((t, t), bool))

    def loss(p, tokens):
        x = p["emb"][tokens[:, :-1]]
        h = (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)
        q, k, v = (jnp.einsum("btd,dhk->bthk", h, p[n]) for n in "qkv")
        s = jnp.where(causal, jnp.einsum("bqhk,bthk->bhqt", q, k) / np.sqrt(d // heads), -1e9)
        x = x + jnp.einsum("bqhk,hkd->bqd", jnp.einsum("bhqt,bthk->bqhk", jax.nn.softmax(s, -1), v), p["o"])
        x = x + jax.nn.gelu(x @ p["up"]) @ p["down"]
        logp = jax.nn.log_softmax(x @ p["emb"].T)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

    def step(p, m, tokens):
        value, g = jax.value_and_grad(loss)(p, tokens)
        m = jax.tree.map(lambda m, g: 0.9 * m + g, m, g)
        return jax.tree.map(lambda p, m: p - 1e-3 * m / (jnp.sqrt(jnp.abs(m)) + 1e-8), p, m), m, value

    def fresh():
        return jax.jit(lambda p, m, x: step(p, m, x), in_shardings=(specs, specs, tokens.sharding),
                       out_shardings=(specs, specs, NamedSharding(mesh, P())))
    return fresh, (params, moments, tokens)


def _time_reference_here(repeats: int) -> dict:
    """In the child: one warm-up and `repeats` timed builds of the reference; prints JSON."""
    jax.config.update("jax_num_cpu_devices", 8)
    counts = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: counts.update(["compiles"] if event == COMPILE else []))
    jax.monitoring.register_event_listener(
        lambda event, **_: counts.update(["cache_hits"] if event == CACHE_HIT else []))
    fresh, args = _reference_program()
    counts.clear()  # making the arguments compiles programs of its own
    seconds, cpu_seconds = [], []
    for _ in range(repeats + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(fresh().lower(*args).compile()(*args))
        seconds.append(round(time.perf_counter() - t0, 4))
        cpu_seconds.append(round(time.process_time() - c0, 4))
    return {"seconds": seconds[1:], "cpu_seconds": cpu_seconds[1:], "compiles": counts["compiles"],
            "cache_hits": counts["cache_hits"]}


def host_budget(refs: float, *references: Reference) -> float:
    """Seconds of wall time that `refs` references allow: refs x the slower reference."""
    return refs * max(r.value for r in references)


def judge_refs(wall: float, refs: float, start: Reference, retime=None) -> tuple[list[str], bool]:
    """(lines for the report, whether the run fails) for --suite-budget-refs; a run past its
    budget retimes the reference (`retime()`, by default `time_reference()`) and counts the
    slower of the two."""
    if start.error:
        return [f"SUITE BUDGET: no reference, so no budget: {start.error}"], True
    timed = [start]
    lines = [f"suite reference: {start.describe()}, timed before the tests"]
    if wall > host_budget(refs, start):
        end = (retime or time_reference)()
        if end.error:
            return lines + [f"SUITE BUDGET: the reference timed again after the run failed: {end.error}"], True
        lines.append(f"suite reference, timed again after the run: {end.describe()}")
        timed.append(end)
    budget = host_budget(refs, *timed)
    reference = max(r.value for r in timed)
    said = (f"{minutes(wall)} of wall time ({wall / reference:,.0f} references) "
            f"{'past' if wall > budget else 'within'} the budget of {refs:,g} x {reference:.3f} s = {minutes(budget)}")
    if wall > budget:
        return lines + [f"SUITE OVER BUDGET: {said} (--suite-budget-refs); the slowest tests: --suite-report=25"], True
    return lines + [f"suite budget: {said} (--suite-budget-refs)"], False


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
    if refs := config.getoption("suite_budget_refs"):
        lines, failed = judge_refs(wall, refs, config._suite_reference)
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


if __name__ == "__main__" and sys.argv[1:2] == ["--reference"]:
    print(json.dumps(_time_reference_here(int(sys.argv[2]))))
