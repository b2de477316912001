"""The measurements benchmarks/gpu.py makes, each in a child process of its own (so the peak
memory JAX reports belongs to one run): the device probe, and one (model, remat) run that
picks the largest batch that fits and times it.

FLOPs per token, two conventions (both count a training step as 3 x the forward matmuls):

  llm.c  6 N + 6 L D T       meshtrain.runlog.metrics.flops_per_token, what the training log
                             uses: causal attention counted at half (karpathy/llm.c
                             train_gpt2.cu, gpt2_estimate_mfu)
  PaLM   6 N + 12 L H Q T    attention's QK^T and AV matmuls over the full T x T square,
                             forward and backward (Chowdhery et al. 2022, arXiv 2204.02311,
                             appendix B; H heads of width Q, so H Q = D here)

N is the same in both: every parameter the matmuls touch, the tied embedding once (as
meshtrain's families count it). PaLM's own N includes its shared embedding: its 46.2%
MFU for 540B at 238.3K tokens/s on 6,144 TPU v4 is reproduced with all 540.35B, not
with the non-embedding count (45.8%). MFU = FLOPs per token x tokens/s / peak, with the
dense bf16 peak of meshtrain.runlog.metrics.PEAK_FLOPS; null (with a reason) where it is unknown.
"""

from __future__ import annotations

import gc
import importlib.metadata
import pathlib
import shutil
import statistics
import subprocess
import time

import jax

from meshtrain import config as config_lib, models
from meshtrain.run.experiment import Experiment
from meshtrain.runlog import metrics

# A mixture of experts at GPT-2 small's width (12 layers, d=768, 12 query and 4 kv heads,
# 32K vocabulary): 8 SwiGLU experts of width 1024, 2 per token, under both dispatches,
# dropless's grouped matmuls as windows (moe.grouped_matmul's auto today) and as
# jax.lax.ragged_dot, beside its dense twin of equal active parameters (mlp 2048, without
# the router's D X).
_MOE_SMALL = {"model.num_layers": 12, "model.num_heads": 12, "model.num_kv_heads": 4,
              "model.embed_dim": 768, "model.vocab_size": 32_000}
_MOE_EXPERTS = dict(_MOE_SMALL, **{"model.mlp_dim": 1024, "model.num_experts": 8,
                                   "model.experts_per_token": 2})

# name -> (model.name, model.size, seq_len, overrides); gpt2_tiny is for --allow-cpu (the tests).
MODELS = {
    "gpt2_small": ("gpt2", "small", 1024, {}),
    "gpt2_medium": ("gpt2", "medium", 1024, {}),
    "llama3_1b": ("llama", "llama3_1b", 2048, {}),
    "moe_small_dropless": ("mixtral", "tiny", 1024, dict(_MOE_EXPERTS, **{"moe.dispatch": "dropless"})),
    "moe_small_ragged": ("mixtral", "tiny", 1024, dict(_MOE_EXPERTS, **{"moe.dispatch": "dropless",
                                                                        "moe.grouped_matmul": "ragged_dot"})),
    "moe_small_capacity": ("mixtral", "tiny", 1024, dict(_MOE_EXPERTS, **{"moe.dispatch": "capacity"})),
    "moe_small_dense_twin": ("llama", "tiny", 1024, dict(_MOE_SMALL, **{"model.mlp_dim": 2048})),
    "gpt2_tiny": ("gpt2", "tiny", 128, {}),
}
PACKAGES = ("jax", "jaxlib", "flax", "optax", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
            "jax-cuda13-pjrt", "nvidia-cudnn-cu12", "nvidia-cublas-cu12", "nvidia-nccl-cu12",
            "nvidia-cudnn-cu13", "nvidia-nccl-cu13")
GIB = 2**30


