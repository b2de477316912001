"""Parallelism the models call but do not own: the sharding hook and the kernels written
per device, where GSPMD cannot split a computation by itself (docs/layouts.md).

  hook                the typed hook every model receives: Constrain(layout, mesh), or
                      UNSHARDED; pins activations, gives specs and the sequence order
  sequence            sequence parallelism's pins: Megatron's all-gather `g`, attention's view
  context_attention   causal attention over a split sequence: all-gather or ring (shard_map)
  experts             expert parallelism's dispatch: all-to-all to the experts' devices (shard_map)

The layouts (parallel/layouts/) say where each logical axis lives; the mesh, built in mesh.py,
what devices there are. Data parallelism, FSDP/ZeRO and tensor parallelism need nothing
here: the layout's shardings and XLA's collectives do them. Pipeline parallelism is the
step's own schedule (parallel/pipeline/), and gradient reduction its own (parallel/grad_reduce.py).
"""
