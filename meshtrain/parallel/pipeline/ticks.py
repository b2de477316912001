"""The lockstep tick schedules of 1F1B, interleaved 1F1B and ZB-H1: which microbatch each
stage runs forward and backward on each tick, how many it keeps, and the tables.

One SPMD program runs every stage in lockstep: on each tick every stage has one forward
slot and one backward slot, and activations (forward) and gradients (backward) move one
stage over the `stage` mesh axis between ticks. A chunk is 1/v of a stage's layers (v =
pipeline.repeats; 1 for 1F1B, >= 2 for interleaved); stage s holds chunks s, s+S, ...,
as the circular schedule stores them (pipeline.to_stages).

Forward, as the circular schedule (pipeline.schedule): stage s on tick t runs item
w = t - s, which is repeat i = (w // S) % v of microbatch m = (w // (v S)) S + w % S.

Backward is the mirror image: stage s' = S-1-s counted from the last stage, on tick t
runs item u = t - (v S - 1) - s', which is repeat v-1 - (u // S) % v of microbatch
(u // (v S)) S + u % S. The last stage runs microbatch m's last chunk backward on the
very tick it ran it forward (the loss head sits between the two slots), and a gradient
leaving stage 0 in repeat i reaches stage S-1 one tick later for repeat i-1.

Ticks come in three phases, each its own loop in the program so that no slot is computed
where no stage uses it:

    warm-up    v S - 1        ticks, forward slots only
    steady     v M - v S + S  ticks, both slots
    cool-down  v S - 1        ticks, backward slots only

A forward slot is 1/v of a stage's forward work (F/v), a backward slot B/v. So a step
takes (v S - 1) F/v + (v M - v S + S)(F + B)/v + (v S - 1) B/v = (v M + S - 1)(F + B)/v,
of which M (F + B) is work: the idle share is (S-1)/(v M + S - 1), as GPipe's with v = 1.

In lockstep a microbatch's round trip from stage s to the last stage and back takes
2 (S-1-s) ticks, and stage s takes in a new item every tick in the steady phase, so it
keeps up to 2 (S-1-s) + 1 items: 2S - 1 on stage 0 for 1F1B, where the textbook
(asynchronous) 1F1B keeps S - s. Still never M: `in_flight` counts them.

ZB-H1 (schedule zb; Qi et al. 2023) splits the backward slot: B, the input gradient the
previous stage waits for, stays where 1F1B's backward is; W, the weight gradients, moves
to a weight slot. In lockstep every stage runs the same slots in a tick, so W of item u
runs on every stage at once, on the tick stage 0 runs u's B (u = t - (v S + S - 2)): the
last v M ticks, stage s keeping W's inputs s ticks. With F = B = W a slot, the step
takes (v S - 1) + 2 (v M - v S + S) + (v S - 1) + v M = 3 v M + 2 (S - 1) slots of 1/v
a stage, so the idle share is 2 (S-1) / (3 v M + 2 (S-1)) where 1F1B's is
3 (S-1) / (3 v M + 3 (S-1)): 20.0% against 27.3% at S = 4, M = 8.
"""

from __future__ import annotations

import numpy as np

from meshtrain.parallel.pipeline.scan import Pipeline, schedule as forward_items

__all__ = ["forward_items", "backward_items", "weight_items", "phases", "segments", "in_flight", "stash_slots",
           "weight_stash_slots", "tick_table", "describe"]


