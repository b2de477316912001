"""Pipeline parallelism inside the one jitted step (docs/pipeline.md).

  scan            GPipe and circular: a scan over ticks of a vmapped stage
  ticks           1F1B and interleaved 1F1B: the tick tables, built and checked on the host
  schedule_1f1b   the loop that runs a tick table, with its own backward
  split_backward  a layer's backward split into B (input gradient) and W (weight gradients),
                  for zero-bubble schedules
"""
