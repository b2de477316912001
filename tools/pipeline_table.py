"""Pipeline schedules side by side, by the planner's formulas, in the setting of the survey
of Nichols et al. (arXiv 2111.04949): GPT-2 medium, 1024-token sequences, bf16 compute
over fp32 master weights and AdamW, 32 sequences per device, A100 40 GB, no remat.

    print(pipeline_table.markdown())      # docs/planner.md, "Pipeline schedules in the survey's setting"
    pipeline_table.rows()                 # [Row(schedule, stages, microbatches, state, ...)]

S stages on mesh stage:S (layout dp_pp), a batch of 32 S sequences in M = 4 S
microbatches of 8: each stage runs every sequence through its L/S layers, so a device
does the work of 32 sequences through the whole model, as one data-parallel device of
the survey does. S = 1 is a pipeline of one stage (gpipe there keeps all 4 microbatches,
as plain training keeps its batch; 1f1b keeps one, as gradient accumulation does).
Nothing is compiled and no device is needed (analytic.abstract_experiment).
"""

from __future__ import annotations

import dataclasses

from meshtrain import config as config_lib
from meshtrain.planner import analytic, hardware

SCHEDULES = ("gpipe", "1f1b", "zb")
STAGES = (1, 2, 4, 8)
ROWS_PER_DEVICE = 32
MICROBATCHES_PER_STAGE = 4
HARDWARE = "a100_40gb"
GIB = 2**30


def survey_config(schedule: str, stages: int):
    """GPT-2 medium (seq 1024) on `stages` stages under `schedule`, bf16, M = 4 S."""
    cfg = config_lib.base(size="medium", mesh=f"stage:{stages}", layout="dp_pp")
    cfg.model.dtype = "bfloat16"
    cfg.model.remat = "none"
    cfg.train.batch_size = ROWS_PER_DEVICE * stages
    cfg.pipeline.microbatches = MICROBATCHES_PER_STAGE * stages
    cfg.pipeline.schedule = schedule
    return cfg


@dataclasses.dataclass(frozen=True)
class Row:
    schedule: str
    stages: int
    microbatches: int
    kept: int           # items (microbatches through the stage) stage 0 keeps at once
    state: float        # bytes per device: params + gradients + optimizer
    activations: float
    idle: float = 0.0   # the step's idle share (Pipeline.bubble)
    weight_stash: float = 0.0  # of the activations, zb's W stash

    @property
    def total(self) -> float:
        return self.state + self.activations


def rows(schedules=SCHEDULES, stages=STAGES) -> list[Row]:
    """One Row per (schedule, stage count), schedule outer."""
    hw = hardware.get(HARDWARE)
    out = []
    for schedule in schedules:
        for s in stages:
            exp = analytic.abstract_experiment(survey_config(schedule, s))
            memory = analytic.memory(exp, hw)
            acct = analytic.pipeline_activations(exp, hw)
            state = memory["params"] + memory["gradients"] + memory["optimizer"]
            out.append(Row(schedule, s, acct.microbatches, acct.kept[0], state, memory["activations"], acct.bubble,
                           acct.parts.get("weight stash", 0.0)))
    return out


def markdown(table: list[Row] | None = None) -> str:
    """The rows as a markdown table, GiB per device; each total against its schedule's at
    S = 1, and against plain training's (gpipe at S = 1 keeps the whole batch, as a
    data-parallel device of the survey does)."""
    table = rows() if table is None else table
    first = {r.schedule: r.total for r in table if r.stages == 1}
    plain = first.get("gpipe")
    lines = ["| schedule | S | M | idle | microbatches kept (stage 0) | params + grads + optimizer | activations "
             "(of them W's stash) | total | its S = 1 / this | plain (gpipe, S = 1) / this |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        ratios = [f"{base / r.total:.2f}x" if base else "-" for base in (first.get(r.schedule), plain)]
        w = f" ({r.weight_stash / GIB:.2f})" if r.weight_stash else ""
        lines.append(f"| {r.schedule} | {r.stages} | {r.microbatches} | {r.idle:.1%} | {r.kept} | {r.state / GIB:.2f} | "
                     f"{r.activations / GIB:.2f}{w} | {r.total / GIB:.2f} | " + " | ".join(ratios) + " |")
    return "\n".join(lines) + "\n"