def _backward_order(pipe: Pipeline, u, xp):
    """u, the backward items' order (per stage) -> (valid, repeat i, microbatch m)."""
    s, v, m = pipe.stages, pipe.repeats, pipe.microbatches
    valid = (u >= 0) & (u < v * m)
    u = xp.clip(u, 0, v * m - 1)
    return valid, v - 1 - (u // s) % v, (u // (v * s)) * s + u % s


def backward_u(pipe: Pipeline, t, xp=np):
    """Tick t -> per stage [S]: u, the place in the backward order of the item its backward
    slot runs (valid for 0 <= u < v M)."""
    s, v = pipe.stages, pipe.repeats
    return t - (v * s - 1) - (s - 1 - xp.arange(s))


def backward_items(pipe: Pipeline, t, xp=np):
    """Tick t -> per stage [S]: (valid, repeat i, microbatch m) of the item its backward slot runs."""
    return _backward_order(pipe, backward_u(pipe, t, xp), xp)


def weight_u(pipe: Pipeline, t, xp=np):
    """Tick t -> per stage [S]: u of the item zb's weight slot runs, the same on every stage:
    the one stage 0 runs B of on this tick."""
    return backward_u(pipe, t, xp)[:1] + 0 * xp.arange(pipe.stages)


def weight_items(pipe: Pipeline, t, xp=np):
    """Tick t -> per stage [S]: (valid, repeat i, microbatch m) of the item zb's weight slot runs."""
    return _backward_order(pipe, weight_u(pipe, t, xp), xp)


def segments(pipe: Pipeline) -> list[tuple[int, int, str]]:
    """[(first tick, end tick, slots)]: the runs of ticks whose stages run the same kinds of
    slot, "f" forward, "b" backward (B alone under zb) and "w" zb's weight slot; each its
    own loop in the program, so that no slot is computed where no stage uses it."""
    s, v, m = pipe.stages, pipe.repeats, pipe.microbatches
    spans = {"f": (0, v * m + s - 1), "b": (v * s - 1, v * m + v * s + s - 2)}
    if pipe.schedule == "zb":
        spans["w"] = (v * s + s - 2, v * m + v * s + s - 2)
    cuts = sorted({t for span in spans.values() for t in span})
    runs = [(a, b, "".join(k for k, (lo, hi) in spans.items() if lo <= a < hi)) for a, b in zip(cuts, cuts[1:])]
    return [r for r in runs if r[2]]


def phases(pipe: Pipeline) -> tuple[int, int, int]:
    """(warm-up, steady, cool-down) tick counts; their sum is every tick of the step."""
    s, v, m = pipe.stages, pipe.repeats, pipe.microbatches
    return v * s - 1, v * m - v * s + s, v * s - 1


def _lifetimes(pipe: Pipeline):
    """[(stage, repeat, microbatch, forward tick, backward tick)] of every item."""
    first = {}
    out = []
    for t in range(sum(phases(pipe))):
        fv, fi, fm = forward_items(pipe, t, np)
        bv, bi, bm = backward_items(pipe, t, np)
        for s in range(pipe.stages):
            if fv[s]:
                first[(s, int(fi[s]), int(fm[s]))] = t
            if bv[s]:
                key = (s, int(bi[s]), int(bm[s]))
                out.append((*key, first.pop(key), t))
    assert not first, f"items run forward but never backward: {sorted(first)}"
    return out


def weight_stash_slots(pipe: Pipeline) -> int:
    """K_w: slots per stage in zb's weight stash, which keeps W's inputs of item u in slot
    u mod K_w from its B to its W: stage s holds s + 1 at once, stage S-1 the most."""
    return min(pipe.stages, pipe.repeats * pipe.microbatches)


def _most_alive(spans) -> int:
    """The most (forward tick, backward tick) spans that hold one tick at once."""
    return max((sum(f <= t <= b for f, b in spans) for f0, _ in spans for t in (f0,)), default=0)


def in_flight(pipe: Pipeline) -> np.ndarray:
    """[S]: the most items (a microbatch through one chunk, 1/v of the stage) stage s keeps
    between their forward and their backward slot, the one being run included."""
    life = _lifetimes(pipe)
    return np.array([_most_alive([(f, b) for st, _, _, f, b in life if st == s])
                     for s in range(pipe.stages)])


def stash_slots(pipe: Pipeline) -> int:
    """K: slots per (stage, repeat) in the stash, which keeps item (i, m) in slot
    (i, m mod K). Items of one repeat leave a stage in the order they came, so those alive
    at once are consecutive microbatches, and K = the most alive at once never collides."""
    life = _lifetimes(pipe)
    return max(_most_alive([(f, b) for st, ii, _, f, b in life if (st, ii) == (s, i)])
               for s in range(pipe.stages) for i in range(pipe.repeats))


def tick_table(pipe: Pipeline) -> str:
    """A row per tick, a column per stage: `F m|B m` (1F1B) or `F m.i|B m.i` (interleaved,
    repeat i) for the items a stage runs forward and backward, and `|W m` after them under
    zb; `.` for an idle slot, and the phase of each tick on the right."""
    warm, steady, _ = phases(pipe)
    zb = pipe.schedule == "zb"
    width = (9 if pipe.repeats == 1 else 13) + (5 if pipe.repeats == 1 else 7) * zb
    rows = [(" tick | " + " ".join(f"{'s' + str(s):<{width}}" for s in range(pipe.stages)) + " phase").rstrip()]

    def cell(valid, i, m):
        if not valid:
            return "."
        return f"{m}" if pipe.repeats == 1 else f"{m}.{i}"

    for t in range(sum(phases(pipe))):
        slots = [forward_items(pipe, t, np), backward_items(pipe, t, np)] + [weight_items(pipe, t, np)] * zb
        cells = ["|".join(cell(v[s], i[s], m[s]) for v, i, m in slots) for s in range(pipe.stages)]
        phase = "warm-up" if t < warm else "steady" if t < warm + steady else "cool-down"
        rows.append(f"{t:5d} | " + " ".join(f"{c:<{width}}" for c in cells) + " " + phase)
    return "\n".join(rows)


def describe(pipe: Pipeline) -> str:
    """One line for the run's start: schedule, stages, chunks, microbatches, ticks, bubble,
    and what stage 0 keeps."""
    head = (f"{pipe.schedule}: {pipe.stages} stages x {pipe.repeats} chunk(s), {pipe.microbatches} "
            f"microbatches")
    bubble = (f"idle 2(S-1)/(3rM+2(S-1)) = {pipe.bubble:.1%}" if pipe.schedule == "zb"
              else f"bubble (S-1)/(r*M+S-1) = {pipe.bubble:.1%}")
    if not pipe.one_f_one_b:
        return f"{head}, {pipe.ticks} ticks, {bubble}; each stage keeps all {pipe.microbatches}"
    warm, steady, cool = phases(pipe)
    return (f"{head}, {warm + steady + cool} ticks ({warm} warm-up, {steady} steady, {cool} cool-down), "
            f"{bubble}; stage 0 keeps {in_flight(pipe)[0]} of {pipe.repeats * pipe.microbatches} items "
            f"(stash={pipe.stash})" + (f", W's inputs for {weight_stash_slots(pipe)} (split={pipe.split})"
                                       if pipe.schedule == "zb" else ""))
