"""Running as one of several processes, and on GPUs (docs/multihost.md, docs/xla_flags.md).

  launch       how this process was started: alone, under srun, or by flags/variables
  rendezvous   meshtrain's own start-up handshake and liveness channel between processes
  handshake    who may join the start: the job's secret (MESHTRAIN_SECRET), proven by HMAC
  channel      JSON lines over a socket, each at most 4 MiB
  distributed  jax.distributed, the rendezvous and the heartbeat, joined
  preemption   SIGTERM (Slurm's warning, Ctrl-C under launch/local.sh) -> save and stop
  shared_dir   every process must see the one checkpoint directory: checked at start
  xla_flags    the XLA flags a GPU run gets, merged with the user's XLA_FLAGS
"""
