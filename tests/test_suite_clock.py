"""The suite's clock (tests/support/suite_clock.py), on small suites of its own run by
pytester in this process: the report of the slowest tests with their JAX compile share,
the time budget, README.md's figures checked and written, and the longest files first."""

import json

import pytest

pytest_plugins = ["pytester"]

README = "# x\n\nThe suite is **{n} tests**; its last whole run took **{m}** on 2 cores.\n"
JITS = """
import time
import jax, jax.numpy as jnp

def test_compiles_one_program():
    salt = time.time()  # a program no earlier run compiled: no persistent cache hit
    f = jax.jit(lambda x: sum(jnp.sin(x * i + salt) for i in range(300)))
    assert f(jnp.ones(8)).shape == (8,)
"""


def run(pytester, *args):
    return pytester.runpytest_inprocess("-p", "support.suite_clock", "-p", "no:cacheprovider", *args)


def test_the_report_names_the_slowest_tests_with_their_compile_seconds(pytester):
    pytester.makepyfile(test_a=JITS, test_b="def test_nothing():\n    pass\n")
    r = run(pytester, "--suite-report=5")
    r.assert_outcomes(passed=2)
    out = r.stdout.str()
    assert "the 5 slowest tests (s: setup + call + teardown; JAX seconds in-process)" in out
    line = next(x for x in out.splitlines() if x.endswith("test_a.py::test_compiles_one_program"))
    assert float(line.split("compile")[1].split()[0]) > 0  # its jit compiled (or was read from the cache)
    assert "seconds by file" in out and "2 tests:" in out


def test_a_run_past_its_budget_fails_with_one_line(pytester):
    pytester.makepyfile("import time\n\ndef test_slow():\n    time.sleep(0.2)\n")
    r = run(pytester, "--suite-budget=0.001")  # 0.06 s
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.stdout.fnmatch_lines(["*SUITE OVER BUDGET: 0 min 0 s of wall time, past the budget of 0.001 min*"])
    r = run(pytester, "--suite-budget=5")
    assert r.ret == pytest.ExitCode.OK and "suite budget: 0 min 0 s of 5 min" in r.stdout.str()


def test_readme_figures_are_checked_against_the_run_and_written_from_it(pytester):
    pytester.makepyfile(test_a="def test_one():\n    pass\n\ndef test_two():\n    pass\n")
    readme = pytester.path / "README.md"
    readme.write_text(README.format(n="1,332", m="49 min 6 s"))
    r = run(pytester, "--suite-figures=check")
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.stdout.fnmatch_lines(["*SUITE FIGURES: README.md says 1,332 tests, this run ran 2*--suite-figures=write*"])
    r = run(pytester, "--suite-figures=write")
    assert r.ret == pytest.ExitCode.OK
    assert readme.read_text() == README.format(n="2", m="0 min 0 s")
    table = json.loads((pytester.path / "tests" / "support" / "seconds_by_file.json").read_text())
    assert list(table) == ["test_a.py"]
    assert run(pytester, "--suite-figures=check").ret == pytest.ExitCode.OK
    # A part of the suite is not the suite: nothing compared, nothing failed.
    r = run(pytester, "--suite-figures=check", "test_a.py::test_one")
    assert r.ret == pytest.ExitCode.OK and "not the whole suite" in r.stdout.str()


def test_files_run_longest_first_by_the_last_whole_run(pytester):
    for name in ("test_a", "test_b", "test_c"):
        pytester.makepyfile(**{name: "def test_it():\n    pass\n"})
    table = pytester.path / "tests" / "support" / "seconds_by_file.json"
    table.parent.mkdir(parents=True)
    table.write_text(json.dumps({"test_b.py": 90.0, "test_c.py": 10.0}))  # test_a untimed: the median, 50
    r = run(pytester, "--collect-only", "-q")
    assert [x.split("::")[0] for x in r.stdout.lines if "::" in x] == ["test_b.py", "test_a.py", "test_c.py"]
