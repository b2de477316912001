"""The command line, run as users run it: a short training run, compile-only, bad input."""

import json
import subprocess
import sys

import pytest

from meshtrain.train import main as train_main
from support.processes import metric_rows, own_devices_env


def run_cli(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "meshtrain.train", *args], capture_output=True,
                          text=True, env=own_devices_env(**(env or {})), timeout=timeout)


def test_short_run_writes_run_json_and_metrics(tmp_path):
    w = tmp_path / "w"
    r = run_cli("--config=gpt2_tiny_dp2_tp4", f"--workdir={w}", "--config.train.steps=20",
                "--config.train.log_every=5", "--config.train.eval_every=10")
    assert r.returncode == 0, r.stderr
    assert "ETA" in r.stdout and "tok/s" in r.stdout
    run = json.loads((w / "run.json").read_text())
    assert run["device_count"] == 8 and run["process_count"] == 1
    assert run["mesh"]["shape"] == {"data": 2, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 4}
    assert run["num_params"] == 124_672 and run["config"]["layout"] == "dp_tp"
    assert run["data"]["entropy_rate"] > 0 and run["compiled_memory_per_device"]["argument"] > 0
    rows = metric_rows(w)
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20] and [r["step"] for r in evals] == [10, 20]
    for row in train:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu"} <= row.keys()
        assert row["mfu"] is None  # no known peak on CPU
    assert train[-1]["loss"] < train[0]["loss"]
    assert any(p.name.startswith("events.out.tfevents") for p in (w / "tb").iterdir())


# GPT-2 medium's step needs ~13 GiB a device, more than this host shares among 32 simulated
# devices: the memory check would compile its fixes (three more programs) to name one.
# test_memory_check.py::test_a_compile_only_run_warns_and_exits_0 tests that warning.
SKIP_CHECK = ["--config.train.skip_memory_check=true"]


@pytest.mark.slow
def test_compile_only_gpt2_medium_on_32_simulated_devices(tmp_path):
    r = run_cli("--config=gpt2_medium_dp8_tp4", "--config.train.steps=0", f"--workdir={tmp_path}", *SKIP_CHECK)
    assert r.returncode == 0, r.stderr
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["device_count"] == 32 and run["num_params"] == 354_823_168
    # Megatron split of 355M over tensor=4: 12 bytes x ~89.6M params per device.
    assert 1000 < run["compiled_memory_per_device"]["argument"] / 2**20 < 1050
    assert not (tmp_path / "metrics.jsonl").exists()  # compile-only logs no rows


@pytest.mark.slow
def test_compile_only_pipelined_gpt2_medium_on_32_simulated_devices(tmp_path):
    r = run_cli("--config=gpt2_medium_dp2_pp4_tp4", "--config.train.steps=0", f"--workdir={tmp_path}", *SKIP_CHECK)
    assert r.returncode == 0, r.stderr
    assert "Involuntary" not in r.stderr  # no resharding by full replication
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["device_count"] == 32 and run["num_params"] == 354_823_168
    assert run["mesh"]["shape"] == {"data": 2, "stage": 4, "fsdp": 1, "context": 1, "expert": 1, "tensor": 4}
    assert run["pipeline"] == {"stages": 4, "microbatches": 16, "repeats": 1, "ticks": 19,
                               "bubble": 3 / 19}
    # Blocks and wte split 16 ways (stage x tensor), wpe 4 (stage), LayerNorms whole: 22.4M
    # params a device x 12 bytes (fp32 params and Adam moments) = 256 MiB; 376 MiB with wte
    # and wpe whole over stage.
    assert 250 < run["compiled_memory_per_device"]["argument"] / 2**20 < 262


def test_pipeline_warns_when_microbatches_are_few_once_with_the_fix(tmp_path):
    r = run_cli("--config=gpt2_tiny_pp4_dp2", "--config.pipeline.microbatches=2", "--config.train.steps=0")
    assert r.returncode == 0, r.stderr
    assert "pipeline: gpipe: 4 stages x 1 chunk(s), 2 microbatches, 5 ticks, bubble" in r.stdout
    # The linter's bubble warning, once (train warns itself and runs the linter), with its fix.
    warnings = [line for line in r.stderr.splitlines() if line.startswith("meshtrain: warning:")]
    assert len([w for w in warnings if "bubble" in w]) == 1, warnings
    (w,) = warnings
    assert w.startswith("meshtrain: warning: pipeline.microbatches=2 < stage=4")
    assert w.endswith("Fix: --config.pipeline.microbatches=16")


