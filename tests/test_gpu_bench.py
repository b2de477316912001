"""benchmarks/gpu.py on this CPU machine: the one-line refusal without a GPU, and the whole
path (probe, batch search, timing, MFU, JSON, docs table; the bare-JAX comparison apart) on
CPU with --allow-cpu and a one-layer GPT-2 tiny."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu  # noqa: E402
import gpu_report  # noqa: E402
import gpu_runs  # noqa: E402

from support.processes import own_devices_env  # noqa: E402

TINY = [("model.dtype", "float32"), ("model.num_layers", "1")]  # the fastest compile on CPU


def cpu_env() -> dict:
    """One CPU device, and the suite's XLA flags (tests/conftest.py: its compiles, 2x less
    CPU; the GPU flags gpu.py adds to them touch no CPU compile)."""
    return own_devices_env(JAX_PLATFORMS="cpu")


def bench(*args):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), *args], env=cpu_env(),
                          cwd=ROOT, capture_output=True, text=True)


def test_without_a_gpu_it_stops_with_one_line_and_status_2():
    out = bench()
    assert out.returncode == 2
    assert out.stderr.strip() == ("benchmarks/gpu.py needs a GPU; jax sees only cpu devices. Run it on a "
                                  "GPU machine (docs/benchmarks.md), or pass --allow-cpu for the CPU "
                                  "smoke run the tests use.")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One CPU run of the whole path: (results JSON, stdout)."""
    out_file = tmp_path_factory.mktemp("gpu") / "cpu.json"
    out = bench("--allow-cpu", "--models=gpt2_tiny", "--remat=none", "--steps=2", "--repeats=2",
                "--warmup=1", "--max-batch=3", "--overhead-pairs=0", f"--out={out_file}",
                f"--profile={tmp_path_factory.mktemp('traces', numbered=False)}",
                *(f"--config.{k}={v}" for k, v in TINY))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out_file.read_text()), out.stdout


def test_profile_traces_each_run_in_its_own_directory(smoke, tmp_path_factory):
    """--profile DIR: the profiler's trace of the run's extra steps, in DIR/MODEL-REMAT."""
    found = list((tmp_path_factory.getbasetemp() / "traces" / "gpt2_tiny-none").rglob("*.trace.json.gz"))
    assert len(found) == 1 and found[0].stat().st_size > 0


def test_the_cpu_run_writes_every_field_with_sane_values(smoke):
    results, stdout = smoke
    assert results["device"]["platform"] == "cpu" and results["device"]["versions"]["jax"]
    (run,) = results["runs"]
    assert (run["model"], run["remat"], run["seq_len"]) == ("gpt2_tiny", "none", 128)
    # No memory limit on CPU, so the cap (3) fits and is taken.
    assert run["batch"] == 3 and run["batch_search"] == [{"batch": 3, "outcome": "fits (the first tried)"}]
    assert run["tokens_per_step"] == 3 * 128 and run["tokens_per_s"] > 0
    assert len(run["step_s"]) == 2 and run["spread"] >= 0 and run["compile_s"] > 0
    assert run["flops_per_token"]["palm"] > run["flops_per_token"]["llmc"] > 0
    # CPU has no known peak: MFU is null with the reason, not a crash.
    assert run["mfu"] == {"llmc": None, "palm": None} and "no dense bf16 peak" in run["mfu_note"]
    assert run["memory"]["compiled"]["peak_estimate"] > 0
    assert run["attention"] == "xla" and run["loss_last"] > 0
    assert results["best_remat"]["gpt2_tiny"]["remat"] == "none"
    assert results["overhead"] is None  # --overhead-pairs=0
    assert "| gpt2_tiny | **none** | 3 x 128 |" in stdout


