"""benchmarks/trace_summary.py on a trace written here in the profiler's format: device
kernels summed by kind per step, host events left out, and unreadable input refused."""

import gzip
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import trace_summary  # noqa: E402

EVENTS = [
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/host:CPU"}},
    {"ph": "X", "pid": 1, "tid": 3, "name": "nvjet_sm90_tst_128x160_64x5_2x1_v_bz_TNT", "dur": 600.0},
    {"ph": "X", "pid": 1, "tid": 3, "name": "cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "dur": 300.0},
    {"ph": "X", "pid": 1, "tid": 3, "name": "memcpy128", "dur": 40.0},
    {"ph": "X", "pid": 1, "tid": 3, "name": "loop_dynamic_update_slice_fusion_15", "dur": 20.0},
    {"ph": "X", "pid": 1, "tid": 3, "name": "loop_multiply_fusion", "dur": 40.0},
    {"ph": "X", "pid": 1, "tid": 4, "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "dur": 200.0},
    {"ph": "X", "pid": 7, "tid": 9, "name": "train_step", "dur": 5000.0},  # host: not device time
]


def test_kinds_per_step_and_shares(tmp_path):
    path = tmp_path / "host.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trace_summary.py"), str(path),
                          "--steps", "2"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "device kernel time: 0.60 ms per step (2 steps traced)" in text  # 1200 us over 2 steps
    assert "| matmul | 0.30 | 50.0% |" in text
    assert "| attention | 0.15 | 25.0% |" in text
    assert "| collective | 0.10 | 16.7% |" in text
    assert "| memcpy/memset | 0.02 | 3.3% |" in text
    assert "| loop buffers (dynamic-update-slice) | 0.01 | 1.7% |" in text
    assert "| other fusions | 0.02 | 3.3% |" in text
    assert "train_step" not in text


def test_a_trace_without_device_kernels_says_so():
    assert trace_summary.summarise(trace_summary.device_kernels({"traceEvents": EVENTS[1:2]}), 1, 5) == [
        "no device kernels in the trace (a CPU run's trace has none)"]


def test_an_unreadable_trace_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "bad.trace.json"
    bad.write_text("{not json")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trace_summary.py"), str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("trace_summary: cannot read") and not out.stdout
