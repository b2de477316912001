"""Host offload: train state kept in the host's memory, brought to the device when the step
needs it (ZeRO-Offload's and ZeRO-Infinity's storage roles, on one SPMD program).

train.offload is a comma list of what lives in host memory ("pinned_host") between steps:

  opt_state   the optimizer's state. The step brings it to the device for the update
              (`fetch`) and its output shardings write the new state back to the host;
              the update itself stays on the device (ZeRO-Offload runs it on the host's
              CPU instead; here XLA overlaps the transfers with the step).
  params      the parameters. The stacked layers' come to the device one layer at a time,
              inside the layer scan, for the forward and again for the backward (the layer
              is rematerialised so that no fetched copy outlives its layer: `Arrival`); the
              rest (embeddings, final norm) come at the step's start. Each layer's
              gradients go back to host memory as the backward leaves the layer (the
              transpose of the fetch), and come to the device, with the parameters, for the
              update.

Shapes and shardings are those of the state without offload; only the memory kind
differs, so a checkpoint restores either way. Inside jit host memory is typed: an
operation that mixes a host operand with a device one is an error, so everything the
step computes on is fetched first. On CPU a fetch lowers to nothing (the CPU's memories are
one memory), so a CPU run equals the run without offload bit for bit; a lowering for CUDA
shows each placement (`annotate_device_placement`, tests/test_offload.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
from jax.ad_checkpoint import checkpoint_name

from meshtrain.errors import UserError
from meshtrain.models import remat
from meshtrain.models.remat import FETCHED, HOST

NAMES = ("opt_state", "params")


def parse(text: str) -> tuple[str, ...]:
    """"opt_state, params" -> ("opt_state", "params"); "" or "none" -> ()."""
    names = tuple(n.strip().lower() for n in str(text).split(",") if n.strip())
    return () if names == ("none",) else names


def check_config(t) -> None:
    """train.offload: a comma list of NAMES, each at most once ("" or none: nothing)."""
    names = parse(t.offload)
    unknown = [n for n in names if n not in NAMES]
    if unknown or len(set(names)) != len(names):
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "a name given twice"
        raise UserError(
            f"train.offload={t.offload!r}: {what}. Give a comma list of {', '.join(NAMES)} (or none), "
            f"e.g. --config.train.offload=opt_state,params.")


@dataclasses.dataclass(frozen=True)
class Offload:
    """What train.offload puts in host memory."""

    opt_state: bool = False
    params: bool = False

    @classmethod
    def of(cls, t) -> "Offload":
        names = parse(t.offload)
        return cls(opt_state="opt_state" in names, params="params" in names)

    def __bool__(self) -> bool:
        return self.opt_state or self.params

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in NAMES if getattr(self, n))

    def state_shardings(self, shardings):
        """A TrainState of NamedShardings with the offloaded parts' memory kind set to HOST."""
        return shardings.replace(**{n: to_host(getattr(shardings, n)) for n in self.names})


def to_host(shardings):
    """A pytree of NamedSharding, each in host memory."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings)


def fetch(tree):
    """Inside jit: the arrays of `tree`, in device memory (each keeps its sharding)."""
    return jax.device_put(tree, jax.memory.Space.Device)


def check_devices(offload: Offload, remat_policy: str, devices: Sequence[jax.Device]) -> None:
    """A backend without host memory cannot offload: say so before anything is built."""
    asked = ([f"train.offload={','.join(offload.names)}"] if offload else []) + (
        [f"model.remat={remat_policy}"] if remat.offloads(remat_policy) else [])
    if not asked:
        return
    kinds = {m.kind for m in devices[0].addressable_memories()}
    if HOST not in kinds:
        raise UserError(
            f"{' and '.join(asked)} need{'s' if len(asked) == 1 else ''} '{HOST}' memory, and the "
            f"{devices[0].platform} devices have only {', '.join(sorted(kinds))}. Run on a GPU or CPU "
            f"backend, or offload nothing (train.offload=none, a model.remat without offload).")


def check_model(offload: Offload, family_name: str, stacked: str | None, accum_gather: str,
                pipelined: bool = False) -> None:
    """params offload fetches one layer at a time from a stack of identical layers: refuse
    a model without one, the gather-once accumulation that would fetch them all, and a
    pipeline, whose schedules rearrange the stacked weights into stages before any layer
    runs (arithmetic on host memory, which a device step cannot do)."""
    if not offload.params:
        return
    if pipelined:
        raise UserError(
            "train.offload=params with a pipeline: the pipeline schedules lay the stacked weights "
            "out by stage before the first layer runs, so every layer would come to the device at "
            "once. Offload opt_state only (--config.train.offload=opt_state), or shard the "
            "parameters over more devices instead (layout fsdp or a tensor axis).")
    if stacked is None:
        raise UserError(
            f"train.offload=params: model.name={family_name!r} has no stack of identical layers to "
            f"bring to the device one at a time, so its parameters would all be on the device for "
            f"the whole step anyway. Offload opt_state only (--config.train.offload=opt_state).")
    if accum_gather == "once":
        raise UserError(
            "train.offload=params with train.accum_gather=once: gathering the parameters once per "
            "step keeps every layer on the device, which is what offload avoids. Use "
            "--config.train.accum_gather=each (or auto).")


@dataclasses.dataclass(frozen=True)
class Arrival:
    """How one layer's parameters reach the device under params offload: fetched, then the
    matrices cast to the compute dtype (so an FSDP gather after it moves 16-bit values),
    and named FETCHED so remat recomputes the fetch instead of keeping it."""

    dtype: object

    def __call__(self, params):
        def one(p):
            p = fetch(p)
            return checkpoint_name(p.astype(self.dtype) if p.ndim >= 2 else p, FETCHED)
        return jax.tree.map(one, params)


def arrival(offload: Offload, dtype) -> Callable | None:
    """The per-layer Arrival when params are offloaded, else None."""
    return Arrival(dtype) if offload.params else None
