#!/usr/bin/env bash
# One GPU session's measurements in one call, most valuable first, each bounded in time, so
# that a lease of a few minutes brings back what it could (the results land in $OUT as they
# are made; without $OUT, in runs/gpu_session/):
#
#   1. benchmarks/gpu.py: GPT-2 small (remat none and full), the bare-JAX comparison
#      (stage `overhead` runs that alone);
#   2. a profiler trace of GPT-2 small's training step (steps 10-12 of `meshtrain train`),
#      summed by kernel here by benchmarks/trace_summary.py;
#   3. benchmarks/gpu.py: the mixture of experts at GPT-2 small's width, dropless (its
#      grouped matmuls as windows, and as jax.lax.ragged_dot) and capacity, beside its
#      dense twin (benchmarks/gpu_runs.py MODELS); `moe_profile` traces dropless and the
#      dense twin and sums each by kernel; `moe_fusion` runs dropless's ragged_dot with
#      XLA's cuDNN ragged-dot fusion;
#   4. the MoE and GPU-benchmark tests under JAX_PLATFORMS=cpu (the device
#      image's JAX, not CI's pin);
#   5. GPT-2 medium and Llama 3.2 1B (T=2048), remat none and full;
#   6. `unrolled`: GPT-2 small with model.scan_layers=false beside the scanned step of
#      stage 1 (which default each backend should take); `scan_fusion` (not in the
#      defaults): the scanned step with --xla_gpu_enable_dynamic_slice_fusion=true;
#   7. `tests_jax`: the pipeline, 1F1B and planner-pipeline tests under JAX_PLATFORMS=cpu
#      with the image's JAX, once as CI runs them and once with XLA:CPU's YNN fusions off
#      (--xla_cpu_experimental_ynn_fusion_type=, the lead of jax-ml/jax#39257 for the
#      pipelined CPU compiles that aborted on JAX 0.11.2).
#   8. `offload` (not in the defaults; a call of its own, about 6 minutes): GPT-2 medium and
#      Llama 3.2 1B, remat full, at one batch (--max-batch 8) without offload, with
#      train.offload=opt_state and with opt_state,params: step time, peak device memory
#      (memory_stats) beside the compiled estimate and the host share, and the offload tests
#      under the image's JAX on CPU. The planner's figures for the same runs (device and host
#      shares, the host link's time) come first, from `meshtrain plan`.
#
# The planner's predictions for these runs are committed before the session, in
# benchmarks/results/predictions.json (`python benchmarks/planner_calibration.py
# --predict`); the session copies them beside its results.
#
# Where a package the project needs is missing on the machine, wheels in .whl/ are installed
# first (docs/benchmarks.md says which and how they are fetched).
#
#     bash benchmarks/gpu_session.sh [SECONDS_FOR_TESTS]
#     STAGES="moe_fusion overhead tests" bash benchmarks/gpu_session.sh   # some stages, in order
#
# On the H200 (2026-11-28) the stages took: gpt2_small (with the bare-JAX comparison) 114 s,
# profile 28 s, moe 138 s, gpt2_medium 77 s, llama3_1b 190 s, unrolled 40 s; moe_profile
# is new (about 70 s expected). The default stages are past one device call's 10 minutes:
# split them in two, and run tests_jax, which needs only the CPU, beside the GPU stages on
# the other cores (each with its own OUT, as $OUT holds at most 8 files to bring back):
#     OUT=/tmp/t STAGES=tests_jax taskset -c 8-15 bash benchmarks/gpu_session.sh 300 &
#     OUT=/tmp/a STAGES="gpt2_small moe moe_profile gpt2_medium" taskset -c 0-7 bash benchmarks/gpu_session.sh
#     STAGES="llama3_1b profile unrolled" bash benchmarks/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_session}
mkdir -p "$OUT"
TEST_SECONDS=${1:-100}
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/smi.txt"

step() {  # step NAME SECONDS CMD...: run CMD bounded, its log in $OUT/NAME.log
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${secs}s)"
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
  echo "=== $name: rc $? in $((SECONDS - t0))s"
  tail -n 25 "$OUT/$name.log"
}

