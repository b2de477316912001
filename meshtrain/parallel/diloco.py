"""DiLoCo: islands that train apart and meet every H steps (Douillard et al. 2023, arXiv
2311.08105), the form local SGD and stale-synchronous training take on an SPMD mesh.

The islands are the nodes mesh.dcn puts the data axis on: I = data's DCN factor, each
holding m = data / I consecutive data replicas (with every other axis it has: fsdp,
tensor, ...). Without mesh.dcn each data replica is an island (I = data, m = 1). Our mesh
axes are fixed, so an island is not an axis of its own: it is a block of positions along
`data`, and the collectives name it with axis_index_groups (as the compressed reduction does).

The state (TrainState):

    params       the outer params: what eval, checkpoints, sampling and convert read
    opt_state    empty (optax.identity's): the outer optimizer's state is in comm
    comm         the round: {"params": [data, ...] each replica's inner params,
                             "opt_state": [data, ...] its inner optimizer's state (optim.*),
                             "momentum": the outer Nesterov momentum, a piece a device
                                         ([devices, piece] per fragment: about S / data)}
                 replica r's rows on its own devices (split over data), the same within an island

    inner step (every step; no collective across nodes):
        grads[r] = grad of the loss at params[r] on replica r's rows (vmap over data)
        grads[r] = their mean over r's island                (a psum inside the node)
        params[r], opt_state[r] = the inner optimizer's update
    outer step (after every H-th inner step):
        delta = outer params - the mean over islands of params[r]
        outer params, momentum = Nesterov SGD(delta)          (lr 0.7, momentum 0.9: the paper's)
        params[r] = outer params; opt_state[r] carries on

The outer step crosses nodes once per round (outer_update): since an island's m replicas
hold the same values, device i of a node reduce-scatters only chunk i of m of its copy's
pseudo-gradient with the device i of every other node, updates its piece (and keeps its
piece of the momentum: the outer state is split over all of data), and the pieces of the
update come back the same way: 2 (I-1)/I x S/m float32 bytes each (S its values), then the
node's m chunks are gathered inside it ((m-1)/m x S). With train.grad_compression the two
phases across nodes are the compressed reduction's (parallel/compression.py). A step's
metrics are per replica [data]; their mean over every replica (a few scalars across nodes)
is a program of its own (`mean_metrics`), so the inner step's HLO shows no cross-node
collective at all.
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
        return compression.node_groups(self.islands, self.per_island)

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

    def cut(self, values: int) -> tuple[int, int]:
        """(chunk, piece): a device's `values` cut into m chunks (the node's devices'), each
        into k pieces (the nodes'), in whole bytes of sign bits (compression.chunk)."""
        piece = compression.chunk(-(-values // self.per_island), self.islands)
        return piece * self.islands, piece


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


def local_values(param_shapes, param_shardings, mesh: Mesh) -> int:
    """One device's values of a replica's params: what an outer step reduces (`wire`'s
    `local_values`)."""
    return compression.local_size([s.shape for s in jax.tree.leaves(param_shapes)],
                                  [s.spec for s in jax.tree.leaves(param_shardings)], mesh)


def stack_of(stacked: str | None, param_shapes, param_shardings) -> tuple:
    """`resolve`'s `stack`: (the stacked layers' params key, their count, their shardings)."""
    if stacked is None:
        return None, 0, {}
    return stacked, jax.tree.leaves(param_shapes[stacked])[0].shape[0], param_shardings[stacked]


def rows(sharding: NamedSharding) -> NamedSharding:
    """A replica-stacked leaf's sharding [data, ...]: each replica's row on its own devices."""
    return NamedSharding(sharding.mesh, P(AXIS, *sharding.spec))


def state_shapes(dil: Diloco | None, tx: optax.GradientTransformation, param_shapes, param_shardings,
                 moment_shardings, stacked: str | None = None) -> dict:
    """TrainState.comm's ShapeDtypeStructs: the round (module docstring), and the outer
    momentum, a piece a device per fragment ([devices, piece] float32, `piece` of the
    fragment's values: its share of the pseudo-gradient's reduce-scatter across nodes;
    none without momentum); {} when off."""
    if dil is None:
        return {}
    stack = lambda s, sh: jax.ShapeDtypeStruct((dil.replicas, *s.shape), s.dtype, sharding=rows(sh))  # noqa: E731
    abstract_opt = jax.eval_shape(tx.init, param_shapes)
    mesh = jax.tree.leaves(param_shardings)[0].mesh
    replicated = NamedSharding(mesh, P())
    opt_shardings = optax.tree_map_params(tx, lambda _, s: s, abstract_opt, moment_shardings,
                                          transform_non_params=lambda _: replicated,
                                          is_leaf=lambda x: isinstance(x, NamedSharding))
    out = {"params": jax.tree.map(stack, param_shapes, param_shardings),
           "opt_state": jax.tree.map(stack, abstract_opt, opt_shardings)}
    if dil.outer_momentum:
        own = NamedSharding(mesh, P(mesh.axis_names))
        out["momentum"] = [jax.ShapeDtypeStruct((mesh.size, dil.cut(values)[1]), jnp.float32, sharding=own)
                           for values in fragment_values(dil, param_shapes, param_shardings, stacked)]
    return out


def fragment_values(dil: Diloco, param_shapes, param_shardings, stacked: str | None) -> list[int]:
    """One device's values of one replica's params in each fragment."""
    paths = _paths(param_shapes)
    shapes, specs = jax.tree.leaves(param_shapes), [s.spec for s in jax.tree.leaves(param_shardings)]
    mesh = jax.tree.leaves(param_shardings)[0].mesh
    ranges = dil.layer_ranges(jax.tree.leaves(param_shapes[stacked])[0].shape[0]) if dil.fragments > 1 else [None]
    out = []
    for f, span in enumerate(ranges):
        mine = [i for i, key in enumerate(paths) if key == stacked or f == 0]
        cut = [(span[1] - span[0], *shapes[i].shape[1:]) if span and paths[i] == stacked else shapes[i].shape
               for i in mine]
        out.append(compression.local_size(cut, [specs[i] for i in mine], mesh))
    return out


def _paths(tree) -> list:
    return [getattr(p[0], "key", None) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def start_round(dil: Diloco, tx: optax.GradientTransformation, params, momentum=()) -> dict:
    """Inside jit: the round every replica starts from `params` (the outer params) with a
    fresh inner optimizer, and `momentum` (ShapeDtypeStructs: state_shapes') at zero (a
    run's first round, or one resumed where the saved round does not fit)."""
    stacked = jax.tree.map(lambda p: jnp.broadcast_to(p, (dil.replicas, *p.shape)), params)
    out = {"params": stacked, "opt_state": jax.vmap(tx.init)(stacked)}
    return {**out, "momentum": [jnp.zeros(m.shape, m.dtype) for m in momentum]} if momentum else out


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


def outer_update(dil: Diloco, params, inner: dict, mesh: Mesh, param_shardings, stacked: str | None = None,
                 fragment: int = 0):
    """Inside jit, fragment `fragment`'s outer step (all of the params when dil.fragments
    is 1): (outer params, the next round). Per device (shard_map), on its flattened values
    of the fragment: chunk i of m (the node's i-th device's; the island's replicas hold the
    same values) of the pseudo-gradient outer - inner is reduce-scattered across nodes, so
    each device holds one piece of the islands' mean; Nesterov SGD updates that piece's
    momentum (m = momentum m + delta; update = delta + momentum m); the update's pieces
    are gathered across nodes, the new chunk inside the node. Under train.grad_compression
    the two phases across nodes are the compressed reduction's (the update is what its
    second phase carries)."""
    leaves, treedef = jax.tree.flatten(params)
    paths, rows, shardings = _paths(params), jax.tree.leaves(inner["params"]), jax.tree.leaves(param_shardings)
    cut = dil.fragments > 1
    if cut:
        lo, hi = dil.layer_ranges(jax.tree.leaves(params[stacked])[0].shape[0])[fragment]
    mine = [i for i, key in enumerate(paths) if key == stacked or fragment == 0]

    def take(x, i, lead=0):  # leaf i's part in this fragment
        return x[(slice(None),) * lead + (slice(lo, hi),)] if cut and paths[i] == stacked else x

    def put(x, part, i, lead=0):
        return x.at[(slice(None),) * lead + (slice(lo, hi),)].set(part) if cut and paths[i] == stacked else part
    m, k = dil.per_island, dil.islands
    in_node, across = dil.groups()
    momentum = inner["momentum"][fragment] if dil.outer_momentum else None

    def body(mom, *local):
        ps, rs = local[:len(local) // 2], local[len(local) // 2:]
        p = jnp.concatenate([x.astype(jnp.float32).reshape(-1) for x in ps])
        r = jnp.concatenate([x[0].astype(jnp.float32).reshape(-1) for x in rs])
        chunk = dil.cut(p.shape[0])[0]
        p, r = (jnp.pad(x, (0, m * chunk - x.shape[0])).reshape(m, chunk) for x in (p, r))
        position = jax.lax.axis_index(AXIS)
        p, r = (jax.lax.dynamic_index_in_dim(x, position % m, keepdims=False) for x in (p, r))
        if dil.compress == "none":
            delta = jax.lax.psum_scatter(p - r, AXIS, axis_index_groups=across, tiled=True) / k
        else:
            delta = compression.compressed_scatter(dil.compress, p - r, AXIS, k, across)[0] / k
        if mom is not None:
            mom = dil.outer_momentum * mom[0] + delta
            delta = delta + dil.outer_momentum * mom
            mom = mom[None]
        if dil.compress == "none":
            update = jax.lax.all_gather(delta, AXIS, axis_index_groups=across, tiled=True)
        else:
            update = compression.compressed_gather(dil.compress, delta, AXIS, across)[0]
        new = p - dil.outer_lr * update
        new = jax.lax.all_gather(new, AXIS, axis_index_groups=in_node, tiled=True) if m > 1 else new
        out, at = [], 0
        for x in ps:
            out.append(new[at:at + x.size].reshape(x.shape).astype(x.dtype))
            at += x.size
        return mom, *out
    specs = [shardings[i].spec for i in mine]
    own = P(mesh.axis_names)
    got = jax.shard_map(body, mesh=mesh, in_specs=(own if dil.outer_momentum else None, *specs,
                                                   *[P(AXIS, *s) for s in specs]),
                        out_specs=(own if dil.outer_momentum else None, *specs), check_vma=False)(
        momentum, *[take(leaves[i], i) for i in mine], *[take(rows[i], i, 1) for i in mine])
    for i, new in zip(mine, got[1:]):
        leaves[i] = put(leaves[i], new, i)
        rows[i] = put(rows[i], jnp.broadcast_to(new, (dil.replicas, *new.shape)), i, 1)
    out = {**inner, "params": treedef.unflatten(rows)}
    if dil.outer_momentum:
        out["momentum"] = [got[0] if f == fragment else x for f, x in enumerate(inner["momentum"])]
    return treedef.unflatten(leaves), out


def wire(dil: Diloco, local_values: int) -> list[tuple]:
    """[(collective kind, mesh axes, bytes each device sends a round, what, whether its
    groups stay inside a node)] of an outer step over `local_values`, one device's values
    of one replica's params (or a fragment's), float32 (outer_update)."""
    m, k = dil.per_island, dil.islands
    chunk, piece = dil.cut(local_values)
    if dil.compress == "none":
        phase = (k - 1) * piece * 4
        out = [("reduce-scatter", (AXIS,), phase, "pseudo-gradient chunks reduce-scattered across nodes", False),
               ("all-gather", (AXIS,), phase, "the outer update's pieces gathered across nodes", False)]
    else:  # compression's two phases over the k nodes: (k-1) of k pieces' payload and scales each
        phase = (k - 1) * compression.phase_bytes(dil.compress, piece)
        out = [("all-to-all", (AXIS,), phase, f"{dil.compress} pseudo-gradient pieces to their reducers", False),
               ("all-gather", (AXIS,), phase, f"{dil.compress} outer update pieces to every node", False)]
    if m > 1:
        out.append(("all-gather", (AXIS,), (m - 1) * chunk * 4, "the new chunks gathered inside a node", True))
    return out


def mean_metrics(metrics_n: dict) -> dict:
    """Per-replica metrics [data] -> the step's: the most non-finite gradient leaves of
    any replica (and the largest first index), the rest averaged."""
    return {name: jnp.max(x) if name in ("nonfinite_grads", "first_nonfinite") else jnp.mean(x)
            for name, x in metrics_n.items()}
