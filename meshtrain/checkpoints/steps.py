"""The steps in a checkpoint directory: which are committed, and what is set aside.

Commit: Orbax writes step_N.orbax-checkpoint-tmp-* and renames it to step_N once
every item is written, so `kill -9` at any moment leaves committed steps plus at
most one tmp directory, which the next start ignores and removes. A directory
named like a step but lacking Orbax's commit files (a partial copy, something
foreign) is moved to DIR/ignored/ with a warning: Orbax would otherwise count it
as the latest step and silently refuse every older save.

Damage: before Orbax lists the steps, process 0 checks the newest committed step
(integrity.py: indexes, file lengths, JSON; no array data is read). A damaged step is
reported in one paragraph and moved to DIR/ignored/ too, and the run resumes from the
newest intact step; with none, it stops (UserError) and moves nothing. A read that
fails anyway becomes the same kind of paragraph (integrity.reading).
"""

from __future__ import annotations

import pathlib
import re
import time

from meshtrain.checkpoints import integrity
from meshtrain.errors import UserError

STEP_PREFIX = "step"
STEP_NAME = re.compile(rf"{STEP_PREFIX}_(\d+)")
# What Orbax has written by the time it renames a step into place.
COMMIT_FILES = ("_CHECKPOINT_METADATA", "state/_METADATA", "meta/metadata")
IGNORED = "ignored"


def is_committed(entry: pathlib.Path) -> bool:
    return entry.is_dir() and all((entry / f).exists() for f in COMMIT_FILES)


def committed_steps(directory: pathlib.Path) -> list[int]:
    return sorted(int(m.group(1)) for e in directory.iterdir()
                  if (m := STEP_NAME.fullmatch(e.name)) and is_committed(e))


def set_aside(entry: pathlib.Path) -> pathlib.Path:
    """Moves a step-named entry to DIR/ignored/NAME-TIME, out of Orbax's sight; -> where."""
    target = entry.parent / IGNORED / f"{entry.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    target.parent.mkdir(exist_ok=True)
    entry.rename(target)
    return target


def set_aside_uncommitted(directory: pathlib.Path) -> list[str]:
    """Moves step-named entries without Orbax's commit files to DIR/ignored/; returns their names."""
    moved = []
    for entry in sorted(directory.iterdir()):
        if not STEP_NAME.fullmatch(entry.name):
            continue  # tmp dirs (Orbax removes them), the lock, foreign files: not steps
        if is_committed(entry):
            continue
        set_aside(entry)
        moved.append(entry.name)
    return moved


def set_aside_damaged(directory: pathlib.Path, keep: int) -> str | None:
    """Checks the newest committed step (integrity.check_step), then older ones while they
    are damaged. Damaged steps newer than an intact one are moved to DIR/ignored/ (Orbax
    must not count them as the latest) -> the paragraph saying so; None when the newest
    is intact. With no intact step, raises UserError and moves nothing."""
    step, damaged = integrity.newest_intact(directory, committed_steps(directory), STEP_PREFIX)
    if not damaged:
        return None
    said = " ".join(d.sentence() for d in damaged)
    if step is None:
        why = (" (checkpoint.keep=1 keeps only the newest)" if keep == 1 else "")
        raise UserError(
            f"{said} There is no older intact step to resume from{why}. If you have a good copy "
            f"of that file, put it back and rerun; to start over from step 0, move "
            f"{damaged[0].step_dir} out of {directory} (or train in another --workdir). Nothing "
            f"was moved or deleted. Keep two steps or more (checkpoint.keep) so a damaged one "
            f"has one to fall back to.")
    moved = [str(set_aside(d.step_dir)) for d in damaged]
    return (f"{said} Resuming from step {step} instead, the newest intact step: steps after it "
            f"are trained again. Moved the damaged step{'s' if len(moved) > 1 else ''} to "
            f"{', '.join(moved)} (kept for inspection; delete when done).")


def check_readable(step_dir: pathlib.Path) -> None:
    """A UserError when the committed step `step_dir` is damaged (integrity.check_step),
    naming the newest intact step before it. Read-only, for commands that read a step
    (sample, eval, convert, init.from): nothing is moved."""
    damage = integrity.check_step(step_dir)
    if damage is not None:
        raise UserError(f"{damage.sentence()} {older_intact(step_dir)}")


def older_intact(step_dir: pathlib.Path) -> str:
    """The sentence naming the newest intact committed step before `step_dir`, to pick instead."""
    step = int(step_dir.name.rpartition("_")[2])
    older = [s for s in committed_steps(step_dir.parent) if s < step]
    good = integrity.newest_intact(step_dir.parent, older, STEP_PREFIX)[0]
    if good is None:
        return (f"{step_dir.parent} has no intact step before it: put back a good copy of the "
                f"damaged file, or write the checkpoint again (train the run again, or convert "
                f"the model again).")
    return (f"The newest intact step before it is {good}: pass --step={good} (or give "
            f"{step_dir.parent / f'{STEP_PREFIX}_{good}'}) to use that one.")
