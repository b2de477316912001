"""meshtrain.compare on two real short runs (two layouts), its errors, and the `time_s`
column that metrics.RunLog writes (continued across a resume)."""

import json
import shutil
import subprocess
import sys

import pytest

from meshtrain import compare
from meshtrain.runlog import goodput
from meshtrain.runlog import metrics
from meshtrain.train import main as train_main
from support.processes import metric_rows, own_devices_env
from support.training import TOKEN_FLAGS, TOKENS

RUN = ["--config.train.steps=12", "--config.train.eval_every=6", "--config.train.log_every=3",
       "--config.train.eval_steps=1", "--config.checkpoint.every=0", *TOKEN_FLAGS]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def rows_of(workdir):
    return metric_rows(workdir)


def copy(src, dst, keep=lambda row: True, drop_keys=()):
    """A copy of a workdir's run.json and metrics.jsonl, with rows filtered and keys dropped."""
    dst.mkdir()
    shutil.copy(src / "run.json", dst / "run.json")
    rows = [{k: v for k, v in r.items() if k not in drop_keys} for r in rows_of(src) if keep(r)]
    (dst / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dst


def run_compare(*args):
    """The command as users run it, in its own process."""
    return subprocess.run([sys.executable, "-m", "meshtrain.compare", *args], capture_output=True,
                          text=True, env=own_devices_env(), timeout=120)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """12 steps of GPT-2 tiny under data:8 and under data:2 x tensor:4, in this process."""
    out = {}
    for name in ("gpt2_tiny_dp8", "gpt2_tiny_dp2_tp4"):
        w = tmp_path_factory.mktemp(name)
        assert train_main([f"--config={name}", *RUN, f"--workdir={w}"]) == 0
        out[name] = w
    return out


def test_time_s_is_on_every_row_and_never_decreases(runs):
    for w in runs.values():
        rows = rows_of(w)
        assert [r["step"] for r in rows if "eval_loss" in r] == [6, 12]
        times = [r["time_s"] for r in rows]
        assert times == sorted(times) and times[0] > 0, times
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu", "skipped"} <= rows[0].keys()


def test_compare_draws_a_png_and_names_both_runs(runs, tmp_path, capsys):
    out = tmp_path / "cmp.png"
    assert compare.main([str(runs["gpt2_tiny_dp8"]), str(runs["gpt2_tiny_dp2_tp4"]), f"--out={out}",
                         "--smooth=2"]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    import matplotlib.image
    height, width = matplotlib.image.imread(out).shape[:2]
    assert width > 0 and height > 0
    text = capsys.readouterr().out
    assert "gpt2_tiny_dp8 (dp, data:8)" in text and "gpt2_tiny_dp2_tp4 (dp_tp, data:2,tensor:4)" in text
    assert "first there in wall time:" in text and "note:" not in text
    tokens = 12 * int(TOKENS["train.batch_size"]) * int(TOKENS["model.seq_len"])  # 12 steps of 16 x 64, each run
    assert text.count(f"{tokens:,}") == 2
    for w in runs.values():  # the goodput column: productive steps over the wall time of the run
        total = goodput.add_up(goodput.read_pieces(w))
        assert total["pieces"] == 1 and 0 < total["goodput"] < 1
        assert sum(total["seconds"].values()) == pytest.approx(total["wall_s"], rel=1e-3)
        row = next(line for line in text.splitlines() if line.startswith(json.loads((w / "run.json").read_text())["config_name"] + " "))
        assert row.endswith(f"{100 * total['goodput']:.0f}%")


def test_labels_and_svg(runs, tmp_path, capsys):
    out = tmp_path / "cmp.svg"
    assert compare.main([str(w) for w in runs.values()] + [f"--out={out}", "--labels=dp,tp"]) == 0
    assert b"<svg" in out.read_bytes()[:400]
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("dp ") and lines[2].startswith("tp ")


def test_a_run_without_eval_rows_or_time_s_is_drawn_with_notes(runs, tmp_path, capsys):
    src = runs["gpt2_tiny_dp8"]
    no_eval = copy(src, tmp_path / "no_eval", keep=lambda r: "eval_loss" not in r)
    old = copy(src, tmp_path / "old", drop_keys=("time_s",))
    assert compare.main([str(no_eval), str(old), f"--out={tmp_path / 'c.pdf'}"]) == 0
    text = capsys.readouterr().out
    assert f"note: {no_eval}: no eval rows" in text and "eval loss panels have no points" in text
    assert f"note: {old}: metrics.jsonl has no time_s" in text
    assert (tmp_path / "c.pdf").read_bytes()[:4] == b"%PDF"


def test_fallback_wall_time_is_the_cumulative_step_time():
    rows = [{"step": 3, "loss": 5.0, "step_time_s": 0.2}, {"step": 6, "loss": 4.0, "step_time_s": 0.1},
            {"step": 6, "eval_loss": 4.5}, {"step": 10, "loss": 3.0, "step_time_s": 0.5},
            {"step": 8, "eval_loss": 4.0}]
    times, fallback = compare.wall_times(rows)
    assert fallback and times == pytest.approx([0.6, 0.9, 0.9, 2.9, 1.9])
    assert compare.wall_times([{"step": 1, "loss": 1.0, "time_s": 2.5}]) == ([2.5], False)


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("no_metrics", "has no metrics.jsonl: a compile-only run"),
    ("no_rows", "has any train or eval rows"),
    ("bad_out", "must end in .png, .pdf, .svg"),
    ("no_workdir", "No workdir given"),
    ("labels", "names 1 run(s), but 2 workdir(s)"),
])
def test_bad_input_is_one_paragraph_without_traceback(runs, tmp_path, case, message):
    good = str(runs["gpt2_tiny_dp8"])
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(runs["gpt2_tiny_dp8"] / "run.json", empty / "run.json")
    if case == "no_rows":
        (empty / "metrics.jsonl").write_text("")
    out = f"--out={tmp_path / 'c.png'}"
    args = {"missing": [good, str(tmp_path / "nope"), out], "no_metrics": [good, str(empty), out],
            "no_rows": [str(empty), out], "bad_out": [good, f"--out={tmp_path / 'c.jpg'}"],
            "no_workdir": [out], "labels": [good, good, out, "--labels=one"]}[case]
    r = run_compare(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and message in r.stderr, r.stderr
    paragraph = r.stderr.strip()
    assert paragraph.startswith("meshtrain compare: error:") and "\n" not in paragraph
    assert not (tmp_path / "c.png").exists()


def test_a_resumed_runlog_continues_the_clock(tmp_path):
    log = metrics.RunLog(str(tmp_path), 10, 1, 1.0, None, 8)
    log.started -= 100.0  # as if the first run had been going for 100 s
    for step in (1, 2, 3):
        log.log_eval(step, 1.0)
    log.close()
    kept = rows_of(tmp_path)[1]["time_s"]
    assert kept >= 100.0
    log = metrics.RunLog(str(tmp_path), 10, 1, 1.0, None, 8, resume_step=2)
    log.log_eval(3, 0.5)
    log.close()
    rows = rows_of(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["eval_loss"] == 0.5
    assert kept <= rows[-1]["time_s"] < kept + 60


def test_a_run_counts_its_start_up_from_the_process_start_only_when_meshtrain_is_the_program(monkeypatch):
    """A notebook's, a test's or a script's `main` in a long-lived process would otherwise
    have the time since the process began (CI once showed start-up 15m12s of a 4 s run)."""
    called = goodput.process_start() + 60.0
    for program, ours in [("/venv/bin/meshtrain", True), (str(goodput.PACKAGE / "train.py"), True),
                          ("/venv/bin/pytest", False), ("/venv/lib/ipykernel_launcher.py", False), ("", False)]:
        assert goodput.started_by_meshtrain(program) == ours, program
        monkeypatch.setattr(sys, "argv", [program])
        assert goodput.piece_start(called) == (goodput.process_start() if ours else called), program
