"""Gradients reduced over slow links in fewer bytes (train.grad_compression): int8 with
block scales (ZeRO++'s quantized gradients, arXiv 2306.10209) or one bit a value, with or
without error feedback (1-bit SGD, Seide et al. 2014; DeepSpeed's 1-bit Adam, arXiv
2102.02888).

The reduction runs per device (shard_map) on the replicas' gradients [n, ...] of the
hand-written path (grad_reduce.per_replica). Every device flattens its local pieces of all
leaves into a bucket a dtype (`Buckets`: the dtype they arrive in, bfloat16 matrices beside
float32 vectors under mixed precision; a small leaf costs no padding of its own); the
replicas along the compressed axes (c positions: k nodes of m, mesh.dcn's factor k) line
up, each holding the same pieces of the other axes' splits. Over them, hierarchically:

    inside a node    a reduce-scatter a bucket, in its dtype (as XLA's own reduction):
                     each device keeps k chunks of the node's sum
    across nodes     1. compress each chunk (every bucket's, as one float32 vector);
                        all-to-all: node j's device receives chunk j of every node's piece
                     2. decompress, sum in float32, compress; all-gather to every node
    inside a node    an all-gather a bucket of the reduced pieces, in its dtype

as DeepSpeed's compressed_allreduce and ZeRO++'s all_to_all_quant_reduce do across nodes;
without mesh.dcn the two phases run over all c positions. A replica axis not compressed is
summed in float32 first (psum). Compressed, a value is

    int8     q = round(x / s), s = max |x| / 127 a block of BLOCK["int8"] values: a byte a
             value and 4 bytes a block
    onebit   its sign (packbits), s = the root mean square of a block of BLOCK["onebit"]:
             1/8 byte a value and 4 bytes a block

so what crosses nodes is (1 + 4 / BLOCK) / 4 (int8) or (1/8 + 4 / BLOCK) / 4 (onebit) of a
two-level float32 reduction's 2 (k-1)/k x 4 / m bytes a value. With error feedback
(train.error_feedback) what compression loses is kept and added back the next step: a
worker buffer ([k chunks] per device, before phase 1) and a server buffer ([a chunk] per
device, before phase 2's compression), DeepSpeed's design.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain.errors import UserError

KINDS = ("none", "int8", "onebit")
# Values a scale covers: int8's "a few thousand", as ZeRO++'s blocks; a sign's far fewer,
# since one scale stands for every magnitude of its block (docs/performance.md measured
# 2,048, 256 and 64: the smaller the closer to float32; 64 costs 1/64 of float32's bytes).
BLOCK = {"int8": 2048, "onebit": 64}


@dataclasses.dataclass(frozen=True)
class Compression:
    """train.grad_compression over `axes` (mesh axes), with or without error feedback;
    `nodes`: how many nodes the axes' c positions sit on (mesh.dcn: k, each holding m = c /
    k consecutive positions; 1 without it, or c when an axis list has no single factor)."""

    kind: str
    axes: tuple[str, ...]
    feedback: bool = True
    nodes: int = 1
    cut: "Buckets | None" = None  # the run's buckets (`buckets`), once its shapes are known
    # train.compress_momentum: momentum_compression.Momentum (the replicas' next momentum
    # compressed), or None
    momentum: object = None

    def groups(self, c: int) -> tuple[list[list[int]] | None, list[list[int]] | None]:
        """(the positions in one node, one from each node): axis_index_groups of the
        float32 phase inside a node and of the compressed one across nodes (None: all)."""
        k = self.nodes if self.nodes > 1 else c  # one node: compress over every position
        return node_groups(k, c // k)


def node_groups(k: int, m: int) -> tuple[list[list[int]] | None, list[list[int]] | None]:
    """k nodes of m consecutive positions each -> (the positions in one node, one from each
    node) as axis_index_groups (None, None with one position a node: the whole axis)."""
    if m == 1:
        return None, None
    return ([[n * m + i for i in range(m)] for n in range(k)], [[n * m + i for n in range(k)] for i in range(m)])


def phase_bytes(kind: str, values: int) -> float:
    """Bytes of `values` compressed: the payload (a byte, or a bit, a value) and a float32
    scale a block."""
    return (values if kind == "int8" else values / 8) + 4 * -(-values // BLOCK[kind])


def chunk(size: int, c: int) -> int:
    """m: the values of one of the c chunks a vector of `size` values is cut into (a
    multiple of 8, so a chunk's sign bits fill whole bytes)."""
    return -(-size // (8 * c)) * 8


def _blocked(x: jax.Array, block: int) -> jax.Array:
    """[m] -> [ceil(m / block), block], the last block padded with zeros (kept local)."""
    nb = -(-x.shape[-1] // block)
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * block - x.shape[-1])]).reshape(*x.shape[:-1], nb, block)


