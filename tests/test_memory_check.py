"""The memory check between compiling and allocating (meshtrain/run/memory_check.py,
its budget meshtrain/run/memory_budget.py).

The command-line tests run gpt2_tiny_dp8 in this process with the host's RAM faked
(`memory_budget.host_available`, the one place the check reads it) so that the tiny step
does not fit; the real case, a GPT-2 tiny too wide for this host's real RAM, runs as a command.
"""

import math
import re
import subprocess
import sys
import time
import types

import pytest

from meshtrain import train
from meshtrain.errors import UserError, gib
from meshtrain.run import memory_check
from meshtrain.run import memory_budget
from meshtrain.run.experiment import Experiment
from support.processes import ENV, ROOT

MIB = 2**20
TINY = ["--config=gpt2_tiny_dp8", "--config.train.steps=2", "--config.train.eval_every=0"]


def fake_host(monkeypatch, per_device: float, devices: int = 8):
    """The host's RAM set so that each of `devices` CPU devices may use `per_device` bytes."""
    available = per_device * devices / memory_budget.MARGIN["cpu"]
    monkeypatch.setattr(memory_budget, "host_available", lambda: (available, "a test's budget"))


@pytest.fixture
def no_allocation(monkeypatch):
    """Fails the test if the run allocates its state."""
    def boom(self):
        raise AssertionError("init_state ran: the check let a run that cannot fit allocate")
    monkeypatch.setattr(Experiment, "init_state", boom)


@pytest.fixture(scope="module")
def tiny_peak():
    """gpt2_tiny_dp8's compiled per-device peak, in bytes (about 20 MiB)."""
    from meshtrain import config as config_lib
    from meshtrain.runlog import metrics
    return metrics.memory_report(Experiment.build(config_lib.load("gpt2_tiny_dp8")).compile())["peak_estimate"]


def test_a_step_that_cannot_fit_stops_before_allocating_with_the_arithmetic_and_a_fix_that_fits(
        monkeypatch, capsys, tiny_peak, no_allocation):
    fake_host(monkeypatch, tiny_peak / 2)
    assert train.main(TINY) == 2
    err = capsys.readouterr().err
    assert err.count("meshtrain train: error:") == 1 and "Traceback" not in err
    assert f"needs {gib(tiny_peak)} per device" in err
    assert f"8 x {gib(tiny_peak)} = {gib(8 * tiny_peak)} against " \
           f"{gib(tiny_peak * 4 / memory_budget.MARGIN['cpu'])} available (a test's budget)" in err
    assert "--config.train.skip_memory_check=true" in err
    fix = re.search(r"that fits, compiled here: (.*?) \(.*?\): ([\d.,]+) MiB per device", err)
    assert fix, err
    assert float(fix.group(2).replace(",", "")) * MIB <= tiny_peak / 2
    # The fix it names passes the same check and trains.
    monkeypatch.undo()
    fake_host(monkeypatch, tiny_peak / 2)
    assert train.main(TINY + fix.group(1).split()) == 0
    assert "memory check: fits" in capsys.readouterr().out


def test_when_nothing_fits_it_says_so_and_lists_what_it_tried(monkeypatch, capsys, no_allocation):
    fake_host(monkeypatch, 1 * MIB)
    assert train.main(TINY) == 2
    err = capsys.readouterr().err
    assert "None of the planner's fixes fits" in err
    assert "--config.model.remat=full" in err and "--config.layout=fsdp --config.mesh.shape=fsdp:8" in err


def test_skip_memory_check_starts_anyway_with_a_warning(monkeypatch, capsys, tiny_peak):
    fake_host(monkeypatch, tiny_peak / 2)
    assert train.main(TINY + ["--config.train.skip_memory_check=true"]) == 0
    captured = capsys.readouterr()
    assert "may not fit" in captured.err and "Starting anyway (train.skip_memory_check=true)" in captured.err
    assert "done: trained to step 2 of 2" in captured.out


def test_a_compile_only_run_warns_and_exits_0(monkeypatch, capsys, tiny_peak):
    fake_host(monkeypatch, 1 * MIB)
    assert train.main(["--config=gpt2_tiny_dp8", "--config.train.steps=0"]) == 0
    assert "would not fit (a run stops here)" in capsys.readouterr().err


def test_a_tiny_run_on_this_host_passes_the_check(capsys):
    assert train.main(TINY) == 0
    out = capsys.readouterr().out
    assert re.search(r"memory check: fits; 8 simulated CPU devices share this host's RAM: 8 x [\d.]+ MiB", out)