RESULTS=$OUT/gpu.json
MOE="moe_small_dropless,moe_small_ragged,moe_small_capacity,moe_small_dense_twin"
stage() {
  case $1 in
    gpt2_small) step gpt2_small 200 python3 benchmarks/gpu.py --models gpt2_small --remat none,full \
        --steps 20 --repeats 3 --warmup 5 --overhead-pairs 10 --out "$RESULTS" ;;
    overhead) step overhead 120 python3 benchmarks/overhead.py --config gpt2_small_dp8 \
        --config.mesh.shape=data:1 --config.train.batch_size=64 --config.model.dtype=bfloat16 \
        --devices 1 --pairs 10 --warmup 5 ;;
    profile)
      local prof=/tmp/meshtrain_profile
      step profile 90 python3 -m meshtrain.train --config=gpt2_small_dp8 --config.mesh.shape=data:1 \
        --config.train.steps=12 --config.train.profile=10:12 --config.train.eval_every=0 \
        --config.train.log_every=1 --workdir=$prof
      local trace; trace=$(find $prof/profile -name '*.trace.json.gz' | head -n 1)
      [ -n "$trace" ] && cp "$trace" "$OUT/gpt2_small.trace.json.gz" ;;
    moe) step moe 200 python3 benchmarks/gpu.py --models "$MOE" --remat none --max-batch 32 \
        --steps 20 --repeats 3 --warmup 5 --overhead-pairs 0 --out "$RESULTS" ;;
    # Where the dropless step goes beside its dense twin's: each traced for 3 steps at the
    # batch the moe stage found, summed by kernel (the planner has no MoE profile yet).
    moe_profile)
      local dir=/tmp/meshtrain_moe_profile
      step moe_profile 150 python3 benchmarks/gpu.py --models moe_small_dropless,moe_small_dense_twin \
        --remat none --max-batch 32 --steps 5 --repeats 1 --warmup 3 --overhead-pairs 0 \
        --out /tmp/moe_profile.json --profile $dir
      local m trace
      for m in moe_small_dropless moe_small_dense_twin; do
        trace=$(find "$dir/$m-none" -name '*.trace.json.gz' 2>/dev/null | head -n 1)
        [ -n "$trace" ] && python3 benchmarks/trace_summary.py "$trace" >"$OUT/$m.kernels.md" 2>&1
      done ;;
    # XLA lowers jax.lax.ragged_dot on NVIDIA GPUs to a dense dot over every group unless
    # its cuDNN ragged-dot fusion is switched on (docs/benchmarks.md): dropless's ragged_dot
    # with it (the windows have no ragged_dot for the flag to change).
    moe_fusion) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_experimental_use_ragged_dot_fusion=true" \
        step moe_fusion 120 python3 benchmarks/gpu.py --models moe_small_ragged --remat none \
        --max-batch 32 --steps 20 --repeats 3 --warmup 5 --overhead-pairs 0 --out "$OUT/gpu_fusion.json" ;;
    gpt2_medium) step gpt2_medium 200 python3 benchmarks/gpu.py --models gpt2_medium --remat none,full \
        --steps 10 --repeats 3 --warmup 3 --overhead-pairs 0 --out "$RESULTS" ;;
    llama3_1b) step llama3_1b 240 python3 benchmarks/gpu.py --models llama3_1b --remat none,full \
        --steps 10 --repeats 3 --warmup 3 --overhead-pairs 0 --out "$RESULTS" ;;
    unrolled) step unrolled 150 python3 benchmarks/gpu.py --models gpt2_small --remat none \
        --steps 20 --repeats 3 --warmup 5 --overhead-pairs 0 --out "$OUT/gpu_unrolled.json" \
        --config.model.scan_layers=false ;;
    # The scanned stack with XLA's dynamic-slice fusion, which may write the layer scan's
    # saved activations in place instead of copying them (the profile's 19.2 ms of copies).
    scan_fusion) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dynamic_slice_fusion=true" \
        step scan_fusion 120 python3 benchmarks/gpu.py --models gpt2_small --remat none --steps 20 \
        --repeats 3 --warmup 5 --overhead-pairs 0 --out "$OUT/gpu_scan_fusion.json" ;;
    tests_jax)
      local files="tests/test_pipeline.py tests/test_pipeline_1f1b.py tests/test_pipeline_zb.py tests/test_planner_pipeline.py"
      JAX_PLATFORMS=cpu step tests_jax "$TEST_SECONDS" python3 -m pytest -q -n 16 -p no:cacheprovider $files
      XLA_FLAGS="${XLA_FLAGS:-} --xla_cpu_experimental_ynn_fusion_type=" JAX_PLATFORMS=cpu \
        step tests_jax_no_ynn "$TEST_SECONDS" python3 -m pytest -q -n 16 -p no:cacheprovider $files ;;
    offload)
      local o m
      for m in gpt2_medium_dp8_tp4 llama3_1b_fsdp8; do  # planned first (formulas; CPU compile)
        JAX_PLATFORMS=cpu step "plan_$m" 150 python3 -m meshtrain.plan --config=$m --config.mesh.shape=data:1 \
          --config.layout=dp --config.model.remat=full --config.train.batch_size=8 --config.train.grad_accum_steps=1 \
          --config.train.offload=opt_state,params --json
      done
      for o in none opt_state opt_state,params; do
        step "offload_${o//,/_}" 200 python3 benchmarks/gpu.py --models gpt2_medium,llama3_1b --remat full \
          --max-batch 8 --steps 10 --repeats 3 --warmup 3 --overhead-pairs 0 \
          --out "$OUT/gpu_offload_${o//,/_}.json" --config.train.offload=$o
      done
      JAX_PLATFORMS=cpu step tests_offload "$TEST_SECONDS" python3 -m pytest -q -n 16 -p no:cacheprovider \
        tests/test_offload.py
      # $OUT brings back at most 8 files: the stage's logs travel as one
      (cd "$OUT" && tar czf offload_logs.tgz plan_*.log offload_*.log tests_offload.log \
        && rm -f plan_*.log offload_*.log tests_offload.log) ;;
    tests) JAX_PLATFORMS=cpu step tests "$TEST_SECONDS" python3 -m pytest -q -n 16 -p no:cacheprovider \
        tests/test_moe.py tests/test_moe_layouts.py tests/test_planner_experts.py tests/test_gpu_bench.py ;;
    *) echo "unknown stage $1 (gpt2_small overhead profile moe moe_profile moe_fusion tests gpt2_medium" \
         "llama3_1b unrolled scan_fusion tests_jax offload)"; return 2 ;;
  esac
}
[ -f benchmarks/results/predictions.json ] && cp benchmarks/results/predictions.json "$OUT/"
for s in ${STAGES:-gpt2_small profile moe moe_profile gpt2_medium llama3_1b unrolled tests_jax}; do stage "$s"; done
ls -la "$OUT"
