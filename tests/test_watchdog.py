"""The hang watchdog and the straggler judge in one process: bounds, reports, stragglers
named or not (two processes' watchdogs talking through JAX's store: tests/test_coordination.py). Real processes that hang are tests/test_hangs.py."""

import io
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from meshtrain.errors import UserError
from meshtrain.run import stragglers
from meshtrain.run.watchdog import AUTO_FLOOR_S, AUTO_MULTIPLE, HANG_STATUS, Watchdog, check_config
from support.processes import ENV, ROOT, wait_for


class Exits:
    """Stands in for os._exit: records the status and when."""

    def __init__(self):
        self.status, self.at = None, None

    def __call__(self, status):
        self.status, self.at = status, time.monotonic()


def stalled_input(event):  # the name the stack must show
    event.wait()


def test_a_stalled_loop_is_reported_with_its_step_and_stack_and_exits_3():
    out, exits, release = io.StringIO(), Exits(), threading.Event()
    w = Watchdog(1.0, 30, out=out, exit=exits).start()

    def loop():
        for step in range(1, 4):
            w.dispatched(step)
            with w.waiting():
                time.sleep(0.01)
            w.finished(step)
        stalled_input(release)

    t = threading.Thread(target=loop, name="the-loop")
    t.start()
    last = time.monotonic()
    try:
        wait_for(lambda: exits.status is not None, timeout=20, what="the watchdog")
    finally:
        release.set()
        t.join()
        w.stop()
    assert exits.status == HANG_STATUS == 3
    assert 1.0 <= exits.at - last < 3.0
    report = out.getvalue()
    assert report.startswith("meshtrain: error: hang in step 4: process 0 (host ")
    assert "in its own code (input, host code) before dispatching step 4 (last finished step 3)" in report
    assert "longer than the bound on a step (train.hang_timeout=1)" in report
    assert "Thread the-loop" in report and "in stalled_input" in report
    assert report.rstrip().endswith("exits with status 3 (a hang).")


def test_saves_and_evals_get_the_busy_bound_and_do_not_eat_into_the_next_step():
    out, exits = io.StringIO(), Exits()
    w = Watchdog(1.0, 4.0, out=out, exit=exits).start()
    try:
        w.dispatched(1)
        w.finished(1)
        with w.busy("checkpoint save"):
            time.sleep(2.0)  # twice the step bound
        time.sleep(0.7)      # the next step's bound starts after the save
        w.dispatched(2)
        w.finished(2)
        assert exits.status is None, out.getvalue()
        with w.busy("evaluation"):
            wait_for(lambda: exits.status is not None, timeout=20, what="the busy bound")
    finally:
        w.stop()
    assert "busy with evaluation after step 2" in out.getvalue()
    assert "the bound on evaluation (train.hang_timeout_busy=4)" in out.getvalue()


def test_the_bound_first_step_auto_and_off():
    w = Watchdog(None, 600)
    assert w.bound() == (600, "the first step (train.hang_timeout_busy=600)")
    w.dispatched(1)
    w.finished(1)
    assert w.bound()[0] == AUTO_FLOOR_S  # armed, with no step time yet: the floor
    w.intervals.extend([0.1] * 9)
    assert w.bound()[0] == AUTO_FLOOR_S
    w.intervals.extend([30.0] * 10)      # the median moves to 30 s
    assert w.bound()[0] == AUTO_MULTIPLE * 30.0
    off = Watchdog.off().start()
    assert off.thread is None and off.bound() is None


def test_own_time_leaves_out_waiting_for_the_devices_and_saving():
    """Per step: 50 ms of own work, 100 ms waiting, and a 200 ms save every other step:
    own time 50 ms, step time 150 ms (saves are not steps), in windows of 2 steps."""
    w = Watchdog(0, 0, straggler_every=2)
    for step in range(1, 8):
        time.sleep(0.05)               # input and host code
        with w.waiting():
            time.sleep(0.1)            # the dispatch waits for the devices
        w.dispatched(step)
        w.finished(step - 1)
        if step % 2 == 0:
            with w.busy("checkpoint save"):
                time.sleep(0.2)
    summary = w.stragglers()
    assert summary["windows"] == 4 and summary["named"] == []
    (me,) = summary["processes"]
    assert 0.05 <= me["own_s_per_step"] < 0.08, summary
    assert 0.15 <= me["step_s"] < 0.2, summary


