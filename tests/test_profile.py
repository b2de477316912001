"""train.profile: a JAX profiler trace of the chosen steps in WORKDIR/profile."""

import pytest

from meshtrain.train import main

RUN = ["--config=gpt2_tiny_dp8", "--config.train.steps=4", "--config.train.log_every=2",
       "--config.train.eval_every=0", "--config.checkpoint.every=0"]


def test_trace_of_the_chosen_steps_is_written(tmp_path, capsys):
    assert main([*RUN, "--config.train.profile=2:3", f"--workdir={tmp_path}"]) == 0
    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert "profile of steps 2-3 written to" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["3:2", "0:1", "2:9", "two:3", "2"])
def test_bad_ranges_are_refused(value, tmp_path, capsys):
    assert main([*RUN, f"--config.train.profile={value}", f"--workdir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert f"train.profile={value!r}" in err and "START:STOP" in err and "Traceback" not in err


def test_a_trace_needs_a_workdir(capsys):
    assert main([*RUN, "--config.train.profile=2:3"]) == 2
    assert "give --workdir=DIR" in capsys.readouterr().err
