"""A run: a config built on a mesh, the loop that trains it, and what watches it.

  experiment   a config read, resolved, validated and built on a mesh
  compile_options  how a program only read, or run a few steps, compiles (faster on CPU)
  loop         batches in, metrics out, evaluation and checkpoints on a schedule
  watchdog     a process that stops making progress: named, stacks dumped, the job ended
  stragglers   which process makes every step slower (judged on process 0)
  memory_budget  the memory each device has for the run: the device's own, or the host's RAM
  memory_check   whether the compiled step fits that budget, and else the cheapest fix the
                 planner's formulas find
  verify       plan --verify: a layout's run trained against one device's, compared
"""
