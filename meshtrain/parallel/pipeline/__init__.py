"""Pipeline parallelism inside the one jitted step (docs/pipeline.md).

  scan            the pipeline's config, storage order and GPipe/circular tick schedule
  stages          how stages run on the mesh (StagePlan), and the GPipe/circular runner
  ticks           1F1B, interleaved 1F1B and ZB-H1: the tick tables, built and checked on the host
  schedule_1f1b   the loop that runs a tick table, with its own backward
  schedule_zb     ZB-H1: that loop with the backward split, W in a weight slot
  split_backward  a layer's backward split into B (input gradient) and W (weight gradients)
"""
