"""Documents kept apart in a packed window (`data.packing=documents`).

A window of the token stream runs across document boundaries: each document ends with
the end-of-text id. Packed with `documents`, the model treats each document as if it ran
alone: attention masks across documents, positions restart at each document's first
token, and the loss skips the one target that crosses a boundary (the next document's
first token, predicted from the end-of-text id). Nothing new travels with the batch:
segments are derived from the tokens inside the step.

Shapes: B batch, T positions (the model's inputs), T+1 the window (inputs and targets).

    segment[b, t]  = end-of-text ids among tokens[b, :t]     (0 for the window's first)
    position[b, t] = t - (the first t' with segment[b, t'] = segment[b, t])
    weight[b, t]   = segment[b, t + 1] == segment[b, t]      (targets[b, t] in the same document)
    attend(q, k)   iff position order allows it (causal) and segment[q] == segment[k]

The model reads `Documents` off its hook (models/hook.py), in the layout's
storage order like everything else there: attention (models/attention.py and
parallel/context_attention.py) masks by segment, GPT-2's position table and Llama's
RoPE take the positions, and a pipeline schedule slices them per microbatch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshtrain.errors import UserError

PACKINGS = ("concat", "documents")


class Documents(NamedTuple):
    """Per row and position, as stored (a pytree, so schedules slice it like the batch)."""

    segments: jax.Array   # [B, T] int32: which document of the window each position is in
    positions: jax.Array  # [B, T] int32: the position within that document


def segments(tokens_bt: jax.Array, eot_id: int) -> jax.Array:
    """[B, T] int32: the end-of-text ids strictly before each position (module docstring).
    An end-of-text token belongs to the document it ends."""
    ends = (tokens_bt == eot_id).astype(jnp.int32)
    return jnp.cumsum(ends, axis=1) - ends


def positions(segments_bt: jax.Array) -> jax.Array:
    """[B, T] int32: positions restarting at 0 where the segment changes."""
    t = jnp.arange(segments_bt.shape[1], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(segments_bt[:, :1], bool),
                              segments_bt[:, 1:] != segments_bt[:, :-1]], axis=1)
    return t - jax.lax.cummax(jnp.where(starts, t, 0), axis=1)


def of_window(tokens_bt1: jax.Array, eot_id: int, stored) -> tuple[Documents, jax.Array]:
    """tokens [B, T+1] -> (Documents of the inputs tokens[:, :-1], put in storage order by
    `stored`, and the targets' weights [B, T] float32 in position order: 0 where the
    target is the next document's first token)."""
    seg = segments(tokens_bt1, eot_id)
    inputs_seg = seg[:, :-1]
    weights = (seg[:, 1:] == inputs_seg).astype(jnp.float32)
    return Documents(stored(inputs_seg), stored(positions(inputs_seg))), weights


def same_segment(seg_q: jax.Array, seg_k: jax.Array) -> jax.Array:
    """seg_q [B, q], seg_k [B, k] -> [B, 1, q, k] bool: a query may see the key (heads
    broadcast)."""
    return (seg_q[:, :, None] == seg_k[:, None, :])[:, None]


def check_packing(packing: str, data_info: dict, task: str = "lm") -> int | None:
    """data.packing and the data's facts -> the end-of-text id to split on, or None
    (concat). A UserError when the data has no documents to keep apart."""
    if packing not in PACKINGS:
        raise UserError(f"data.packing={packing!r} is not a way to pack documents. Choose one of: "
                        f"{', '.join(PACKINGS)} (docs/data.md, 'Packing').")
    if packing == "concat":
        return None
    if task != "lm":
        raise UserError(f"data.packing=documents packs a language model's token windows; this model's "
                        f"task is {task!r}. Remove data.packing.")
    eot = data_info.get("eot_id")
    if eot is None:
        raise UserError(f"data.packing=documents keeps documents apart at their end-of-text ids, but "
                        f"this data ({data_info.get('kind', 'unknown kind')}) has no documents. Use "
                        f"a tokenized corpus (data.kind=text or tfds, docs/data.md) or data.packing=concat.")
    return int(eot)