def versions() -> dict:
    """Installed package versions, and the CUDA / cuDNN versions JAX loaded (GPU only)."""
    out = {}
    for pkg in PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        from jax._src.lib import cuda_versions  # None without a CUDA plugin; private, hence guarded
    except ImportError:
        cuda_versions = None
    for key, fn in (("cuda_runtime", "cuda_runtime_get_version"), ("cudnn", "cudnn_get_version"),
                    ("cuda_driver", "cuda_driver_get_version")):
        try:
            out[key] = getattr(cuda_versions, fn)()
        except Exception:  # absent on this build or no GPU: leave it out
            pass
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        if smi.returncode == 0 and smi.stdout.strip():
            out["nvidia_driver"] = smi.stdout.strip().splitlines()[0]
    return out


def probe() -> dict:
    """What runs the benchmark: the first device and its memory, the versions."""
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return {"platform": device.platform, "device_kind": device.device_kind,
            "device_count": jax.device_count(), "bytes_limit": stats.get("bytes_limit"),
            "peak_flops": metrics.peak_flops(device), "versions": versions()}


def make_config(model: str, remat: str, batch: int, overrides: list[tuple[str, str]] = ()):
    """One GPU, bf16 compute with float32 params and Adam (base()'s defaults), synthetic data."""
    family, size, seq_len, own = MODELS[model]
    c = config_lib.base(size=size, mesh="data:1", layout="dp")
    c.model.name = family
    c.model.seq_len = seq_len
    c.model.dtype = "bfloat16"
    c.model.remat = remat
    c.train.update(batch_size=batch, steps=10_000, eval_every=0)
    for key, value in [*((k, str(v)) for k, v in own.items()), *overrides]:
        config_lib.override(c, key, value)
    return c


def palm_flops_per_token(m) -> float:
    """6 N + 12 L H Q T: llm.c's count with its causal 6 L D T replaced by the full square."""
    llmc_attention = 6.0 * m.num_layers * m.embed_dim * m.seq_len
    return metrics.flops_per_token(m) - llmc_attention + 12.0 * m.num_layers * m.num_heads * m.head_dim * m.seq_len


def batches_from(cap: int) -> list[int]:
    """Rows per step to try, largest first: cap, then powers of two below it, down to 1."""
    out, b = [cap], 1 << (cap.bit_length() - 1)
    while b >= 1:
        if b < cap:
            out.append(b)
        b //= 2
    return out


def memory_limit(device) -> int | None:
    """Bytes the device's allocator may hand out (None on CPU, which reports no stats)."""
    return (device.memory_stats() or {}).get("bytes_limit")


def is_oom(e: BaseException) -> bool:
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


PROFILED_STEPS = 3


def measure(exp: Experiment, compiled, steps: int, repeats: int, warmup: int, profile: str | None = None):
    """Warm-up, then `repeats` x `steps` steps, blocking once at the end of each repeat, on 4
    batches already on the device: -> (seconds per step of each repeat, last loss). With
    `profile` (a directory), PROFILED_STEPS more steps after the timed ones, traced there
    by JAX's profiler (benchmarks/trace_summary.py sums the trace by kernel)."""
    state = exp.init_state()
    rows = exp.train_batches()
    batches = [exp.put_batch(next(rows)) for _ in range(4)]  # [B, T+1] int32 each
    for i in range(warmup):
        state, metrics = compiled(state, batches[i % 4])
    jax.block_until_ready((state, metrics))
    per_step = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(steps):
            state, metrics = compiled(state, batches[i % 4])
        jax.block_until_ready((state, metrics))
        per_step.append((time.perf_counter() - t0) / steps)
    if profile:
        with jax.profiler.trace(profile):
            for i in range(PROFILED_STEPS):
                state, metrics = compiled(state, batches[i % 4])
            jax.block_until_ready((state, metrics))
    return per_step, float(metrics["loss"])


