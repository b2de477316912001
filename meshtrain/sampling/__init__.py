"""Text from a trained or converted model (docs/sampling.md).

  sources    a run's workdir or a converted checkpoint -> model, mesh, layout, tokenizer
  generate   prefill and decode with a KV cache on the mesh, compiled once
"""
