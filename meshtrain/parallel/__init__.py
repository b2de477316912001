"""Every way the work is split over devices, and where its state lives (docs/layouts.md,
docs/pipeline.md, docs/performance.md).

  layouts/            where each logical axis lives: rules, presets, sharding tables, the vocabulary
  hook                Constrain(layout, mesh): the layout's answer to what a model asks
                      (models/hook.py): pins, storage order, and the kernels below
  sequence            sequence and context parallelism's positions: the zigzag order,
                      Megatron's all-gather `g`, attention's view
  context_attention   causal attention over a split sequence: all-gather or ring (shard_map)
  experts             expert parallelism's dispatch: all-to-all to the experts' devices (shard_map)
  grad_reduce         the data-parallel replicas' gradient reduction (dtype, accumulation,
                      ZeRO-2's reduce-scatter in the backward)
  compression         that reduction over slow links in fewer bytes: int8 or one bit a value,
                      two phases (all-to-all, all-gather), error feedback (shard_map)
  momentum_compression  the compressed momentum instead of the gradient (1-bit Adam's
                      form): the shift, the exact warm-up, Adam with its variance frozen
  diloco              islands that train apart and meet every H steps: the round's state,
                      the island's mean inside a node, the outer mean across (shard_map)
  offload             host offload: optimizer state and parameters kept in host memory
                      between steps, each layer's parameters fetched in the layer scan
  pipeline/           pipeline stages inside the one step: GPipe and circular as a scan over
                      ticks, 1F1B and interleaved 1F1B as a tick loop with its own backward

Data parallelism, FSDP/ZeRO-1/3 and tensor parallelism need no code of their own: the
layout's shardings and XLA's collectives do them. The models import nothing from here;
the step (step/) calls into it, handing the schedules what they need of the loss.
"""
