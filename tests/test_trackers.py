"""train.trackers: where metric rows go (meshtrain/runlog/trackers.py). One run of four steps,
stopped at step 2 and resumed, with tensorboard, jsonl and Weights & Biases in its
offline mode (conftest.py sets WANDB_MODE=offline: no test reaches the network); its
W&B files are read back with the record format wandb writes, and checked against
run.json and metrics.jsonl. The rest is RunLog in-process: a tracker that cannot start
is one line and the run goes on; no tracker on a process other than 0.
"""

import json
import os
import pathlib
import struct
import subprocess
import sys

import pytest

from meshtrain import config as config_lib
from meshtrain.errors import UserError
from meshtrain.runlog import metrics, trackers
from support.processes import metric_rows

wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = ["--config=gpt2_tiny_dp8", "--config.train.trackers=tensorboard,jsonl,wandb", "--config.train.steps=4",
       "--config.train.log_every=1", "--config.train.eval_every=2", "--config.train.eval_steps=1",
       "--config.optim.warmup_steps=1", "--config.checkpoint.every=0"]


def records(path: pathlib.Path):
    """The protobuf Records of a run-ID.wandb file: wandb's LevelDB-style log, a 7-byte
    header (":W&B", magic, version), then 32 KiB blocks of chunks, each with a header
    (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zeroed rest of the block
            pos += block - pos % block
            continue
        pending += data[pos + 7:pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):
            record = wandb_pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def piece(run_dir: pathlib.Path) -> dict:
    """One offline run directory read back: its run id, config, history rows by step and
    the summary's final values."""
    out = {"id": None, "config": {}, "history": {}, "summary": {}}
    (path,) = run_dir.glob("run-*.wandb")
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["id"] = r.run.run_id
            out["config"] = {u.key: json.loads(u.value_json) for u in r.run.config.update}
        elif kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            out["history"].setdefault(row["_step"], {}).update(row)
        elif kind == "summary":
            out["summary"].update({(u.key or "/".join(u.nested_key)): json.loads(u.value_json)
                                   for u in r.summary.update})
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run stopped at step 2 and resumed to step 4: its workdir, the two outputs, and
    the two W&B pieces (oldest first)."""
    workdir = tmp_path_factory.mktemp("trackers") / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    env.pop("WANDB_SILENT", None)
    outs = []
    for extra in (["--config.train.stop_at=2"], []):
        r = subprocess.run([sys.executable, "-m", "meshtrain.train", *RUN, *extra, f"--workdir={workdir}"],
                           capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        outs.append(r.stdout + r.stderr)
    pieces = [piece(d) for d in sorted((workdir / "wandb").glob("offline-run-*"))]
    return workdir, outs, pieces


def test_wandb_holds_the_resolved_config(run):
    workdir, _, pieces = run
    info = json.loads((workdir / "run.json").read_text())
    first = json.loads(json.dumps(info["config"]))
    first["train"]["stop_at"] = 2  # the first piece's one difference
    for p, config in zip(pieces, (first, info["config"])):
        assert {k: p["config"][k] for k in config} == config
        assert p["config"]["run"]["config_name"] == "gpt2_tiny_dp8"
        assert p["config"]["train"]["trackers"] == "tensorboard,jsonl,wandb"


def test_wandb_holds_every_metric_row(run):
    """Every train and eval row of metrics.jsonl, at its step, across both pieces (all but
    time_s: W&B keeps its own clock)."""
    workdir, _, pieces = run
    rows = metric_rows(workdir)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    history = {}
    for p in pieces:
        history.update(p["history"])
    assert sorted(history) == [1, 2, 3, 4]
    for row in rows:
        logged = history[row["step"]]
        fields = {k: v for k, v in row.items() if k not in ("step", "time_s") and v is not None}
        assert {k: logged[k] for k in fields} == fields and "time_s" not in logged


def test_wandb_and_run_json_hold_the_summary(run):
    workdir, _, pieces = run
    summary = json.loads((workdir / "run.json").read_text())["summary"]
    assert summary["end_step"] == 4 and summary["first_step_this_run"] == 3
    assert summary["tokens_this_run"] == 2 * 32 * 128 and summary["wall_s"] > 0
    assert summary["train_loss_step"] == summary["eval_loss_step"] == 4
    last = json.loads((workdir / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["eval_loss"] == last["eval_loss"]
    assert {k: pieces[-1]["summary"][k] for k in summary} == summary
    assert pieces[0]["summary"]["end_step"] == 2  # the stopped piece's own summary


def test_a_resumed_run_appends_to_the_same_wandb_run(run):
    workdir, outs, pieces = run
    run_id = (workdir / "wandb_id").read_text().strip()
    assert len(pieces) == 2 and [p["id"] for p in pieces] == [run_id, run_id]
    assert sorted(pieces[0]["history"]) == [1, 2] and sorted(pieces[1]["history"]) == [3, 4]
    assert f"trackers: wandb run {run_id}, new, offline in" in outs[0]
    assert f"trackers: wandb run {run_id}, continued, offline in" in outs[1]
    assert "wandb sync " in outs[1]
    for out in outs:  # one line of our own, none of wandb's banner
        assert "wandb:" not in out and "Traceback" not in out, out
    assert list((workdir / "tb").glob("events.out.tfevents.*"))


def test_trackers_config_check():
    for good in ("tensorboard,jsonl", "wandb", " jsonl , wandb ", "", "none"):
        trackers.check_config(_train(good))
    with pytest.raises(UserError, match=r"train.trackers='tensorbord,jsonl': unknown 'tensorbord'\. Give "
                                        r"a comma list of tensorboard, jsonl, wandb"):
        trackers.check_config(_train("tensorbord,jsonl"))
    with pytest.raises(UserError, match="a name given twice"):
        trackers.check_config(_train("jsonl,jsonl"))


def _train(text: str):
    t = config_lib.base().train
    with t.unlocked():
        t.trackers = text
    return t


def test_unknown_tracker_stops_the_command_with_status_2(capsys):
    from meshtrain import train
    assert train.main(["--config=gpt2_tiny_dp8", "--config.train.trackers=tensorboard,mlflow"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshtrain train: error: train.trackers='tensorboard,mlflow': unknown 'mlflow'")
    assert "\n" not in err and "Traceback" not in err


def test_a_tracker_that_is_not_installed_is_one_line_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    log = metrics.RunLog(str(tmp_path), 4, 1, 1.0, None, 8, trackers="jsonl,wandb")
    log.log_eval(1, 2.0)
    log.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshtrain: warning: tracker wandb is not installed")
    assert 'pip install -e ".[wandb]"' in err[0] and "goes on without it" in err[0]
    assert [json.loads(line)["eval_loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [2.0]


def test_a_tracker_that_cannot_start_is_one_line_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "no-such-mode")  # wandb.init rejects its settings
    log = metrics.RunLog(str(tmp_path), 4, 1, 1.0, None, 8, trackers="jsonl,wandb")
    log.write_run({"config": {"train": {"steps": 4}}})
    log.log_eval(1, 2.0)
    log.log_eval(2, 1.0)
    log.finish({"end_step": 2})
    log.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshtrain: warning: tracker wandb could not start ("), err
    assert "WANDB_MODE=offline" in err[0]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert json.loads((tmp_path / "run.json").read_text())["summary"] == {"end_step": 2}


def test_no_trackers_write_nothing_but_run_json(tmp_path):
    log = metrics.RunLog(str(tmp_path), 4, 1, 1.0, None, 8, trackers="none")
    log.write_run({"config": {}})
    log.log_eval(1, 2.0)
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_only_process_0_tracks(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics.jax, "process_index", lambda: 1)
    log = metrics.RunLog(str(tmp_path / "w"), 4, 1, 1.0, None, 8, trackers="tensorboard,jsonl,wandb")
    log.write_run({"config": {}})
    log.log_eval(1, 2.0)
    log.finish({"end_step": 1})
    log.close()
    assert log.trackers.live == [] and not (tmp_path / "w").exists()
