"""The layout planner: what a config will cost before it runs (docs/planner.md).

  hardware   the device table (peaks, memory, links) the predictions use
  analytic   memory by the formulas; bounds: the collective lower bounds, split_cost: per axis
  beyond_bounds  the traffic those bounds do not count: known excess, axes with no formula
  halo       a spatial layout's halo exchanges (conv rows across split boundaries) by formula
  pipeline_memory  a pipelined step's activations per schedule (gpipe, circular, 1f1b, interleaved)
  report     compile one config's train step and set it beside the formulas
  roofline   the predicted step time
  search     enumerate layouts for a device count, predict by formula, compile the few that can win
  compile_pool  the search's compiles, in worker processes, cached on disk
  ranking    the search's ranking, the winner as a command, the config's own layout's rank
  lint       the layout linter (findings: what it reports; lint_sharding: its sharding checks)
  memory_check  whether a compiled step fits the devices it will run on, and the cheapest fix
  accumulation  train.accum_gather="auto": gather fsdp params once per step, or per microbatch
  text       the report for a terminal

Beside it: --verify (a layout trained against one device) is meshtrain/run/verify.py, the
memory budget the check reads meshtrain/run/memory_budget.py, the notebooks' pictures
meshtrain/pictures/, the generators of docs/planner.md's tables tools/docs_tables.py (not
shipped), and the sequence-parallel HLO reader tests/support/sequence_parallel.py.
"""


def fast_compile() -> dict[str, str]:
    """Puts the analysis compile options (experiment.ANALYSIS_OPTIONS: the planner reads the
    partitioned HLO, its buffers and collectives, never runs the machine code) into XLA_FLAGS,
    for every compile of this process and the processes it starts, those this jaxlib knows
    and XLA_FLAGS does not set already (xla_flags.add_known: an unknown flag would
    abort the process; JAX 0.11 has no xla_cpu_use_fusion_emitters). For a process that only
    plans (`meshtrain plan`, the notebooks); call before JAX starts its backend; returns the
    flags added. Experiment.compile(analysis=True) uses the same options for one compile."""
    from meshtrain.run.experiment import ANALYSIS_OPTIONS
    from meshtrain.xla_flags import add_known
    return add_known({k: str(v).lower() for k, v in ANALYSIS_OPTIONS.items()})
