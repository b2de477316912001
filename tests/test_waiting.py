"""The multi-process tiers wait on real processes (support.processes.wait_for): a process that
dies before doing what a test waits for fails the test at once, with its status and its
log's last lines, instead of after the wait's timeout."""

import subprocess
import sys
import time

import pytest

from support.processes import wait_for


def test_a_process_that_ends_first_fails_the_wait_at_once_with_its_status_and_log(tmp_path):
    log = tmp_path / "p0.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", "print('ValueError: the last words'); raise SystemExit(3)"],
                                stdout=out, stderr=subprocess.STDOUT)
    proc.log = log
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as e:
        wait_for(lambda: False, timeout=60, what="step 5", procs=[proc])
    assert time.monotonic() - t0 < 30
    assert f"waiting for step 5: pid {proc.pid} ended with status 3 first" in str(e.value)
    assert "ValueError: the last words" in str(e.value)


def test_what_held_before_the_process_ended_passes():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    wait_for(lambda: True, timeout=1, what="anything", procs=[proc])
