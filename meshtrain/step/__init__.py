"""The jitted train step and what it is made of, in reading order.

  tasks/       what a batch is and how a model's output becomes a loss (language, classify)
  state        abstract shapes -> shardings -> sharded init (params, optimizer state, step)
  optim        the optimizer: schedules, decay masks, ZeRO's sharded moments
  loss         next-token cross-entropy, a chunk of positions at a time
  grad_reduce  where the gradients' reduction happens (ZeRO-2's reduce-scatter) and in what dtype
  train_step   the pure (state, batch) -> (state, metrics), with accumulation
  pipeline/    pipeline stages inside the same step: scan over stages, 1F1B schedules
"""
