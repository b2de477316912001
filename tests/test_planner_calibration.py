"""The planner's step time against the measured GPU runs in benchmarks/results/
(benchmarks/planner_calibration.py): every measured GPT-2 step, planned with the run's own
settings for the card it ran on, within 15%. One compile serves both cards."""

import pathlib
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_runs  # noqa: E402
import planner_calibration  # noqa: E402
from meshtrain.planner import hardware, report  # noqa: E402
from meshtrain.run.experiment import Experiment  # noqa: E402


def measured(model: str, remat: str) -> dict[str, tuple[int, float]]:
    """{hardware entry: (batch, median step s)} of every results file's run of model/remat."""
    return {hw: (r["batch"], r["step_s_median"]) for hw, r, _ in planner_calibration.measured_runs()
            if (r["model"], r["remat"]) == (model, remat)}


@pytest.mark.parametrize("model, remat, cards", [("gpt2_small", "none", {"h100", "h200"}),
                                                 ("gpt2_small", "full", {"h100", "h200"}),
                                                 ("gpt2_medium", "none", {"h100", "h200"})])
def test_gpt2_is_predicted_within_15_percent_of_its_measured_steps(model, remat, cards):
    runs = measured(model, remat)
    assert set(runs) == cards
    batches = {b for b, _ in runs.values()}
    assert len(batches) == 1
    exp = Experiment.build(gpu_runs.make_config(model, remat, batches.pop()), devices=jax.devices()[:1])
    compiled = exp.compile(analysis=True)
    for hw_name, (_, step_s) in runs.items():
        r = report.plan(exp, hardware.get(hw_name), compiled, 0.0)
        assert r["predicted_step_time_s"] == pytest.approx(step_s, rel=0.15), hw_name
        assert r["prediction"]["calibration"].startswith("matmul, attention")


def test_predict_refuses_a_run_it_cannot_build():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "planner_calibration.py"), "--predict",
                           "--runs=gpt2_small:none,gpt3:none,gpt2_small"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "--runs takes MODEL:REMAT,... with MODEL from gpt2_small," in done.stderr
    assert done.stderr.rstrip().endswith("got gpt3:none, gpt2_small")
