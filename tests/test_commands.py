"""The command-line convention (meshtrain/cli.py) and what every run prints around its
steps: --help and --print_config, the console script's dispatch, argument errors, the
learning-rate line and its warnings, and the summary a run ends with. Nothing here
compiles a step."""

import math
import subprocess
import sys

import pytest

from meshtrain import __main__ as entry, cli, train
from meshtrain import config as config_lib
from meshtrain.errors import UserError
from meshtrain.runlog import metrics
from meshtrain.step import optim


def test_help_lists_every_flag_with_its_default_and_exits_0(capsys):
    assert train.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: meshtrain train")
    for flag in ("--config", "--print_config", "--workdir", "--coordinator", "--num_processes", "--process_id"):
        assert flag in out
    assert "--config.KEY=VALUE" in out  # the overrides are explained too


@pytest.mark.parametrize("command", ["train", "sample", "eval"])
def test_help_answers_without_importing_jax(command):
    """A fresh process: --help parses flags only (jax, flax and the models load when a
    command runs, a second on every --help otherwise)."""
    code = (f"import sys; from meshtrain import {command} as c; status = c.main(['--help']); "
            f"print(status, sorted(m for m in ('jax', 'flax') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.splitlines()[-1] == "0 []", r.stdout[-2000:] + r.stderr[-2000:]


def test_config_and_help_prints_the_resolved_config(capsys):
    assert train.main(["--config=gpt2_tiny_dp8", "--config.train.steps=7", "-h"]) == 0
    out = capsys.readouterr().out
    assert "usage: meshtrain train" in out and "# --config=gpt2_tiny_dp8 with 1 override(s)" in out
    lines = {line.split(" = ")[0].strip(): line for line in out.splitlines() if " = " in line}
    assert lines["train.steps"].split(" = ")[1] == "7"
    assert "# 2 from model.size='tiny'" in lines["model.num_layers"]  # a dim the size fills in
    assert set(lines) == set(config_lib.keys(config_lib.base()))   # every key, once


def test_print_config_prints_only_the_config(capsys):
    assert train.main(["--config=gpt2_tiny_dp8", "--print_config", "--noconfig.model.scan_layers"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# --config=gpt2_tiny_dp8") and "usage" not in out
    assert "model.scan_layers" in out and "= False" in [line for line in out.splitlines()
                                                         if line.startswith("model.scan_layers")][0]


@pytest.mark.parametrize("argv, says", [
    (["--config=gpt2_tiny_dp8", "--workdr=x"], "Unrecognized arguments: --workdr=x. `meshtrain train --help` lists"),
    (["--workdir=x"], "No --config given. Usage: meshtrain train --config=NAME"),
    (["--config=gpt2_tiny_dp8", "--config.train.stpes=3"], "Unknown config key 'train.stpes'. Did you mean train.steps or"),
    (["--config=gpt2_tiny_dp8", "--config.train.steps=many"], "--config.train.steps='many': expected an integer"),
])
def test_bad_arguments_are_one_paragraph_and_status_2(argv, says, capsys):
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtrain train: error: ") and says in err and err.count("\n") == 1


def test_abbreviations_are_not_flags():
    with pytest.raises(UserError, match="Unrecognized arguments: --work=x"):
        cli.parse(train.parser(), ["--config=gpt2_tiny_dp8", "--work=x"])


def test_the_console_script_lists_dispatches_and_suggests(capsys):
    assert entry.main([]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name}" in listed for name in entry.COMMANDS)
    assert entry.main(["configs"]) == 0
    assert "gpt2_tiny_dp2_tp4" in capsys.readouterr().out
    assert entry.main(["sampel"]) == 2
    assert "Did you mean `meshtrain sample`?" in capsys.readouterr().err
    assert entry.main(["train", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: meshtrain train")


def lr_line(steps, warmup, schedule="cosine", stop_at=0):
    cfg = config_lib.base()
    cfg.optim.update(warmup_steps=warmup, schedule=schedule)
    return optim.describe(cfg.optim, steps, stop_at)


def test_the_lr_line_and_its_warnings():
    line, warnings = lr_line(300, 30)
    assert line == "lr: warm-up 0 -> 0.003 over 30 steps, cosine to 0.0003 at step 300 (optim.schedule=cosine)"
    assert warnings == []
    _, (w,) = lr_line(20, 30)  # the issue's `train.steps=20` with the default warm-up
    assert "optim.warmup_steps=30 is not less than train.steps=20" in w and "never decays" in w
    assert lr_line(20, 30)[0] == "lr: warm-up 0 -> 0.003 over all 20 steps, no decay (optim.schedule=cosine)"
    assert "--config.optim.warmup_steps=2" in w
    _, (w,) = lr_line(100, 60)
    assert "more than half of train.steps=100" in w and "only 40 steps" in w
    assert lr_line(100, 60, schedule="constant")[1] == []  # nothing decays to miss
    line, _ = lr_line(300, 30, stop_at=150)
    # Cosine from step 30 to 300: at 150, 0.0003 + 0.0027 x (1 + cos(pi x 120/270)) / 2.
    lr = 0.0003 + 0.0027 * (1 + math.cos(math.pi * 120 / 270)) / 2
    assert f"this run stops at step 150 (train.stop_at), lr {lr:.3g} there" in line


def summary(end, steps=300, preempted=None, workdir="runs/a", checkpoint="runs/a/checkpoints/step_300",
            processes=1, best=1.494):
    log = metrics.RunLog(None, steps, 4096, 1.0, None, 8)
    log.last_train = {"step": end, "loss": 1.5123}
    log.last_eval = {"step": end, "eval_loss": 1.5234}
    log.ended(end, preempted)
    return metrics.summary(log, best_loss=best, vocab=256, wall_s=65.0, checkpoint=checkpoint, workdir=workdir,
                           command="meshtrain train --config=x --workdir=runs/a", processes=processes)


def test_the_summary_of_a_finished_run():
    lines = summary(300)
    assert lines[0] == "done: trained to step 300 of 300; this run: steps 1-300, 1,228,800 tokens in 1m05s"
    assert lines[1] == ("  train loss 1.5123 (step 300) | eval_loss 1.5234 (step 300) | best possible 1.4940 "
                        "(the data's entropy rate)")
    assert lines[2] == "  checkpoint: runs/a/checkpoints/step_300"
    assert lines[3].startswith("  next: meshtrain sample --workdir=runs/a | meshtrain eval --workdir=runs/a")


def test_the_summary_of_runs_that_stop_early_or_save_nothing():
    assert summary(120, preempted="SIGTERM")[0].startswith("done: preempted (SIGTERM) at step 120 of 300")
    assert summary(120, preempted="Ctrl-C")[0].startswith("done: interrupted (Ctrl-C) at step 120 of 300")
    assert summary(120)[-1] == "  resume: meshtrain train --config=x --workdir=runs/a"
    assert summary(120, processes=2)[-1].startswith("  resume: rerun the command that started the 2 processes")
    unsaved = summary(300, workdir=None, checkpoint=None, best=None)
    assert "best possible unknown for this data; uniform guessing scores ln 256 = 5.5452" in unsaved[1]
    assert unsaved[-1].startswith("  nothing saved: give --workdir=DIR")


def test_convert_without_a_command_says_which(capsys):
    from meshtrain import convert
    assert convert.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtrain convert: error: Give a command, from_hf or to_hf") and err.count("\n") == 1
    assert convert.main(["from_hf", "--model=x"]) == 2
    assert ("The following arguments are required: --out. `meshtrain convert from_hf --help` lists the flags"
            in capsys.readouterr().err)
