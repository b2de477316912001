"""The task seam: what a model is trained *for*, apart from what it is.

The core (state, step, experiment, loop, metrics) trains a model family with a task and
names neither: the family (models/family.py) says which task it serves (`Family.task`),
and the task says what a batch is, how a bound model turns one into a loss and metrics,
and what a unit of throughput is. Two tasks:

  lm        language modelling: token rows [B, T+1] int32, mean next-token cross entropy,
            tokens/s (tasks/language.py)
  classify  image classification: {"images" uint8 [B, H, W, C], "labels" int32 [B]},
            cross entropy, top-1 and top-5 accuracy, images/s (tasks/classify.py)

docs/models.md, "Adding a task", is the contract.
"""

from __future__ import annotations

from meshtrain.errors import UserError
from meshtrain.step.tasks.classify import Classification
from meshtrain.step.tasks.language import LanguageModelling
from meshtrain.step.tasks.task import Field, Task

TASKS = {"lm": LanguageModelling, "classify": Classification}


def kind(name: str) -> type:
    """The task class `name` (`Family.task`): its static methods need no data."""
    if name not in TASKS:
        raise UserError(f"task {name!r} is not a known task; the tasks are: {', '.join(TASKS)}.")
    return TASKS[name]


def for_family(name: str, data_info: dict | None = None, data_cfg=None) -> Task:
    """The task a family serves (`Family.task`), set up for its data (`source.info`: the
    classifier normalises with the data's per-channel mean and std; a language model
    packing documents splits at the data's end-of-text id) and data.* (`data_cfg`)."""
    return kind(name).from_data(data_info or {}, data_cfg)


__all__ = ["Classification", "Field", "LanguageModelling", "TASKS", "Task", "for_family", "kind"]
