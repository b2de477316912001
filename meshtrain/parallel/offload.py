"""Host offload: train state kept in the host's memory, brought to the device when the step
needs it (ZeRO-Offload's and ZeRO-Infinity's storage roles, on one SPMD program).

train.offload is a comma list of what lives in host memory ("pinned_host") between steps:

  opt_state   the optimizer's state. It comes to the device for the update and goes back
              to the host; the update itself stays on the device (ZeRO-Offload runs it on
              the host's CPU instead; here XLA overlaps the transfers with the step).
  params      the parameters. The stacked layers' come to the device one layer at a time,
              inside the layer scan, for the forward and again for the backward (the layer
              is rematerialised so that no fetched copy outlives its layer: `Arrival`); the
              rest (embeddings, final norm) come at the step's start. Each layer's
              gradients go back to host memory as the backward leaves the layer (the
              transpose of the fetch; with microbatches their sum stays on the device).

Under either, the update streams the stacked layers (`streamed_update`): one layer's
parameters, gradients and optimizer state at a time come to the device, are updated, and
go back where they are stored; the rest is fetched whole. So about one layer's state is
on the device at a time, in the update too.

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
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

from meshtrain.errors import UserError, comma_list
from meshtrain.models import remat
from meshtrain.models.remat import FETCHED, HOST

NAMES = ("opt_state", "params")


def parse(text: str) -> tuple[str, ...]:
    """"opt_state, params" -> ("opt_state", "params"); "" or "none" -> () (checked)."""
    return comma_list("train.offload", text, NAMES, "opt_state,params")


def check_config(t) -> None:
    """train.offload: a comma list of NAMES, each at most once ("" or none: nothing)."""
    parse(t.offload)


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

    def describe(self, streams: bool) -> str:
        """The start-up line: what lives in host memory between steps and how the step
        brings it to the device (`streams`: the update one layer at a time, streams())."""
        how = ["each stacked layer's parameters come to the device inside the layer scan"] if self.params else []
        how.append("the update takes one layer at a time" if streams else "the update fetches the state whole")
        return f"offload: {', '.join(self.names)} in host memory ({HOST}) between steps; {'; '.join(how)}"

    def state_shardings(self, shardings):
        """A TrainState of NamedShardings with the offloaded parts' memory kind set to HOST."""
        return shardings.replace(**{n: to_host(getattr(shardings, n)) for n in self.names})


def to_host(shardings):
    """A pytree of NamedSharding, each in host memory."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings)


def grads_on_host(offload: Offload, model, accum_steps: int) -> bool:
    """Whether the stacked layers' gradients end the backward in host memory: under params
    offload the transpose of each layer's fetch sends its gradient there, but with
    microbatches their float32 sum is kept on the device."""
    return offload.params and model.stacked is not None and accum_steps == 1


def grads_shardings(offload: Offload, model, grad_shardings, accum_steps: int = 1):
    """Where the step's gradients are reduced to (`grad_shardings`, params-shaped), the
    stacked layers' in host memory where they end the backward there (grads_on_host)."""
    if not grads_on_host(offload, model, accum_steps):
        return grad_shardings
    return {**grad_shardings, model.stacked: to_host(grad_shardings[model.stacked])}


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


# What each leaf of the optimizer state is, for the streamed update: a per-parameter
# buffer of the stacked layers (streamed one layer at a time) or of the rest (fetched
# whole), or not per parameter (a step count: updated with the rest).
_OTHER, _REST, _STACKED = 0, 1, 2


def _empty(x):
    """A zero-size stand-in for a leaf another part of the update takes care of."""
    return jnp.zeros((0,), x.dtype)


def _param_marks(params, stacked: str) -> dict:
    return {k: jax.tree.map(lambda _: _STACKED if k == stacked else _REST, v) for k, v in params.items()}


def _squares(g) -> jax.Array:
    """[] float32: the sum of squares of `g`."""
    return jnp.sum(jnp.square(g.astype(jnp.float32)))


def leaf_squares(grads, stacked: str | None, shardings, streamed: bool = False) -> jax.Array:
    """[leaves] float32 sums of squares of `grads` (placed as `shardings` say) in
    jax.tree.leaves order. The stacked leaves' are added in one order whether or not they are
    `streamed` (their layers fetched one at a time: their gradients may be in host memory),
    so a run with offload has the norm of the run without, bit for bit (_stacked_squares)."""
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    where = jax.tree.leaves(shardings)
    is_stacked = [getattr(path[0], "key", None) == stacked for path, _ in flat]
    rest = iter([_squares(fetch(g) if streamed else g) for (_, g), s in zip(flat, is_stacked) if not s])
    layers = iter(_stacked_squares([g for (_, g), s in zip(flat, is_stacked) if s],
                                   [w for w, s in zip(where, is_stacked) if s], streamed))
    return jnp.stack([next(layers) if s else next(rest) for s in is_stacked])