@pytest.mark.parametrize("key,value", [("hang_timeout", -1), ("hang_timeout", 0.5), ("hang_timeout", "5"),
                                       ("hang_timeout_busy", -2), ("straggler_every", -1),
                                       ("straggler_fraction", 0.0)])
def test_bad_settings_are_user_errors(make_config, key, value):
    cfg = make_config("gpt2_tiny_dp8")
    with cfg.unlocked():
        cfg.train[key] = value
    with pytest.raises(UserError, match=f"train.{key}="):
        check_config(cfg.train)


def test_the_judge_names_a_process_slow_in_two_windows_in_a_row_once():
    table = [{"process": p, "host": "h", "pid": 100 + p} for p in range(3)]
    judge = stragglers.Judge(3, 10, 0.1, table)
    even = lambda w, slow=0.0: {0: [[w, 0.010, 0.2]], 1: [[w, 0.012 + slow, 0.2]], 2: [[w, 0.012, 0.2]]}
    assert judge.add(even(0)) == [] and judge.add(even(1, slow=0.15)) == []  # one slow window: no
    assert judge.add(even(2)) == []                                          # it recovered
    assert judge.add(even(3, slow=0.15)) == []
    said = judge.add(even(4, slow=0.15))                                     # two in a row
    assert len(said) == 1 and said[0].startswith("process 1 (host h, pid 101) is a straggler: in steps 31-50")
    assert "0.162 s against a median of 0.011 s" in said[0]
    assert judge.add(even(5, slow=0.15)) == []                               # said once
    assert judge.add({0: [[6, 0.01, 0.2]]}) == []                            # not all reported yet
    summary = judge.summary()
    assert summary["named"] == [1] and summary["windows"] == 6
    assert [round(p["own_s_per_step"], 3) for p in summary["processes"]] == [0.01, 0.162, 0.012]


def test_an_even_job_and_small_differences_are_not_named():
    judge = stragglers.Judge(2, 5, 0.1, [{"host": "h", "pid": 1}, {"host": "h", "pid": 2}])
    for w in range(10):  # 15 ms apart on a 200 ms step: under 10% of it
        assert judge.add({0: [[w, 0.010, 0.2]], 1: [[w, 0.025, 0.2]]}) == []
    assert judge.summary()["named"] == []


GIL_HOLDER = textwrap.dedent("""
    import sys, time
    from meshtrain.run.watchdog import Watchdog
    w = Watchdog(2.0, 30).start()
    for step in (1, 2, 3):
        w.dispatched(step)
        w.finished(step)
    time.sleep(0.8)  # a tick of the watchdog arms the backstop at the step bound, 2 s

    def holds_the_gil():  # the name the dump must show
        sys.setswitchinterval(1e6)  # no other Python thread runs again: the watchdog's cannot
        end = time.monotonic() + 60
        while time.monotonic() < end:
            pass

    holds_the_gil()
    print("not stopped")
""")


def test_a_thread_holding_the_gil_is_stopped_by_faulthandlers_backstop():
    """The watchdog's thread cannot run while another holds the GIL; faulthandler's C thread,
    re-armed at every tick of it, dumps the stacks and exits 1 after one bound."""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", GIL_HOLDER], capture_output=True, text=True, env=ENV,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 1, done.stderr[-2000:]
    assert time.monotonic() - t0 < 30 and "not stopped" not in done.stdout
    assert "Timeout (0:00:02)!" in done.stderr
    assert "in holds_the_gil" in done.stderr
    assert done.stderr.count("Thread 0x") >= 2  # every thread's stack: the watchdog's too