def test_minus_one_fills_a_pinned_cpu_count(tmp_path):
    r = run_cli("--config=gpt2_tiny_dp2_tp4", "--config.mesh.shape=data:-1,tensor:4",
                "--config.train.steps=0", f"--workdir={tmp_path}", env={"JAX_NUM_CPU_DEVICES": "8"})
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "run.json").read_text())["mesh"]["shape"]["data"] == 2


# Bad input whose story depends on the process itself (its environment before JAX starts,
# Slurm's variables): a process of its own, as users start it. The first row also stands
# for the rest: `python -m meshtrain.train` turns a UserError into exit status 2 and one
# paragraph, no traceback.
IN_A_PROCESS = [
    (["--config=gpt2_tiny_dp8", "--config.train.stpes=3"], {}, "Unknown config key 'train.stpes'"),
    (["--config=gpt2_tiny_dp8", "--config.mesh.shape=data:4"], {"JAX_NUM_CPU_DEVICES": "8"},
     "needs 4 x 1 x 1 x 1 x 1 x 1 = 4 devices, fewer than the 8 available (CPU device count pinned"),
    (["--config=gpt2_tiny_dp8", "--config.mesh.shape=data:16"], {"JAX_NUM_CPU_DEVICES": "8"},
     "needs 16 x 1 x 1 x 1 x 1 x 1 = 16 devices, more than the 8 available"),
    (["--config=gpt2_tiny_dp8", "--config.mesh.shape=data:-1"], {},
     "has an axis of size -1, but on a CPU-only host"),
    (["--config=gpt2_tiny_dp8"], {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2"},
     "started outside srun"),
]
# The rest is the same `main` called in this process: the same paragraph and status.
IN_THIS_PROCESS = [
    (["--config=gpt2_tiny_dp2_tp4", "--config.mesh.shape=tensor:8"], "model.num_heads = 4 is not divisible by 8"),
    (["--config=gpt2_tiny_dp8", "--config.layout=dpp"], "Unknown layout 'dpp'"),
    (["--config=gpt2_tiny_dp8", "--config.layout=batch:data;hidden:tensor"], "Unknown logical axis name 'hidden'"),
    (["--config=gpt2_tiny_dp9"], "Unknown config 'gpt2_tiny_dp9'"),
    (["--config=gpt2_tiny_dp8", "--config.data.kind=text", "--config.data.path=no/such.txt"], "no/such.txt"),
    (["--config=gpt2_tiny_dp8", "--config.data.kind=tfds", "--config.data.name=nosuch",
      "--config.data.data_dir=no/such/dir"], "'nosuch' was not found in no/such/dir"),
    (["--config=gpt2_tiny_dp8", "--config.data.workers=-1"], "data.workers=-1"),
    (["--config=gpt2_tiny_dp8", "--config.train.nonfinite=ignore"],
     "train.nonfinite='ignore', train.max_skips=10: nonfinite must be one of crash, skip"),
    (["--config=gpt2_tiny_dp8", "--config.train.stop_at=400"],
     "train.stop_at=400: must be between 0 (off) and train.steps=300"),
    (["--config=gpt2_tiny_dp8", "--config.checkpoint.every=-5"], "checkpoint.every=-5"),
    (["--config=gpt2_tiny_dp8", "--config.distributed.heartbeat_timeout=0"],
     "distributed.heartbeat_timeout=0 must be at least 1 (seconds"),
    (["--config=gpt2_tiny_dp8", "--num_processes=2"], "the flags lack --coordinator, --process_id"),
    (["--config=gpt2_tiny_dp2_tp4", "--config.mesh.dcn=data:3"],
     "mesh.dcn='data:3' puts 3 nodes on axis 'data', but the mesh gives that axis 2 devices"),
]


def assert_one_paragraph(status: int, err: str, message: str) -> None:
    assert status == 2, err
    assert "Traceback" not in err
    assert message in err, err
    paragraph = err.strip()
    assert paragraph.startswith("meshtrain train: error:") and "\n\n" not in paragraph


@pytest.mark.parametrize("args, env, message", IN_A_PROCESS)
def test_bad_input_is_one_paragraph_without_traceback(args, env, message):
    r = run_cli(*args, env=env, timeout=120)
    assert_one_paragraph(r.returncode, r.stderr, message)


@pytest.mark.parametrize("args, message", IN_THIS_PROCESS)
def test_bad_input_to_main_is_one_paragraph_without_traceback(args, message, capfd, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing a run would write lands in the checkout
    status = train_main(args)
    out, err = capfd.readouterr()
    assert_one_paragraph(status, err, message)