def _stacked_squares(leaves: list, shardings: list, streamed: bool) -> list:
    """[] float32 sum of squares of each [layers, ...] leaf, written per device so that XLA
    cannot add in another order when the layers are streamed than when they are not: each
    device adds its own slice's squares one layer at a time in one loop for all leaves
    ([layers] partial sums per leaf), then an all-reduce over each leaf's split adds the
    devices' partials. A vmapped reduction over [layers, ...] was 1 ulp off the streamed loop's for
    about half of random gradients; a loop per layer outside shard_map tripled the compile
    at 32 layers."""
    if not leaves:
        return []
    mesh = shardings[0].mesh
    specs = [jax.sharding.PartitionSpec(*s.spec) for s in shardings]

    def split_over(spec, dims) -> tuple[str, ...]:
        return tuple(a for d in dims for a in ((spec[d],) if isinstance(spec[d], str) else spec[d] or ()))

    layer_axes = {split_over(s, [0]) if len(s) else () for s in specs}
    if len(layer_axes) > 1:
        raise ValueError(f"stacked leaves split their layers differently: {sorted(layer_axes)}")
    (layer_axes,) = layer_axes

    def body(*local):
        def one_layer(xs):  # a tuple, not one array: each leaf's sums vary over its own split only
            return tuple(_squares(fetch(x) if streamed else x) for x in xs)
        partial = jax.lax.map(one_layer, local)  # per leaf, [local layers]
        sums = [jax.lax.psum(p, axes) if (axes := split_over(s, range(1, len(s)))) else p
                for p, s in zip(partial, specs)]
        return jnp.stack(sums, axis=1)
    per_layer = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs),
                              out_specs=jax.sharding.PartitionSpec(layer_axes or None, None))(*leaves)
    return list(jnp.sum(per_layer, axis=0))


def streamed_update(tx: optax.GradientTransformation, grads, opt_state, params, *, stacked: str,
                    offload: Offload, norm: jax.Array, good: jax.Array | None):
    """-> (params, opt_state) after `tx`'s update, with only about one layer's parameters,
    gradients and optimizer state on the device at a time: the stacked layers' leaves one
    layer at a time in a scan (each slice fetched, updated, and put back where it is
    stored), the rest fetched whole. `tx` is elementwise per leaf but for its gradient
    clip, which takes the whole step's `norm` (optim.clip_by_global_norm); per-layer
    trust ratios (LARS, LAMB) see one layer as they would see its slice. `good`: keep the
    old values where False (train.nonfinite=skip)."""
    pmarks = _param_marks(params, stacked)
    omarks = optax.tree_map_params(tx, lambda _, m: m, opt_state, pmarks, transform_non_params=lambda _: _OTHER)

    def update(g, o, p):
        updates, new_o = tx.update(g, o, p, global_norm=norm)
        new_p = optax.apply_updates(p, updates)
        if good is not None:
            new_p, new_o = jax.tree.map(lambda old, new: jnp.where(good, new, old), (p, o), (new_p, new_o))
        return new_p, new_o

    def rest_of(tree, marks):
        return jax.tree.map(lambda x, m: _empty(x) if m == _STACKED else fetch(x), tree, marks)
    p_rest, o_rest = update(rest_of(grads, pmarks), rest_of(opt_state, omarks), rest_of(params, pmarks))

    o_leaves, o_def = jax.tree.flatten(opt_state)
    o_kinds = o_def.flatten_up_to(omarks)
    o_stacked = [x for x, m in zip(o_leaves, o_kinds) if m == _STACKED]
    others = {k: jax.tree.map(_empty, v) for k, v in params.items() if k != stacked}

    def layer(_, xs):  # one layer's slices: fetched, updated, put back where they are stored
        g_i, p_i, o_i = fetch(xs)
        o_iter = iter(o_i)
        o = o_def.unflatten([next(o_iter) if m == _STACKED else (_empty(x) if m == _REST else fetch(x))
                             for x, m in zip(o_leaves, o_kinds)])
        new_p, new_o = update({**others, stacked: g_i}, o, {**others, stacked: p_i})
        new_o = [x for x, m in zip(jax.tree.leaves(new_o), o_kinds) if m == _STACKED]
        return None, (to_memory(new_p[stacked], offload.params), to_memory(new_o, offload.opt_state))
    _, (p_stacked, o_new) = jax.lax.scan(layer, None, (grads[stacked], params[stacked], o_stacked))

    o_new = iter(o_new)
    merged = [next(o_new) if m == _STACKED else r for m, r in zip(o_kinds, o_def.flatten_up_to(o_rest))]
    return {**p_rest, stacked: p_stacked}, o_def.unflatten(merged)


def streams(offload: Offload, model) -> bool:
    """Whether the step's update streams the stacked layers (streamed_update): under any
    offload, for a model with a stack of layers stored [layers, ...] (a pipeline's [stage,
    layers per stage, ...] is split over devices by stage, which a scan over it would cut
    across: its update fetches the offloaded state whole)."""
    return bool(offload) and model.stacked is not None and model.pipeline is None


def to_memory(tree, host: bool):
    """Inside jit: `tree` put in host memory when `host`, else left on the device."""
    return jax.device_put(tree, jax.memory.Space.Host) if host else tree
