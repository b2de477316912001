"""Context parallelism's traffic and attention work, by formula, beside the compiled step's.

A layout that splits attention's `length` over mesh axes of total size n (the *_cp presets:
`length:context`) gives each device 2c = T/n positions of every sequence, chunks i and
2n-1-i (layouts/sequence.py), and attention meets the pieces by `model.context_attention`
(parallel/context_attention.py). Per layer and microbatch, with one device's keys (or
values) a block of

    block = b x T/n x K' x E x bytes

(b rows per microbatch on the device, K' the kv heads it holds: K/t where the layout
splits kv_heads as heads, all K where it leaves them whole, H/t for multi-head attention;
only the kv heads travel, each device repeats them to its query heads on arrival; E the
head width, bytes the compute dtype's), each device sends:

    ring       forward   k and v round the ring: 2 (n-1) collective-permutes of a block
               backward  their gradients back the other way (ppermute's transpose):
                         2 (n-1) of a block
    allgather  forward   k and v all-gathered: 2 all-gathers of n blocks, (n-1) blocks each
               backward  dk and dv reduce-scattered: 2 of (n-1) blocks each
               and once per step the positions, an int32 all-gather of T x 4 bytes

A remat policy that recomputes attention (full; save_dots, whose policy keeps no dot with
batch dims) runs the forward's collectives again in the backward pass ("recompute"). The
lower bound counts forward and backward; the recompute is remat's, named as known excess.

Attention's matmul FLOPs per device and microbatch, forward, 2 dots (scores, values) of
2 x b x H/t x E per score entry:

    ring       4 c^2 (own 2c x 2c block, causal mask) + (n-1) 2 c^2 (one unmasked
               [2c x c] or [c x 2c] block a step): T^2 (n+1) / (2 n^2) entries
    allgather  2c x T: T^2 / n entries (the masked half computed too)
    ideal      the causal triangle over n devices: T^2 / (2n)

so the ring runs (n+1)/n of the ideal on every device and the all-gather 2x. A training
step runs 3 forwards' worth (backward: 2 dots per forward dot) and one more under a
remat that recomputes attention.

The ring's load balance, from the HLO: each ring step is a `conditional` whose two
branches (early keys, late queries) must run equal matmul FLOPs (planner/hlo_flops.py
`conditionals`); then every device, whichever branch its position picks, runs the same.

Activations: models/family.context_elements (the families' layer_activation_bytes),
summed by planner/analytic.py.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from meshtrain.layouts import sequence
from meshtrain.planner import hlo, hlo_flops
from meshtrain.planner.split_cost import Bound, Excess

RECOMPUTES = ("full", "save_dots")  # remat policies that rerun attention in backward
KINDS = {"ring": ("collective-permute",), "allgather": ("all-gather", "reduce-scatter")}


def split(exp) -> tuple[int, tuple[str, ...]]:
    """(n, mesh axes of size > 1) of attention's `length` split; n = 1 when unsplit."""
    _, axes = sequence.split(exp.layout, exp.mesh.shape)
    axes = tuple(a for a in axes if exp.mesh.shape[a] > 1)
    return math.prod(exp.mesh.shape[a] for a in axes), axes