def run(model: str, remat: str, cap: int, steps: int, repeats: int, warmup: int,
        overrides: list[tuple[str, str]] = (), say=print, profile: str | None = None) -> dict:
    """The largest batch from `cap` down that fits, timed: one result row (see gpu.py); with
    `profile`, that batch's trace in PROFILE/MODEL-REMAT."""
    device = jax.devices()[0]
    limit = memory_limit(device)
    tried = []
    for batch in batches_from(cap):
        cfg = make_config(model, remat, batch, overrides)
        exp = Experiment.build(cfg, devices=[device])
        t0 = time.perf_counter()
        try:
            compiled = exp.compile()
        except Exception as e:
            if not is_oom(e):
                raise
            tried.append({"batch": batch, "outcome": "out of memory while compiling"})
            continue
        compile_s = time.perf_counter() - t0
        memory = metrics.memory_report(compiled)
        estimate = memory.get("peak_estimate")
        if limit and estimate and estimate > limit:
            tried.append({"batch": batch, "outcome": f"compiled estimate {estimate / GIB:.1f} GiB > "
                                                     f"the {limit / GIB:.1f} GiB the allocator has"})
            say(f"{model} remat={remat} batch {batch}: {tried[-1]['outcome']}")
            continue
        say(f"{model} remat={remat} batch {batch}: compiled in {compile_s:.1f}s, estimate "
            f"{(estimate or 0) / GIB:.2f} GiB; timing {repeats} x {steps} steps after {warmup} warm-up")
        try:
            per_step, loss = measure(exp, compiled, steps, repeats, warmup,
                                     profile=profile and str(pathlib.Path(profile) / f"{model}-{remat}"))
        except Exception as e:
            if not is_oom(e):
                raise
            per_step = None
        if per_step is None:  # out here, where the exception's frames (and the state) are gone
            tried.append({"batch": batch, "outcome": "out of memory at run time (RESOURCE_EXHAUSTED)"})
            say(f"{model} remat={remat} batch {batch}: {tried[-1]['outcome']}")
            del exp, compiled
            gc.collect()
            jax.clear_caches()
            continue
        tried.append({"batch": batch, "outcome": "fits" + (" (the first tried)" if batch == cap else "")})
        return _row(model, remat, exp, device, limit, memory, compile_s, per_step, loss, tried)
    return {"model": model, "remat": remat, "error": f"no batch from {cap} down to 1 fits", "batch_search": tried}


def _row(model, remat, exp, device, limit, memory, compile_s, per_step, loss, tried) -> dict:
    m = exp.model.cfg
    tokens = exp.cfg.train.batch_size * m.seq_len
    median = statistics.median(per_step)
    tokens_per_s = tokens / median
    flops = {"llmc": metrics.flops_per_token(m), "palm": palm_flops_per_token(m)}
    peak = metrics.peak_flops(device)
    stats = device.memory_stats() or {}
    in_use = stats.get("peak_bytes_in_use")
    choice = getattr(models, "attention_choice", None)  # model.attention's resolution, where it exists
    return {
        "model": model, "family": exp.model.family.name, "seq_len": m.seq_len, "remat": remat,
        "num_params": exp.num_params(),
        "attention": getattr(m, "attention", None) or exp.cfg.model.get("attention"),
        "attention_why": choice(exp.cfg.model.attention, m)[1] if choice else None,
        "batch": exp.cfg.train.batch_size, "tokens_per_step": tokens, "batch_search": tried,
        "compile_s": compile_s,
        "step_s": per_step, "step_s_median": median,
        "spread": (max(per_step) - min(per_step)) / median,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops, "flops_convention": metrics.flops_convention(m),
        "model_tflops_per_s": {k: v * tokens_per_s / 1e12 for k, v in flops.items()},
        "mfu": {k: (v * tokens_per_s / peak if peak else None) for k, v in flops.items()},
        "mfu_note": None if peak else (f"no dense bf16 peak known for device kind {device.device_kind!r} "
                                       f"(meshtrain.runlog.metrics.PEAK_FLOPS), so no MFU"),
        "memory": {"peak_bytes_in_use": in_use, "bytes_limit": limit, "compiled": memory,
                   "peak_over_estimate": in_use / memory["peak_estimate"]
                   if in_use and memory.get("peak_estimate") else None,
                   "peak_includes_failed_attempt": any("run time" in t["outcome"] for t in tried)},
        "loss_last": loss,
    }
