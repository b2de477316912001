"""The layout planner: what a config will cost before it runs (docs/planner.md).

  hardware   the device table (peaks, memory, links) the predictions use
  analytic   memory per device by the formulas
  bounds     the least collective traffic a layout must send, by the formulas
  split_cost  the splits that move activations: one protocol, registered in bounds.SPLIT_COSTS
  halo, context, experts   a spatial layout's halo rows, context parallelism's k and v, the MoE all-to-alls
  beyond_bounds  the traffic those bounds do not count: known excess, axes with no formula
  pipeline_memory  a pipelined step's activations per schedule (gpipe, circular, 1f1b, interleaved)
  hlo, hlo_flops   a compiled program's collectives, loops counted; its matmul and conv FLOPs
  report   compile one config's train step and set it beside the formulas
  roofline, work   the predicted step time; the work beside its matmuls (attention, memory-bound bytes)
  search, compile_pool, ranking   enumerate layouts, predict by formula, compile the few that can win
                 (in worker processes, cached on disk), rank them and name the winner's command
  lint, findings, lint_sharding, lint_experts   the layout linter: its findings, sharding and MoE checks
  accumulation  train.accum_gather="auto": gather fsdp params once per step, or per microbatch
  host_offload, capacity   train.offload's device and host shares and host-link time; the
                 largest model that fits, with and without offload (--largest)

Beside it: --verify (a layout trained against one device) is meshtrain/run/verify.py, the
check at a run's start that its step fits (and the cheapest fix the formulas find)
meshtrain/run/memory_check.py with its budget meshtrain/run/memory_budget.py, the reports
drawn (the notebooks' pictures, the terminal's text) meshtrain/pictures/, the generators
of docs/planner.md's tables tools/docs_tables.py (not shipped), and the sequence-parallel
HLO reader tests/support/sequence_parallel.py.
"""


def fast_compile() -> dict[str, str]:
    """Puts the analysis compile options (compile_options.ANALYSIS_OPTIONS: the planner reads the
    partitioned HLO, its buffers and collectives, never runs the machine code) into XLA_FLAGS,
    for every compile of this process and the processes it starts, those this jaxlib knows
    and XLA_FLAGS does not set already (xla_flags.add_known: an unknown flag would
    abort the process; JAX 0.11 has no xla_cpu_use_fusion_emitters). For a process that only
    plans (`meshtrain plan`, the notebooks); call before JAX starts its backend; returns the
    flags added. Experiment.compile(analysis=True) uses the same options for one compile."""
    from meshtrain.run.compile_options import ANALYSIS_OPTIONS
    from meshtrain.xla_flags import add_known
    return add_known({k: str(v).lower() for k, v in ANALYSIS_OPTIONS.items()})
