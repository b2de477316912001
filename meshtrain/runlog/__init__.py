"""The run log: what a run writes down and where (docs/architecture.md, "The run log").

  metrics    run.json and metrics.jsonl: rows, their schema, the run's summary
  trackers   where rows also go: TensorBoard, Weights & Biases, stdout
  goodput    where the run's wall time went (compile, steps, saves, restarts)
"""
