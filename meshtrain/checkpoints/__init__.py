"""What a run keeps on disk (docs/checkpoints.md).

  store      Orbax checkpoints of a training run: save, restore into any layout, verify
  restage    block stacks between pipeline arrangements ([L, ...] <-> [S, L/S, ...])
  init_from  start a run from another run's or a converted model's params (`init.from`)
  lock       one run at a time in a workdir or checkpoint directory
  disk_space whether the checkpoint disk holds what the run keeps, checked at start
  save_failure, orbax_log   a save that fails: one paragraph, Orbax's tracebacks to a file
"""