def _dims(exp) -> dict:
    """b rows per microbatch on a device, H/t query heads and K' kv heads (the ones that
    travel), E, T, compute bytes, microbatches."""
    cfg, layout, shape = exp.model.cfg, exp.layout, exp.mesh.shape
    k = exp.cfg.train.grad_accum_steps
    kv = getattr(cfg, "num_kv_heads", cfg.num_heads)
    kv_local = (cfg.num_heads // layout.shards("heads", shape)[0] if kv == cfg.num_heads
                else kv // layout.shards("kv_heads", shape)[0])
    return {"rows": exp.cfg.train.batch_size // k // layout.shards("batch", shape)[0],
            "heads": cfg.num_heads // layout.shards("heads", shape)[0], "kv_heads": kv_local,
            "head_dim": cfg.head_dim,
            "seq_len": cfg.seq_len, "bytes": jnp.dtype(cfg.dtype).itemsize, "micro": k}


def formula(exp) -> dict | None:
    """The formulas of the module docstring for a built Experiment; None when attention's
    positions are whole. {"kind", "mesh_axes", "split", "block_bytes", "terms": {forward,
    recompute, backward, positions: bytes per device per step}, "ops": {same: ops},
    "bytes", "count", "bound_bytes" (without recompute), "attention_flops",
    "ideal_attention_flops" (per device per step), "not_counted": [reasons]}."""
    n, axes = split(exp)
    if n == 1:
        return None
    m, kind = exp.model, exp.model.cfg.context_attention
    out = {"kind": kind, "mesh_axes": list(axes), "split": n, "not_counted": []}
    if m.pipeline is not None:
        out["not_counted"].append("a pipeline: no formula for context attention inside pipeline stages")
        return {**out, "bytes": None, "count": 0}
    d = _dims(exp)
    t, layers = d["seq_len"], m.cfg.num_layers * d["micro"]
    block = d["rows"] * t / n * d["kv_heads"] * d["head_dim"] * d["bytes"]
    again = m.cfg.remat in RECOMPUTES
    per_pass = 2 * (n - 1) * block * layers  # ring: 2 (n-1) blocks; allgather: 2 x (n-1) blocks
    ops = (2 * (n - 1) if kind == "ring" else 2) * layers
    out["block_bytes"] = block
    out["terms"] = {"forward": per_pass, "recompute": per_pass if again else 0.0, "backward": per_pass,
                    "positions": (n - 1) / n * t * 4 if kind == "allgather" else 0.0}
    out["ops"] = {"forward": ops, "recompute": ops if again else 0, "backward": ops,
                  "positions": 1 if kind == "allgather" else 0}
    out["bytes"] = sum(out["terms"].values())
    out["count"] = sum(out["ops"].values())
    out["bound_bytes"] = out["bytes"] - out["terms"]["recompute"]
    entries = t * t * (n + 1) / (2 * n * n) if kind == "ring" else t * t / n
    per_entry = 4 * d["rows"] * d["heads"] * d["head_dim"] * m.cfg.num_layers * d["micro"] * (3 + again)
    out["attention_flops"] = per_entry * entries
    out["ideal_attention_flops"] = per_entry * t * t / (2 * n)
    return out


def report(exp, rows: list[dict], compiled=None) -> dict | None:
    """`formula(exp)` with the compiled step's collectives of the kind's ops over the same
    mesh axes (`rows`: hlo.collective_table): "compiled_bytes", "compiled_count", "ratio"
    (compiled / formula); with `compiled`, attention's matmul FLOPs
    ("compiled_attention_flops": the dots with batch dims) and each ring-step conditional's
    branch FLOPs ("branch_flops", "branches_equal")."""
    f = formula(exp)
    if f is None:
        return None
    hlo.with_compiled(f, rows, KINDS.get(f["kind"], ()))
    if compiled is not None and f["bytes"] is not None:
        f["compiled_attention_flops"] = hlo_flops.dot_flops(compiled, batched=True)
        f["attention_flops_ratio"] = f["compiled_attention_flops"] / f["ideal_attention_flops"]
        branches = [c["branch_flops"] for c in hlo_flops.conditionals(compiled, batched=True) if any(c["branch_flops"])]
        f["branch_flops"] = branches
        f["branches_equal"] = all(len(set(b)) == 1 for b in branches)
    return f


def bound_rows(exp) -> list[Bound]:
    """Context attention's lower bound: forward and
    backward, no recompute."""
    f = formula(exp)
    if f is None or not f["bytes"]:
        return []
    axes, t, o = tuple(f["mesh_axes"]), f["terms"], f["ops"]
    if f["kind"] == "ring":
        return [Bound("collective-permute", axes, o["forward"] + o["backward"], t["forward"] + t["backward"],
                      "ring attention: k and v round the ring forward, their gradients back")]
    return [Bound("all-gather", axes, o["forward"] + o["positions"], t["forward"] + t["positions"],
                  "context attention: k and v all-gathered forward (and the positions once)"),
            Bound("reduce-scatter", axes, o["backward"], t["backward"],
                  "context attention: dk and dv reduce-scattered backward")]


def known_excess(exp) -> list[Excess]:
    """The forward's collectives again, where remat recomputes attention."""
    f = formula(exp)
    if f is None or not f.get("terms", {}).get("recompute"):
        return []
    kind = "collective-permute" if f["kind"] == "ring" else "all-gather"
    return [Excess(kind, tuple(f["mesh_axes"]), f["terms"]["recompute"],
                   f"model.remat={exp.model.cfg.remat} recomputes attention in the backward pass, and "
                   f"with it the forward's k and v exchange (planner/context.py)")]
