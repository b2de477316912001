"""A save that failed, told in one paragraph (store.Checkpointer.failed): Orbax's reason in
one line, the step the run stopped at, the last committed step (what is safe on disk),
and how to resume; for a full disk, how much is free and how much a checkpoint takes.

The unfinished step is removed first. Orbax has stopped writing it (the error came from
its finalize, which ends with the save), the next start would remove it anyway, and the
space it took is then free again: for Orbax's report (orbax_log.py), which a full disk
held back, and for a rerun on the same disk once the cause is fixed.
"""

from __future__ import annotations

import errno
import pathlib
import shutil

from meshtrain.checkpoints import disk_space
from meshtrain.errors import gib

FULL = ("No space left on device", "Disk quota exceeded")


def is_full_disk(error: BaseException) -> bool:
    """Whether a failed write says the disk (or the user's quota) is full: an OSError's
    errno, or the words of tensorstore's RESOURCE_EXHAUSTED message."""
    return getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(w in str(error) for w in FULL)


def remove_unfinished(step_dir: pathlib.Path) -> bool:
    """Removes Orbax's temporary directory of the step `step_dir` names -> whether there was one."""
    found = list(step_dir.parent.glob(f"{step_dir.name}.orbax-checkpoint-tmp*"))
    for tmp in found:
        shutil.rmtree(tmp, ignore_errors=True)
    return bool(found)


def paragraph(directory: pathlib.Path, step: int, error: BaseException, stopped_at: int | None,
              latest: int | None, removed: bool, report: pathlib.Path | None) -> str:
    """What failed, where the run stopped (`stopped_at`), what is safe (`latest`: the newest
    committed step) and how to resume; `report`: Orbax's log, if it wrote one."""
    latest_dir = None if latest is None else directory / f"step_{latest}"  # steps.STEP_PREFIX
    reason = (str(error).strip() or "no reason given").splitlines()[0]
    text = f"Saving checkpoint step {step} in {directory} failed: {type(error).__name__}: {reason}."
    if stopped_at:
        text += f" The run stopped at step {stopped_at}."
    if latest is None and not directory.is_dir():
        text += f" {directory} cannot be read now, so what is committed there is unknown"
        resume = "resumes from its last committed step"
    elif latest is None:
        text += f" No step is committed in {directory} yet"
        resume = "starts from step 0"
    else:
        text += f" The last committed step is {latest} ({latest_dir}), intact"
        resume = f"resumes from step {latest}"
    text += f"; the unfinished step {step} was removed." if removed else "."
    if is_full_disk(error):
        free = disk_space.free_space(directory)
        took = disk_space.used_space(latest_dir) if latest_dir is not None else 0
        text += (f" The disk is full{'' if free is None else f' ({gib(free)} free now)'}"
                 f"{f', and one checkpoint of this run takes {gib(took)}' if took else ''}: free "
                 f"space there, or copy the workdir to a larger disk and run there (or move checkpoint.dir); "
                 f"then the same command {resume}.")
    else:
        text += f" Rerunning the same command {resume}."
    if report is not None:
        text += f" Orbax's own report, with its tracebacks: {report}."
    return text