def test_the_bare_jax_comparison_is_benchmarks_overhead_py_parsed():
    o = gpu.overhead("gpt2_tiny", 2, 1, 1, cpu_env(), TINY)
    assert o["command"].startswith("python benchmarks/overhead.py --config gpt2_tiny_dp8")
    assert o["model"] == "gpt2_tiny" and o["batch"] == 2 and "error" not in o, o
    assert o["ratio"] > 0 and o["iqr"][0] <= o["ratio"] <= o["iqr"][1] and o["bare_ms"] > 0
    assert o["equal"].startswith("flops equal: True; collectives equal: True")
    results = {"overhead": o}
    assert "on gpt2_tiny, " in "\n".join(gpu_report.goals_table(results))


def test_docs_rewrite_replaces_only_the_marked_section(smoke, tmp_path):
    results, _ = smoke
    doc = tmp_path / "benchmarks.md"
    doc.write_text((ROOT / "docs" / "benchmarks.md").read_text())
    before = doc.read_text()
    assert before.count(gpu_report.BEGIN) == before.count(gpu_report.END) == 1
    gpu_report.rewrite_docs(results, doc)
    after = doc.read_text()
    head, tail = before.split(gpu_report.BEGIN)[0], before.split(gpu_report.END)[1]
    assert after.startswith(head) and after.endswith(tail)
    assert "| gpt2_tiny | **none** | 3 x 128 |" in after and "Measured on 1 x cpu" in after


def test_flops_conventions_match_the_reference_numbers():
    """GPT-2 small at V=50257: llm.c 6N + 6LDT and PaLM 6N + 12LHQT (docs/benchmarks.md)."""
    from meshtrain import models
    from meshtrain.runlog import metrics
    m = models.model_config(gpu_runs.make_config("gpt2_small", "none", 8).model, vocab_size=50257, vocab_shards=1)
    n, l, d, t = 124_439_808, 12, 768, 1024
    assert metrics.flops_per_token(m) == 6 * n + 6 * l * d * t  # 803.3M
    assert gpu_runs.palm_flops_per_token(m) == 6 * n + 12 * l * d * t  # 859.9M


def test_batches_are_tried_from_the_cap_down_by_halving():
    assert gpu_runs.batches_from(64) == [64, 32, 16, 8, 4, 2, 1]
    assert gpu_runs.batches_from(48) == [48, 32, 16, 8, 4, 2, 1]
    assert gpu_runs.batches_from(1) == [1]


def test_the_batch_search_steps_down_past_the_estimate_and_an_oom_at_run_time(monkeypatch):
    """Batch 4's compiled estimate is over the limit; batch 2 fits the estimate but runs out of
    memory; batch 1 is measured. (The estimates and the OOM are stand-ins: CPU has neither.)"""
    estimates = iter([200, 50, 25])
    monkeypatch.setattr(gpu_runs, "memory_limit", lambda device: 100)
    monkeypatch.setattr(gpu_runs.metrics, "memory_report", lambda compiled: {"peak_estimate": next(estimates)})
    calls = []

    def measure(exp, compiled, steps, repeats, warmup, profile=None):
        calls.append(exp.cfg.train.batch_size)
        if len(calls) == 1:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB.")
        return [0.01, 0.02], 5.5

    monkeypatch.setattr(gpu_runs, "measure", measure)
    row = gpu_runs.run("gpt2_tiny", "full", cap=4, steps=2, repeats=2, warmup=1, overrides=TINY, say=lambda s: None)
    assert calls == [2, 1] and row["batch"] == 1
    assert [t["outcome"] for t in row["batch_search"]] == [
        "compiled estimate 0.0 GiB > the 0.0 GiB the allocator has",
        "out of memory at run time (RESOURCE_EXHAUSTED)", "fits"]
    assert row["memory"]["peak_includes_failed_attempt"] is True
    assert row["step_s_median"] == 0.015 and abs(row["spread"] - 0.01 / 0.015) < 1e-12
    assert row["tokens_per_s"] == 128 / 0.015


def test_the_bare_jax_comparison_needs_a_pair():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--pairs", "0"],
                          capture_output=True, text=True, env=cpu_env())
    assert done.returncode == 2
    assert "--pairs must be >= 1 and --warmup >= 0; got 0 and 5" in done.stderr
