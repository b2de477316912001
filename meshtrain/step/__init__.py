"""The jitted train step and what it is made of, in reading order.

  tasks/       what a batch is and how a model's output becomes a loss (language, classify)
  state        abstract shapes -> shardings -> sharded init (params, optimizer state, step)
  optim        the optimizer: schedules, decay masks, ZeRO's sharded moments
  loss         next-token cross-entropy, a chunk of positions at a time
  train_step   the pure (state, batch) -> (state, metrics), with accumulation
  programs     a step of several programs the host picks between by step (the momentum's warm-up)
  rounds       DiLoCo's steps: the inner step, the outer step every H, the metrics' mean

How the step is split over devices (gradient reduction, pipeline schedules) is parallel/'s.
"""
