"""What a run keeps on disk (docs/checkpoints.md).

  store         Orbax checkpoints of a training run: save, restore into any layout, verify
  steps         the steps in a checkpoint directory: which are committed, what is set aside
  integrity     is a committed step readable: indexes and small files checked, no array read
  reading       a checkpoint's arrays into a run: params into any layout, statistics, leaves
  restage       block stacks between pipeline arrangements ([L, ...] <-> [S, L/S, ...])
  init_from     start a run from another run's or a converted model's params (`init.from`)
  tokenizer     the tokenizer a checkpoint's params were trained with, for exports and sampling
  lock          one run at a time in a workdir or checkpoint directory
  disk_space    whether the checkpoint disk holds what the run keeps, checked at start
  save_failure, orbax_log   a save that fails: one paragraph, Orbax's tracebacks to a file
"""
