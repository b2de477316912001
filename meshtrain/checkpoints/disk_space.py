"""Whether the disk where checkpoints go can hold what the run keeps: checked at start,
before compiling, as run/memory_check.py checks device memory.

    check(directory, exp, cfg.checkpoint, present=2, start=40, end=120, say=print)

One checkpoint (`checkpoint_bytes`) is every array of the train state at its global
shape (the processes write one copy together), plus Orbax's metadata. Measured with
orbax-checkpoint 0.12.8 on 8 CPU devices: gpt2_tiny's 52 arrays hold 1,496,084 bytes, and
its step 40 took 1,531,904 bytes of disk (du), about 86 KB of it metadata (_METADATA,
_sharding, array_metadatas: 1.6 KB an array, the sharding's list of devices growing with
the device count), the rest the files' partly used last blocks. Orbax compresses the
arrays (zstd), but a trained state's floats hardly compress (random normals: 8%) while a
fresh state's zero moments do, so the estimate assumes none and errs high.

How many at once (`at_once`): Orbax commits a step before it deletes the oldest, so
checkpoint.keep=K holds K + 1 while a save is written; fewer when the run saves fewer
times (checkpoint.every_minutes=0: every N steps and the last). keep=0 keeps them all:
those the schedule saves by step count (saves by the clock cannot be counted ahead; the
line says so). Committed steps already in the directory count toward them.

Free space is statvfs's f_bavail x f_frsize: what a writer who is not root may still use.
A filesystem that cannot say (statvfs fails, or reports no blocks, as some network and
FUSE filesystems do) gets a warning; quotas are not seen. Only process 0 checks: the
directory is one every process shares (cluster/shared_dir.py).
"""

from __future__ import annotations

import os
import pathlib

import jax

from meshtrain.errors import UserError, gib, warn

METADATA_PER_ARRAY = 2048  # bytes: measured 1.6 KB an array on 8 devices (module docstring)
METADATA_PER_DEVICE = 16   # bytes an array: a device's entry in the array's _sharding record
SLACK_PER_PROCESS = 2**16  # bytes: the last blocks of a process's dozen files, 4 KiB each at most


def checkpoint_bytes(exp) -> tuple[int, int, int]:
    """(bytes one checkpoint of `exp` takes at most, its arrays, the arrays' own bytes)."""
    leaves = jax.tree.leaves(exp.abstract_state())
    state = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    metadata = len(leaves) * (METADATA_PER_ARRAY + METADATA_PER_DEVICE * jax.device_count())
    return state + metadata + SLACK_PER_PROCESS * jax.process_count(), len(leaves), state


def scheduled_saves(every: int, start: int, end: int) -> int:
    """Saves by step count in steps start+1..end: every `every` steps (0: none) and the last."""
    if end <= start:
        return 0
    multiples = end // every - start // every if every else 0
    return multiples + (0 if every and end % every == 0 else 1)


def at_once(keep: int, every_minutes: float, present: int, saves: int) -> int:
    """Checkpoints in the directory at the fullest moment, the one being written included."""
    if keep == 0:
        return present + saves
    most = keep + 1
    return most if every_minutes else min(most, present + saves)


def free_space(directory: str | os.PathLike) -> int | None:
    """Bytes a writer may still put on `directory`'s filesystem; None when it cannot say."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize if st.f_blocks else None


def used_space(path: pathlib.Path) -> int:
    """Bytes of disk `path` and everything under it take (du), 0 where they cannot be read."""
    try:
        return sum(p.lstat().st_blocks * 512 for p in (path, *path.rglob("*")))
    except OSError:
        return 0


def arithmetic(keep: int, c, present: int, saves: int, one: int) -> tuple[int, str]:
    """(bytes the run adds to the directory at its fullest, the sum that gives them), under
    checkpoint.keep=`keep` and the rest of `c` (cfg.checkpoint)."""
    most = at_once(keep, c.every_minutes, present, saves)
    new = max(most - present, 1)
    if keep == 0:
        why = f"checkpoint.keep=0 keeps all: {saves} saves by step count" + \
            (", not counting those of checkpoint.every_minutes" if c.every_minutes else "")
    elif most < keep + 1:
        why = f"the run saves {saves} time{'s' if saves > 1 else ''}, checkpoint.every_minutes=0"
    else:
        why = f"checkpoint.keep={keep} and the one being written"
    there = f", {present} there already: {new} more" if present else ""
    return new * one, f"{most} checkpoints at once ({why}){there} x {gib(one)} = {gib(new * one)}"


def check(directory: pathlib.Path, exp, c, *, present: int, start: int, end: int, say) -> None:
    """Compares what the run writes to `directory` (c: cfg.checkpoint; `present` committed
    steps there; the run trains steps start+1..end) with its free space. Fits: one line
    through `say`. Does not: a UserError with the arithmetic and the fixes, a warning when
    c.skip_disk_check. The filesystem cannot say: a warning."""
    saves = scheduled_saves(c.every, start, end)
    if jax.process_index() != 0 or not saves:
        return
    one, arrays, state = checkpoint_bytes(exp)
    need, sums = arithmetic(c.keep, c, present, saves, one)
    free = free_space(directory)
    if free is None:
        warn(f"disk check: the filesystem of {directory} does not say how much space is free, so it is "
             f"not checked; this run needs {sums} there.")
        return
    if need <= free:
        say(f"disk check: fits; {sums}, against {gib(free)} free in {directory}")
        return
    fits = [(k, n) for k in range(c.keep - 1 if c.keep else present + saves - 1, 0, -1)
            if (n := arithmetic(k, c, present, saves, one)[0]) <= free]
    keep = "" if not fits else (
        f"; --config.checkpoint.keep={fits[0][0]} needs {gib(fits[0][1])}"
        + (" (but one step kept has none to fall back to if it is damaged)" if fits[0][0] == 1 else ""))
    paragraph = (f"The checkpoint directory {directory} has {gib(free)} free, but this run needs {gib(need)} "
                 f"more there: {sums} (one checkpoint: the train state's {arrays} arrays, {gib(state)}, and up "
                 f"to {gib(one - state)} of Orbax's metadata). Free space there, or put --workdir (or "
                 f"checkpoint.dir) on a larger disk{keep}.")
    if c.skip_disk_check:
        warn(f"{paragraph} Starting anyway (checkpoint.skip_disk_check=true): a save that fills the disk "
             f"stops the run, and the last committed step is kept.")
        return
    raise UserError(f"{paragraph} --config.checkpoint.skip_disk_check=true starts anyway (a filesystem "
                    f"that compresses, or space about to be freed).")
