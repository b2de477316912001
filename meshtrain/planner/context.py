"""Context parallelism's traffic and attention work, by formula (docs/planner.md, "Context
parallelism", derives both and sets them beside the compiled step's).

With attention's `length` split n ways (2c = T/n positions a device, chunks i and 2n-1-i:
parallel/sequence.py) and a block = one device's keys (or values), b x T/n x K' x E x bytes
(b rows per microbatch, K' the kv heads it holds: they alone travel, E the head width), per
layer and microbatch each device sends:

    ring       2 (n-1) collective-permutes of a block forward (k and v), as many backward
    allgather  2 all-gathers of (n-1) blocks forward, 2 reduce-scatters of dk, dv backward;
               once a step the positions, (n-1)/n x T x 4 bytes
    segments   data.packing=documents: b x T/n int32 ids with k and v, once a step
               (ring: n-1 collective-permutes; allgather: one all-gather)
    remat full or save_dots: the forward's again ("recompute", known excess)

Attention's matmul FLOPs per device and microbatch: forward 2 dots of 2 x b x H/t x E per
score entry (training 3x, 4x under remat); ring T^2 (n+1) / (2 n^2) entries, allgather
T^2 / n, the causal ideal T^2 / (2n). Each ring step is a `conditional` whose two branches
must run equal FLOPs (planner/hlo_flops.py `conditionals`).
"""

from __future__ import annotations

import jax.numpy as jnp

from meshtrain.models import remat
from meshtrain.parallel import sequence
from meshtrain.planner import hlo_flops
from meshtrain.planner.split_cost import Term, Traffic, local_batch, split_over

KINDS = {"ring": ("collective-permute",), "allgather": ("all-gather", "reduce-scatter")}


def split(exp) -> tuple[int, tuple[str, ...]]:
    """(n, mesh axes of size > 1) of attention's `length` split; n = 1 when unsplit."""
    return split_over(exp.layout, exp.mesh.shape, "length", sequence.ATTENTION_AXES)


def _dims(exp) -> dict:
    """b rows per microbatch on a device, H/t query heads and K' kv heads (the ones that
    travel), E, T, compute bytes, microbatches."""
    cfg, layout, shape = exp.model.cfg, exp.layout, exp.mesh.shape
    kv = getattr(cfg, "num_kv_heads", cfg.num_heads)
    heads = cfg.num_heads // split_over(layout, shape, "heads")[0]
    return {"rows": local_batch(exp)["rows"], "heads": heads,
            "kv_heads": heads if kv == cfg.num_heads else kv // split_over(layout, shape, "kv_heads")[0],
            "head_dim": cfg.head_dim, "seq_len": cfg.seq_len, "bytes": jnp.dtype(cfg.dtype).itemsize,
            "micro": exp.cfg.train.grad_accum_steps}


def traffic(exp) -> Traffic | None:
    """The formulas of the module docstring for a built Experiment, a Traffic of forward,
    recompute (remat's, known excess), backward, positions (allgather) and segments
    (data.packing=documents), with figures {"kind",
    "block_bytes", "attention_flops", "ideal_attention_flops" (per device per step)}; None
    when attention's positions are whole; not counted inside a pipeline."""
    n, axes = split(exp)
    if n == 1:
        return None
    m, kind = exp.model, exp.model.cfg.context_attention
    out = Traffic(axes, n, KINDS.get(kind, ()), figures={"kind": kind})
    if m.pipeline is not None:
        out.not_counted.append("a pipeline: no formula for context attention inside pipeline stages")
        out.counted = False
        return out
    d = _dims(exp)
    t, layers = d["seq_len"], m.cfg.num_layers * d["micro"]
    block = d["rows"] * t / n * d["kv_heads"] * d["head_dim"] * d["bytes"]
    again = remat.recomputes(m.cfg.remat)
    per_pass = 2 * (n - 1) * block * layers  # ring: 2 (n-1) blocks; allgather: 2 x (n-1) blocks
    ring = kind == "ring"
    ops = (2 * (n - 1) if ring else 2) * layers
    sends = "collective-permute" if ring else "all-gather"
    forward = ("ring attention: k and v round the ring forward, their gradients back" if ring else
               "context attention: k and v all-gathered forward (and the positions once)")
    out.terms = {
        "forward": Term(sends, per_pass, ops, True, forward),
        "recompute": Term(sends, per_pass if again else 0.0, ops if again else 0, False,
                          f"model.remat={m.cfg.remat} recomputes attention in the backward pass, and with it "
                          f"the forward's k and v exchange (planner/context.py)"),
        "backward": Term(sends if ring else "reduce-scatter", per_pass, ops, True,
                         forward if ring else "context attention: dk and dv reduce-scattered backward"),
    }
    if not ring:
        out.terms["positions"] = Term("all-gather", (n - 1) / n * t * 4, 1, True, forward)
    if exp.cfg.data.get("packing") == "documents":  # the same for every layer: XLA sends them once
        rows = d["rows"] * t * 4 * d["micro"]
        out.terms["segments"] = Term(sends, (n - 1) / n * rows,
                                     (n - 1 if ring else 1) * d["micro"], True,
                                     "data.packing=documents: the segment ids travel with k and v, once a step")
    entries = t * t * (n + 1) / (2 * n * n) if ring else t * t / n
    per_entry = 4 * d["rows"] * d["heads"] * d["head_dim"] * m.cfg.num_layers * d["micro"] * (3 + again)
    out.figures.update(block_bytes=block, attention_flops=per_entry * entries,
                       ideal_attention_flops=per_entry * t * t / (2 * n))
    return out


def figures(exp, traffic: Traffic, compiled=None) -> dict:
    """With `compiled`: attention's matmul FLOPs ("compiled_attention_flops": the dots with
    batch dims, and their ratio to the ideal) and each ring-step conditional's branch FLOPs
    ("branch_flops", "branches_equal")."""
    if compiled is None or not traffic.counted:
        return {}
    flops = hlo_flops.dot_flops(compiled, batched=True)
    branches = [c["branch_flops"] for c in hlo_flops.conditionals(compiled, batched=True) if any(c["branch_flops"])]
    return {"compiled_attention_flops": flops,
            "attention_flops_ratio": flops / traffic.figures["ideal_attention_flops"],
            "branch_flops": branches, "branches_equal": all(len(set(b)) == 1 for b in branches)}
