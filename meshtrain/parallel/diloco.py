"""DiLoCo: islands that train apart and meet every H steps (Douillard et al. 2023, arXiv
2311.08105), the form local SGD and stale-synchronous training take on an SPMD mesh.

The islands are the nodes mesh.dcn puts the data axis on: I = data's DCN factor, each
holding m = data / I consecutive data replicas (with every other axis it has: fsdp,
tensor, ...). Without mesh.dcn each data replica is an island (I = data, m = 1). Our mesh
axes are fixed, so an island is not an axis of its own: it is a block of positions along
`data`, and the collectives name it with axis_index_groups (as the compressed reduction does).

The state (TrainState):

    params       the outer params: what eval, checkpoints, sampling and convert read
    opt_state    the outer optimizer's (Nesterov SGD: the momentum, `outer_tx`)
    comm         the round: {"params": [data, ...] each replica's inner params,
                             "opt_state": [data, ...] its inner optimizer's state (optim.*)}
                 replica r's row on its own devices (split over data), the same within an island

    inner step (every step; no collective across nodes):
        grads[r] = grad of the loss at params[r] on replica r's rows (vmap over data)
        grads[r] = their mean over r's island                (a psum inside the node)
        params[r], opt_state[r] = the inner optimizer's update
    outer step (after every H-th inner step):
        delta = outer params - the mean over islands of params[r]
        outer params, momentum = outer_tx(delta)             (lr 0.7, Nesterov 0.9: the paper's)
        params[r] = outer params; opt_state[r] carries on

The outer mean crosses nodes once per round: since an island's m replicas hold the same
values, device i of a node all-reduces only chunk i of m of its copy with the device i of
every other node (2 (I-1)/I x S/m float32 bytes each, S its values), then gathers the
node's m chunks inside it ((m-1)/m x S); with train.grad_compression the chunks cross in
the compressed reduction's two phases instead (parallel/compression.py). A step's metrics are per replica [data]; their
mean over every replica (a few scalars across nodes) is a program of its own
(`mean_metrics`), so the inner step's HLO shows no cross-node collective at all.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.parallel import compression
from meshtrain.parallel.layouts.rules import mesh_axes_of

AXIS = "data"


@dataclasses.dataclass(frozen=True)
class Diloco:
    """diloco.* resolved on a mesh: `every` (H) inner steps a round, `islands` (I) of
    `per_island` (m) data replicas each."""

    every: int
    outer_lr: float
    outer_momentum: float
    islands: int
    per_island: int
    compress: str = "none"  # train.grad_compression: the pseudo-gradient's chunks across nodes
    # streaming DiLoCo: the stacked layers cut into this many ranges (the rest rides with the
    # first), fragment f meeting every `every` steps from step f x every / fragments
    fragments: int = 1

    @property
    def replicas(self) -> int:
        return self.islands * self.per_island

    def groups(self) -> tuple[list[list[int]] | None, list[list[int]] | None]:
        """(an island's positions along data, one position from each island): the
        axis_index_groups inside a node and across nodes (None: all of data)."""
        k, m = self.islands, self.per_island
        if m == 1:
            return None, None
        return ([[n * m + i for i in range(m)] for n in range(k)], [[n * m + i for n in range(k)] for i in range(m)])

    def offsets(self) -> list[int]:
        """The step each fragment's rounds are counted from (f x every / fragments)."""
        return [f * self.every // self.fragments for f in range(self.fragments)]

    def due(self, step: int) -> list[int]:
        """The fragments whose outer step follows inner step `step` (1, 2, ...)."""
        return [f for f, o in enumerate(self.offsets()) if (step - o) % self.every == 0]

    def layer_ranges(self, num_layers: int) -> list[tuple[int, int]]:
        """Each fragment's layers [lo, hi) of the stack, as even as they go."""
        cuts = [round(f * num_layers / self.fragments) for f in range(self.fragments + 1)]
        return list(zip(cuts[:-1], cuts[1:]))

    def outer_tx(self) -> optax.GradientTransformation:
        """Nesterov SGD on the pseudo-gradient (torch's SGD(nesterov=True), as the paper's)."""
        return optax.sgd(self.outer_lr, momentum=self.outer_momentum or None, nesterov=self.outer_momentum > 0)


def check(c) -> None:
    """The keys alone (cfg.diloco)."""
    if not isinstance(c.every, int) or c.every < 0:
        raise UserError(f"diloco.every={c.every!r}: the inner steps a round, an integer >= 1 (0: off; the "
                        f"paper's 500, MaxText's default 36).")
    if not isinstance(c.fragments, int) or c.fragments < 1 or (c.every and c.every % c.fragments):
        raise UserError(f"diloco.fragments={c.fragments!r} with diloco.every={c.every}: an integer >= 1 that "
                        f"divides every (streaming DiLoCo: a fragment meets every {c.every} steps, one every "
                        f"every / fragments steps).")
    if not 0 < c.outer_lr or not 0 <= c.outer_momentum < 1:
        raise UserError(f"diloco.outer_lr={c.outer_lr}, diloco.outer_momentum={c.outer_momentum}: need an lr > 0 "
                        f"and 0 <= momentum < 1 (the paper's 0.7 and 0.9).")


def resolve(c, train, layout, mesh_shape: dict[str, int], dcn: dict[str, int] | None, replicas: tuple[str, ...],
            moment_shardings, has_stats: bool, pipelined: bool, stack: tuple | None = None) -> Diloco | None:
    """diloco.* on this run's mesh, or None when off; refused where the islands cannot
    keep a whole model each or where another key reduces the gradients its own way.
    `stack`: (the stacked layers' params key, their count, their shardings) for fragments."""
    if not c.every:
        return None
    d = mesh_shape[AXIS]
    islands = dcn[AXIS] if dcn and dcn[AXIS] > 1 else d
    why = None
    if d < 2:
        why = "the data axis has one replica: there is nothing to train apart. Give mesh.shape a data axis of 2 or more"
    elif AXIS not in replicas:
        why = (f"layout {layout.name!r} splits the parameters or their gradients over data, so no island holds a "
               f"whole model. Use a layout that replicates them over data (dp, fsdp, dp_tp, ...)")
    elif any(AXIS in mesh_axes_of(e) for sh in jax.tree.leaves(moment_shardings) for e in sh.spec):
        why = (f"layout {layout.name!r} splits the optimizer state over data, which each island keeps whole. "
               f"Use dp (or fsdp to split it inside a node)")
    else:
        for key, value, what in (("train.grad_dtype", bool(train.grad_dtype), "casts"),
                                 ("train.offload", bool(train.offload), "moves")):
            if value:
                why = f"{key} {what} the step's reduction, which DiLoCo replaces. Set {key} back to its default"
        if has_stats:
            why = "BatchNorm statistics are synchronised over the whole batch every step. Set model.batch_norm=false"
        if pipelined:
            why = "a pipeline's schedule is not run per island yet. Use a layout without a stage axis"
        if train.accum_gather == "once":
            why = "train.accum_gather=once gathers over fsdp inside each replica's program. Set it to each"
        if c.fragments > 1:
            key, layers, shardings = stack or (None, 0, {})
            if key is None or layers < c.fragments:
                why = (f"diloco.fragments={c.fragments} cuts the stacked layers into ranges, and this model has "
                       f"{layers or 'no'} stacked layers. Set diloco.fragments to at most {max(layers, 1)}")
            elif any(len(sh.spec) and sh.spec[0] is not None for sh in jax.tree.leaves(shardings)):
                why = "the layout splits the stacked layers' layer dim, which the fragments cut. Use fragments=1"
    if why:
        raise UserError(f"diloco.every={c.every}: {why}.")
    return Diloco(c.every, c.outer_lr, c.outer_momentum, islands, d // islands, train.grad_compression,
                  c.fragments)


def stack_of(stacked: str | None, param_shapes, param_shardings) -> tuple:
    """`resolve`'s `stack`: (the stacked layers' params key, their count, their shardings)."""
    if stacked is None:
        return None, 0, {}
    return stacked, jax.tree.leaves(param_shapes[stacked])[0].shape[0], param_shardings[stacked]


def rows(sharding: NamedSharding) -> NamedSharding:
    """A replica-stacked leaf's sharding [data, ...]: each replica's row on its own devices."""
    return NamedSharding(sharding.mesh, P(AXIS, *sharding.spec))


def state_shapes(dil: Diloco | None, tx: optax.GradientTransformation, param_shapes, param_shardings,
                 moment_shardings) -> dict:
    """TrainState.comm's ShapeDtypeStructs: the round (module docstring); {} when off."""
    if dil is None:
        return {}
    stack = lambda s, sh: jax.ShapeDtypeStruct((dil.replicas, *s.shape), s.dtype, sharding=rows(sh))  # noqa: E731
    abstract_opt = jax.eval_shape(tx.init, param_shapes)
    replicated = NamedSharding(jax.tree.leaves(param_shardings)[0].mesh, P())
    opt_shardings = optax.tree_map_params(tx, lambda _, s: s, abstract_opt, moment_shardings,
                                          transform_non_params=lambda _: replicated,
                                          is_leaf=lambda x: isinstance(x, NamedSharding))
    return {"params": jax.tree.map(stack, param_shapes, param_shardings),
            "opt_state": jax.tree.map(stack, abstract_opt, opt_shardings)}


def start_round(dil: Diloco, tx: optax.GradientTransformation, params) -> dict:
    """Inside jit: the round every replica starts from `params` (the outer params) with a
    fresh inner optimizer (a run's first round, or one resumed where the saved round
    does not fit)."""
    stacked = jax.tree.map(lambda p: jnp.broadcast_to(p, (dil.replicas, *p.shape)), params)
    return {"params": stacked, "opt_state": jax.vmap(tx.init)(stacked)}


def _local_specs(shardings) -> list[P]:
    return [P(AXIS, *s.spec) for s in jax.tree.leaves(shardings)]


def island_mean(grads_n, dil: Diloco, mesh: Mesh, param_shardings, like):
    """grads [data, ...] (each replica's) -> each replica's island mean [data, ...], in
    `like`'s dtypes: a psum inside each node (axis_index_groups), nothing across."""
    leaves, treedef = jax.tree.flatten(grads_n)
    dtypes = [x.dtype for x in jax.tree.leaves(like)]
    if dil.per_island == 1:
        return treedef.unflatten([g.astype(d) for g, d in zip(leaves, dtypes)])
    in_node, _ = dil.groups()
    specs = _local_specs(param_shardings)

    def body(*local):
        return tuple((jax.lax.psum(x, AXIS, axis_index_groups=in_node).astype(jnp.float32) / dil.per_island).astype(d)
                     for x, d in zip(local, dtypes))
    out = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=tuple(specs), check_vma=False)(*leaves)
    return treedef.unflatten(list(out))


def outer_mean(inner_n, dil: Diloco, mesh: Mesh, param_shardings):
    """The inner params [data, ...] -> their mean over the islands, float32, in
    `param_shardings` (module docstring: chunk i of m across nodes, gathered inside)."""
    leaves, treedef = jax.tree.flatten(inner_n)
    m, k = dil.per_island, dil.islands
    in_node, across = dil.groups()
    out_specs = tuple(s.spec for s in jax.tree.leaves(param_shardings))

    def body(*local):
        mine = [x[0] for x in local]
        flat = jnp.concatenate([x.astype(jnp.float32).reshape(-1) for x in mine])
        size = flat.shape[0]
        chunk = -(-size // m)
        flat = jnp.pad(flat, (0, m * chunk - size)).reshape(m, chunk)
        if m > 1:  # this device's chunk of its island's copy: the others hold the rest
            flat = jax.lax.dynamic_index_in_dim(flat, jax.lax.axis_index(AXIS) % m, keepdims=False)
        if dil.compress == "none":
            total = jax.lax.psum(flat, AXIS, axis_index_groups=across) / k
        else:  # its two phases across nodes (parallel/compression.py), no feedback: a round's is used once
            padded = compression.chunk(flat.shape[0], k) * k
            total = compression.compressed_sum(dil.compress, jnp.pad(flat, (0, padded - flat.shape[0])), AXIS, k,
                                               None, across)[0][:flat.shape[0]] / k
        if m > 1:
            total = jax.lax.all_gather(total, AXIS, axis_index_groups=in_node, tiled=True)
        total, out, at = total.reshape(-1), [], 0
        for x in mine:
            out.append(total[at:at + x.size].reshape(x.shape))
            at += x.size
        return tuple(out)
    out = jax.shard_map(body, mesh=mesh, in_specs=tuple(_local_specs(param_shardings)), out_specs=out_specs,
                        check_vma=False)(*leaves)
    return treedef.unflatten(list(out))


def outer_update(dil: Diloco, params, opt_state, inner: dict, mesh: Mesh, param_shardings,
                 stacked: str | None = None, fragment: int = 0):
    """Inside jit, fragment `fragment`'s outer step (all of the params when dil.fragments
    is 1): (outer params, outer optimizer state, the next round). The outer optimizer is
    dil.outer_tx's Nesterov SGD, written out so that a fragment updates its slice of the
    momentum alone: m = momentum m + delta, params -= lr (delta + momentum m)."""
    leaves, treedef = jax.tree.flatten(params)
    paths = [getattr(p[0], "key", None) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    rows, shardings = jax.tree.leaves(inner["params"]), jax.tree.leaves(param_shardings)
    traces = jax.tree.leaves(opt_state[0].trace) if dil.outer_momentum else None
    cut = dil.fragments > 1
    if cut:
        lo, hi = dil.layer_ranges(jax.tree.leaves(params[stacked])[0].shape[0])[fragment]
    mine = [i for i, key in enumerate(paths) if key == stacked or fragment == 0]

    def take(x, i, lead=0):  # leaf i's part in this fragment
        return x[(slice(None),) * lead + (slice(lo, hi),)] if cut and paths[i] == stacked else x

    def put(x, part, i, lead=0):
        return x.at[(slice(None),) * lead + (slice(lo, hi),)].set(part) if cut and paths[i] == stacked else part
    mean = outer_mean([take(rows[i], i, 1) for i in mine], dil, mesh, [shardings[i] for i in mine])
    for i, m in zip(mine, mean):
        p = take(leaves[i], i)
        delta = p.astype(jnp.float32) - m
        if traces is not None:
            trace = dil.outer_momentum * take(traces[i], i) + delta
            traces[i] = put(traces[i], trace, i)
            delta = delta + dil.outer_momentum * trace
        new = (p.astype(jnp.float32) - dil.outer_lr * delta).astype(p.dtype)
        leaves[i] = put(leaves[i], new, i)
        rows[i] = put(rows[i], jnp.broadcast_to(new, (dil.replicas, *new.shape)), i, 1)
    if traces is not None:
        opt_state = (opt_state[0]._replace(trace=treedef.unflatten(traces)), *opt_state[1:])
    return treedef.unflatten(leaves), opt_state, {**inner, "params": treedef.unflatten(rows)}


def wire(dil: Diloco, local_values: int) -> list[tuple]:
    """[(collective kind, mesh axes, bytes each device sends a round, what, whether its
    groups stay inside a node)] of the outer step, `local_values` being one device's
    values of one replica's params (their float32 copy)."""
    m, k = dil.per_island, dil.islands
    values = -(-local_values // m)
    if dil.compress == "none":
        out = [("all-reduce", (AXIS,), 2 * (k - 1) / k * values * 4, "pseudo-gradient chunks summed across nodes",
                False)]
    else:  # compression's two phases over the k nodes: (k-1) of k chunks' payload and scales each
        c = compression.chunk(values, k)
        phase = (k - 1) * ((c if dil.compress == "int8" else c / 8) + 4 * -(-c // compression.BLOCK[dil.compress]))
        out = [("all-to-all", (AXIS,), phase, f"{dil.compress} pseudo-gradient chunks to their reducers", False),
               ("all-gather", (AXIS,), phase, f"{dil.compress} reduced chunks to every node", False)]
    if m > 1:
        out.append(("all-gather", (AXIS,), (m - 1) * values * 4, "the mean's chunks gathered inside a node", True))
    return out


def mean_metrics(metrics_n: dict) -> dict:
    """Per-replica metrics [data] -> the step's: the most non-finite gradient leaves of
    any replica (and the largest first index), the rest averaged."""
    return {name: jnp.max(x) if name in ("nonfinite_grads", "first_nonfinite") else jnp.mean(x)
            for name, x in metrics_n.items()}