def _unblocked(x: jax.Array, m: int) -> jax.Array:
    return x.reshape(*x.shape[:-2], -1)[..., :m]


def compress(kind: str, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., m] float32 -> (payload, scales [..., ceil(m / BLOCK[kind])] float32): int8
    values [..., m] (scale max |x| / 127), or sign bits packed [..., m / 8] uint8 (scale
    the block's root mean square, so a block keeps its norm, as DeepSpeed's 1-bit scale)."""
    block = BLOCK[kind]
    b = _blocked(x, block)
    if kind == "int8":
        scale = jnp.max(jnp.abs(b), axis=-1) / 127
        q = jnp.round(b / jnp.where(scale > 0, scale, 1)[..., None])
        return _unblocked(jnp.clip(q, -127, 127).astype(jnp.int8), x.shape[-1]), scale
    last = x.shape[-1] - (b.shape[-2] - 1) * block  # values in the last block (the rest: padding)
    sizes = jnp.full(b.shape[-2], block, jnp.float32).at[-1].set(last)
    return jnp.packbits(x >= 0, axis=-1), jnp.sqrt(jnp.sum(jnp.square(b), axis=-1) / sizes)


def decompress(kind: str, payload: jax.Array, scale: jax.Array, m: int) -> jax.Array:
    """The inverse of `compress`, up to what it loses: [..., m] float32."""
    if kind == "int8":
        values = payload.astype(jnp.float32)
    else:
        values = jnp.unpackbits(payload, axis=-1, count=m).astype(jnp.float32) * 2 - 1
    return _unblocked(_blocked(values, BLOCK[kind]) * scale[..., None], m)


def compressed_sum(kind: str, v: jax.Array, axes: tuple[str, ...], c: int, errors: dict | None,
                   groups: list[list[int]] | None = None):
    """Inside shard_map: v [c * m] float32 (this device's) -> (the sum of every device's v
    over `axes` (within `groups` of c positions, axis_index_groups; None: all of them)
    [c * m], as the two phases leave it, and the feedback buffers after this step:
    {"worker": [c * m], "server": [m]}, or None without feedback)."""
    if errors is not None:
        v = v + errors["worker"]
    mine, sent = compressed_scatter(kind, v, axes, c, groups)
    if errors is not None:
        mine = mine + errors["server"]
    total, kept = compressed_gather(kind, mine, axes, groups)
    return total, (None if errors is None else {"worker": v - sent, "server": mine - kept})


def compressed_scatter(kind: str, v: jax.Array, axes: tuple[str, ...], c: int, groups=None):
    """Phase 1: v [c * m] -> (chunk j of the group's sum [m] on its j-th device, what this
    device's compressed v decompresses to [c * m])."""
    m = v.shape[0] // c
    payload, scale = compress(kind, v.reshape(c, m))
    sent = decompress(kind, payload, scale, m).reshape(-1)
    payload, scale = (jax.lax.all_to_all(x, axes, 0, 0, axis_index_groups=groups) for x in (payload, scale))
    return jnp.sum(decompress(kind, payload, scale, m), axis=0), sent


def compressed_gather(kind: str, mine: jax.Array, axes: tuple[str, ...], groups=None):
    """Phase 2: each device's [m] -> (every device's, compressed and back, [c * m]; this
    device's own as the others read it [m])."""
    m = mine.shape[0]
    payload, scale = compress(kind, mine)
    kept = decompress(kind, payload, scale, m)
    payload, scale = (jax.lax.all_gather(x, axes, axis_index_groups=groups) for x in (payload, scale))
    return decompress(kind, payload, scale, m).reshape(-1), kept


@dataclasses.dataclass(frozen=True)
class Buckets:
    """One device's gradient pieces as the reduction cuts them: a bucket a dtype (the
    dtype the replicas' gradients arrive in: the in-node phase sums each in its own, as
    XLA's reduction would), each of `sizes[i]` values padded to c chunks of `chunks[i]`;
    across nodes the k chunks of every bucket go as one float32 vector [k, sum(chunks)]."""

    k: int                        # nodes (compressed positions)
    per_node: int                 # positions a node
    dtypes: tuple[str, ...]       # a bucket's dtype
    members: tuple[tuple[int, ...], ...]  # its leaves (their index)
    sizes: tuple[int, ...]        # its values
    chunks: tuple[int, ...]       # its chunk's values

    @classmethod
    def of(cls, comp: Compression, c: int, sizes: list[int], dtypes: list) -> "Buckets":
        k = comp.nodes if comp.nodes > 1 else c
        names = list(dict.fromkeys(jnp.dtype(d).name for d in dtypes))
        members = tuple(tuple(i for i, d in enumerate(dtypes) if jnp.dtype(d).name == n) for n in names)
        totals = tuple(sum(sizes[i] for i in m) for m in members)
        return cls(k, c // k, tuple(names), members, totals, tuple(chunk(t, c) for t in totals))

    @property
    def m(self) -> int:
        """Values of one compressed chunk (every bucket's)."""
        return sum(self.chunks)


def inner_specs(param_shardings, replicas: tuple[str, ...]) -> list[P]:
    """Per leaf (jax.tree.leaves order): the PartitionSpec of one replica's gradient, the
    params' without the replica axes (train.accum_gather=once gathers some first)."""
    def one(sharding):
        return P(*(tuple(a for a in _names(e) if a not in replicas) or None for e in sharding.spec))
    return [one(s) for s in jax.tree.leaves(param_shardings)]


def local_size(shapes: list[tuple[int, ...]], specs: list[P], mesh: Mesh) -> int:
    """Values of one device's pieces of every leaf (`shapes` and their PartitionSpecs)."""
    def one(shape, spec):
        spec = tuple(spec) + (None,) * (len(shape) - len(spec))
        return math.prod(d // math.prod(mesh.shape[a] for a in _names(entry)) for d, entry in zip(shape, spec))
    return sum(one(shape, spec) for shape, spec in zip(shapes, specs))


def _names(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def buckets(comp: Compression, param_shapes, param_shardings, mesh: Mesh, replicas: tuple[str, ...],
            grad_dtypes) -> Buckets:
    """The Buckets of the replicas' gradients (`grad_dtypes`: a leaf's dtype as it arrives,
    in jax.tree.leaves order) split as the params are, less the replica axes."""
    specs = inner_specs(param_shardings, replicas)
    sizes = [local_size([s.shape], [spec], mesh) for s, spec in zip(jax.tree.leaves(param_shapes), specs)]
    return Buckets.of(comp, math.prod(mesh.shape[a] for a in comp.axes), sizes, list(grad_dtypes))


def state_shapes(comp: Compression | None, mesh: Mesh) -> dict:
    """The feedback buffers' ShapeDtypeStructs (TrainState.comm): {"worker": [devices, k m],
    "server": [devices, m]} float32 (m: comp.cut.m), each device its own row; {} without
    feedback."""
    if comp is None or not comp.feedback:
        return {}
    cut, rows = comp.cut, NamedSharding(mesh, P(mesh.axis_names))
    return {"worker": jax.ShapeDtypeStruct((mesh.size, cut.k * cut.m), jnp.float32, sharding=rows),
            "server": jax.ShapeDtypeStruct((mesh.size, cut.m), jnp.float32, sharding=rows)}


def wire(comp: Compression, mesh_shape: dict[str, int], replicas: tuple[str, ...]) -> list[tuple]:
    """[(collective kind, mesh axes, bytes each device sends a step, what, whether its groups
    stay inside a node)] of the reduction of one device's buckets (module docstring): the
    psum over the replica axes outside `comp.axes` and the node's reduce-scatter and
    all-gather, each bucket in its dtype; across nodes each phase's (k-1)/k of k chunks'
    payload and scales."""
    cut = comp.cut
    c, k, m = math.prod(mesh_shape[a] for a in comp.axes), cut.k, cut.m
    phase = (k - 1) * phase_bytes(comp.kind, m)
    inside = tuple(a for a in replicas if a not in comp.axes)
    n = math.prod(mesh_shape[a] for a in inside)
    held = sum(size * jnp.dtype(d).itemsize for size, d in zip(cut.sizes, cut.dtypes))
    padded = sum(c * chunk_ * jnp.dtype(d).itemsize for chunk_, d in zip(cut.chunks, cut.dtypes))
    out = [("all-reduce", inside, 2 * (n - 1) / n * held, "gradient buckets summed before compression",
            False)] if n > 1 else []
    if cut.per_node > 1:  # inside a node: a reduce-scatter before, an all-gather after
        node = (cut.per_node - 1) / cut.per_node * padded
        out += [("reduce-scatter", comp.axes, node, "gradient buckets reduce-scattered inside a node", True),
                ("all-gather", comp.axes, node, "reduced buckets gathered inside a node", True)]
    return out + [("all-to-all", comp.axes, phase, f"{comp.kind} gradient chunks to their reducers across nodes", False),
                  ("all-gather", comp.axes, phase, f"{comp.kind} reduced chunks to every node", False)]


def reduce(grads_n, like, comp: Compression, mesh: Mesh, replicas: tuple[str, ...], specs: list[P], errors: dict):
    """grads [n, ...] (each replica's mean gradient, split over `replicas` on dim 0 and
    as `specs` (inner_specs) say on the rest) -> (their mean, in each of `like`'s dtypes,
    split as `specs`; the feedback buffers after this step, as `errors`: state_shapes)."""
    leaves, treedef = jax.tree.flatten(grads_n)
    n = math.prod(mesh.shape[a] for a in replicas)
    c = math.prod(mesh.shape[a] for a in comp.axes)
    inside = tuple(a for a in replicas if a not in comp.axes)
    cut = comp.cut  # cut once from the shapes (buckets); the gradients arrive as it says
    in_node, across = comp.groups(c)
    rows = P(mesh.axis_names)

    def body(errs, *local):
        pieces = []  # per bucket, [k, its chunk] in float32: what crosses the nodes
        for members, size, m_b in zip(cut.members, cut.sizes, cut.chunks):
            v = jnp.concatenate([local[i].reshape(-1) for i in members])
            v = jax.lax.psum(v, inside) if inside else v
            v = jnp.pad(v, (0, c * m_b - size))
            if cut.per_node > 1:  # inside the node, in its dtype: k chunks of the node's sum stay here
                v = jax.lax.psum_scatter(v, comp.axes, axis_index_groups=in_node, tiled=True)
            pieces.append(v.astype(jnp.float32).reshape(cut.k, m_b))
        total, errs = compressed_sum(comp.kind, jnp.concatenate(pieces, axis=1).reshape(-1), comp.axes, cut.k,
                                     {name: e[0] for name, e in errs.items()} if errs else None, across)
        total, out, start = total.reshape(cut.k, cut.m), [None] * len(local), 0
        for members, dtype, m_b in zip(cut.members, cut.dtypes, cut.chunks):
            t = total[:, start:start + m_b].reshape(-1).astype(dtype)
            start += m_b
            t = jax.lax.all_gather(t, comp.axes, axis_index_groups=in_node, tiled=True) if cut.per_node > 1 else t
            at = 0
            for i in members:
                piece = local[i][0]
                out[i] = t[at:at + piece.size].reshape(piece.shape).astype(jnp.float32) / n
                at += piece.size
        return tuple(out), ({name: e[None] for name, e in errs.items()} if errs else {})

    err_specs = {name: rows for name in errors}
    mean, errors = jax.shard_map(body, mesh=mesh, in_specs=(err_specs, *[P(replicas, *s) for s in specs]),
                                 out_specs=(tuple(P(*s) for s in specs), err_specs),
                                 check_vma=False)(errors, *leaves)
    mean = [g.astype(w.dtype) for g, w in zip(mean, jax.tree.leaves(like))]
    return treedef.unflatten(mean), errors


def check(train) -> None:
    """The keys alone (cfg.train)."""
    if train.grad_compression not in KINDS:
        raise UserError(f"train.grad_compression={train.grad_compression!r}: choose none, int8 (a byte a "
                        f"value and a scale a block: 1/4 of a float32 reduction's bytes) or onebit (a sign "
                        f"a value, with error feedback: 1/32).")
    if not isinstance(train.error_feedback, bool):
        raise UserError(f"train.error_feedback={train.error_feedback!r}: must be true or false.")
    if train.grad_compression == "none":
        return
    for key, value, why in (("train.grad_dtype", train.grad_dtype, "the compressed reduction is its own dtype"),):
        if value:
            raise UserError(f"train.grad_compression={train.grad_compression} with {key}={value!r}: {why}; "
                            f"set one of them.")


def resolve(train, replicas: tuple[str, ...], dcn: dict[str, int] | None, mesh_shape: dict[str, int]) -> Compression | None:
    """train.grad_compression over its axes: train.compress_axes (a comma list), or the
    replica axes mesh.dcn splits, or else data. Refused where an axis is not a replica axis
    of this layout (its gradients are not whole per replica there)."""
    if train.grad_compression == "none":
        return None
    asked = tuple(a.strip() for a in train.compress_axes.split(",") if a.strip())
    axes = asked or tuple(a for a in replicas if dcn and dcn[a] > 1) or ("data",)
    wrong = [a for a in axes if a not in replicas]
    if wrong:
        given = f"train.compress_axes={train.compress_axes!r}" if asked else "the default axis"
        raise UserError(
            f"train.grad_compression={train.grad_compression} over {', '.join(wrong)} ({given}): the "
            f"replicas' whole gradients are reduced over {', '.join(replicas) or 'no axis'} under this layout "
            f"and mesh ({', '.join(f'{a}={n}' for a, n in mesh_shape.items() if n > 1)}). Name some of those in "
            f"train.compress_axes, or use a layout that keeps whole gradients per data replica (e.g. dp, zero1).")
    nodes = dcn[axes[0]] if dcn and len(axes) == 1 else 1  # a list of axes: compressed over all
    return Compression(train.grad_compression, axes, train.error_feedback, nodes)
