"""What a run keeps on disk (docs/checkpoints.md).

  store      Orbax checkpoints of a training run: save, restore into any layout, verify
  restage    block stacks between pipeline arrangements ([L, ...] <-> [S, L/S, ...])
  init_from  start a run from another run's or a converted model's params (`init.from`)
  lock       one run at a time in a workdir or checkpoint directory
"""
