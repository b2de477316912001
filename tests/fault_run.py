"""Test-only: `python -m meshtrain.train ARGS` with a fault in the data path, never a user's code path.

    MESHTRAIN_TEST_FAULT='{"kind": "block", "step": 7}' python tests/fault_run.py ARGS

The fault (JSON in MESHTRAIN_TEST_FAULT) hits the train batches of one process
("process", default every process) before the batch of "step":
    block   waits forever (a stalled input pipeline), from "step" on;
    sleep   sleeps "seconds" once, before "step", staying alive;
    slow    sleeps "seconds" before every batch from "step" (default 1) on: a straggler;
    kill    kills its own process with SIGKILL before "step" (kill -9: no last word);
    hold    waits before "step" until the file "until" exists (the test lets it go on).
With "restart": N the fault hits only the Nth run of a Slurm job (SLURM_RESTART_COUNT, 0
for the first run), so a requeued job runs again at full speed.
Launchers that run `$PYTHON -m meshtrain.train` (launch/local.sh, launch/slurm.sbatch) run
this file instead when PYTHON is tests/fault_python.
"""

import json
import os
import sys
import threading
import time


class FaultyBatches:
    """The batch iterator of Experiment.train_batches, with the fault; get_state/set_state pass through."""

    def __init__(self, batches, start_step: int, fault: dict):
        self.batches, self.step, self.fault = batches, start_step, fault

    def __iter__(self):
        return self

    def __next__(self):
        import jax
        self.step += 1
        f, me = self.fault, jax.process_index()
        run = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        if f.get("process", me) == me and f.get("restart", run) == run:
            if f["kind"] in ("block", "sleep", "kill") and self.step == f["step"]:
                # When the fault began, for the tests' detection times.
                print(f"fault: process {me} {f['kind']}s before step {self.step} at {time.time():.3f}",
                      file=sys.stderr, flush=True)
            if f["kind"] == "block" and self.step >= f["step"]:
                threading.Event().wait()  # forever
            elif f["kind"] == "sleep" and self.step == f["step"]:
                time.sleep(f["seconds"])
            elif f["kind"] == "kill" and self.step == f["step"]:
                os.kill(os.getpid(), 9)
            elif f["kind"] == "hold" and self.step == f["step"]:
                while not os.path.exists(f["until"]):
                    time.sleep(0.01)
            elif f["kind"] == "slow" and self.step >= f.get("step", 1):
                time.sleep(f["seconds"])
        return next(self.batches)

    def get_state(self):
        return self.batches.get_state()

    def set_state(self, state):
        self.batches.set_state(state)


def main() -> int:
    from meshtrain import train
    from meshtrain.run.experiment import Experiment

    fault = json.loads(os.environ["MESHTRAIN_TEST_FAULT"])
    original = Experiment.train_batches

    def train_batches(self, start_step: int = 0):
        return FaultyBatches(original(self, start_step), start_step, fault)

    Experiment.train_batches = train_batches
    return train.main(sys.argv[1:], prog="meshtrain train")


if __name__ == "__main__":
    sys.exit(main())
