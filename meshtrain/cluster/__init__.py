"""Running as one of several processes (docs/multihost.md).

  launch       how this process was started: alone, under srun, or by flags/variables
  distributed  jax.distributed (its coordination service: the one port), the agreement, liveness
  kv           JAX's key-value store as meshtrain reads it: values parsed as untrusted input
  agreement    the start: one job (count, ids, hosts, pids, the same config everywhere)
  liveness     beats and notices: a lost, failed or hung process stops the others, named
  preemption   SIGTERM (Slurm's warning, Ctrl-C under launch/local.sh) -> save and stop
  shared_dir   every process must see the one checkpoint directory: checked at start
"""