def test_host_available_takes_the_tighter_of_meminfo_and_the_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  24000000 kB\nMemAvailable:  20000000 kB\n")
    v2 = tmp_path / "v2"
    (v2 / "job" / "step").mkdir(parents=True)
    (v2 / "job" / "memory.max").write_text(f"{8 * 2**30}\n")
    (v2 / "job" / "memory.current").write_text(f"{2 * 2**30}\n")
    (v2 / "job" / "step" / "memory.max").write_text("max\n")
    self_cgroup = tmp_path / "cgroup"
    self_cgroup.write_text("0::/job/step\n")
    assert memory_budget.host_available(str(meminfo), str(v2), str(self_cgroup))[0] == 6 * 2**30
    self_cgroup.write_text("4:memory:/job\n")  # v1: memory.limit_in_bytes, ~2^63 for none
    (tmp_path / "v1" / "memory" / "job").mkdir(parents=True)
    (tmp_path / "v1" / "memory" / "job" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (tmp_path / "v1" / "memory" / "job" / "memory.usage_in_bytes").write_text("1000\n")
    assert memory_budget.host_available(str(meminfo), str(tmp_path / "v1"), str(self_cgroup)) == \
        (20000000 * 1024, "MemAvailable in /proc/meminfo")


def test_budgets_cpu_devices_share_the_host_and_accelerators_have_their_own():
    cpu = [types.SimpleNamespace(platform="cpu")] * 4
    b = memory_budget.device_budget(cpu, processes_on_host=2, host=lambda: (80 * 2**30, "test"))
    assert (b.sharing, b.per_device) == (8, 80 * 2**30 * 0.9 / 8)
    assert "8 simulated CPU devices (4 in each of 2 processes) share this host's RAM" in \
        memory_budget.arithmetic(2**30, b)

    def gpu(limit, used):
        return types.SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": limit, "bytes_in_use": used})
    b = memory_budget.device_budget([gpu(60 * 2**30, 0), gpu(60 * 2**30, 10 * 2**30)])
    assert (b.sharing, b.available, b.per_device) == (1, 50 * 2**30, 50 * 2**30 * 0.95)
    no_stats = types.SimpleNamespace(platform="tpu", memory_stats=lambda: None)
    assert memory_budget.device_budget([no_stats]) is None


def test_candidates_move_data_to_fsdp_with_its_dcn_factor(make_config):
    cfg = make_config("gpt2_tiny_dp8")
    shape = {"data": 8, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1}
    flags = [f.flags() for f in memory_check.candidates(cfg, shape, {"data": 2, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1})]
    assert flags[:3] == ["--config.model.remat=save_dots", "--config.train.grad_accum_steps=2", "--config.layout=zero1"]
    assert "--config.layout=fsdp --config.mesh.shape=fsdp:8 --config.mesh.dcn=fsdp:2" in flags
    assert flags[-2:] == ["--config.train.batch_size=16", "--config.train.batch_size=8"]  # the recipe changes last


def test_skip_memory_check_must_be_a_bool():
    memory_check.check_config(types.SimpleNamespace(skip_memory_check=True))
    with pytest.raises(UserError, match="skip_memory_check='yes': must be true or false"):
        memory_check.check_config(types.SimpleNamespace(skip_memory_check="yes"))


# gpt2_tiny_dp8's compiled peak per device grows by about 18 KiB with each unit of
# model.mlp_dim (4.6 GiB at 262,144), while its compile stays the tiny model's: a step as
# far out of this host's reach as GPT-2 small's 17 GiB a device, compiled in a third of
# the time (its fix search compiles tiny candidates too).
PEAK_PER_MLP_UNIT = 18 * 2**10


@pytest.mark.slow
def test_a_step_too_large_for_this_host_stops_before_allocating():
    """The real host and the real command: gpt2_tiny_dp8 with mlp_dim the power of two
    whose step needs 2-4x the RAM this host has available (eight simulated devices share
    it), refused before anything is allocated, with the arithmetic and a fix that fits."""
    mlp_dim = 2 ** math.ceil(math.log2(2 * memory_budget.host_available()[0] / 8 / PEAK_PER_MLP_UNIT))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "meshtrain.train", "--config=gpt2_tiny_dp8",
                        f"--config.model.mlp_dim={mlp_dim}"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - t0
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "memory check" not in r.stdout and "lr: " not in r.stdout  # nothing after the check ran
    m = re.search(r"8 simulated CPU devices share this host's RAM: 8 x (\d+\.\d+) GiB = (\d+\.\d) GiB against "
                  r"(\d+\.\d) GiB available", r.stderr)
    assert m, r.stderr[-3000:]
    each, total, available = map(float, m.groups())
    assert abs(8 * each - total) <= 8 * 0.05 + 0.05 and total > available  # each shown to 0.1 GiB
    assert "The cheapest fix the planner knows that fits" in r.stderr, r.stderr
    assert took < 300


@pytest.mark.parametrize("name, schedule", [("gpt2_tiny_pp4_dp2", "1f1b"),
                                            ("gpt2_tiny_pp4_dp2_circular", "interleaved")])
def test_a_gpipe_run_that_does_not_fit_is_offered_1f1b_first(make_config, name, schedule):
    """The 1F1B counterpart keeps 2S-1 microbatches per stage for the same compute: the
    cheapest fix, before any recompute; with stashed inputs alone it comes after save_dots."""
    cfg = make_config(name)
    shape = {"data": 2, "stage": 4, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1}
    flags = [f.flags() for f in memory_check.candidates(cfg, shape, None)]
    assert flags[0] == f"--config.pipeline.schedule={schedule} --config.pipeline.stash=residuals"
    assert flags[1] == "--config.model.remat=save_dots"
    assert flags[2] == f"--config.pipeline.schedule={schedule} --config.pipeline.stash=inputs"
    unpipelined = [f.flags() for f in memory_check.candidates(make_config("gpt2_tiny_dp8"), shape, None)]
    assert not any("pipeline" in f for f in unpipelined)
