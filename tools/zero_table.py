"""ZeRO's stages side by side, by the planner's formulas, in the setting of the survey of
Nichols et al. (arXiv 2111.04949): GPT-2 medium, 1024-token sequences, bf16 compute over
fp32 master weights and AdamW, 32 sequences per device, A100 40 GB.

    print(zero_table.markdown())          # docs/planner.md, "ZeRO stages in the survey's setting"
    zero_table.rows()                     # [{"layout", "devices", "params", ..., "state_vs_dp"}]

For each device count N the layouts are dp (DDP, ZeRO stage 0), zero1, zero2 (mesh
data:N) and fsdp (ZeRO-3, mesh fsdp:N). Nothing is compiled and no device is needed:
each config is checked on an abstract mesh (experiment.check_config) and costed by
planner/analytic.memory, so N = 64 runs on a laptop.
"""

from __future__ import annotations

import dataclasses

from meshtrain import config as config_lib
from meshtrain.planner import analytic, hardware

LAYOUTS = ("dp", "zero1", "zero2", "fsdp")
DEVICES = (1, 2, 4, 8, 16, 32, 64)
ROWS_PER_DEVICE = 32
HARDWARE = "a100_40gb"
STATE = ("params", "gradients", "optimizer")
GIB = 2**30


def survey_config(layout: str, devices: int):
    """GPT-2 medium (seq 1024) under `layout` on `devices`, bf16 compute, 32 rows each."""
    axis = "fsdp" if layout.startswith("fsdp") else "data"
    cfg = config_lib.base(size="medium", mesh=f"{axis}:{devices}", layout=layout)
    cfg.model.dtype = "bfloat16"
    cfg.train.batch_size = ROWS_PER_DEVICE * devices
    return cfg


def formulas(layout: str, devices: int, hw=None) -> dict[str, float]:
    """analytic.memory of the survey's config, bytes per device: params, gradients,
    optimizer, activations."""
    exp = analytic.abstract_experiment(survey_config(layout, devices))
    return analytic.memory(exp, hw or hardware.get(HARDWARE))


@dataclasses.dataclass(frozen=True)
class Row:
    layout: str
    devices: int
    params: float       # bytes per device
    gradients: float
    optimizer: float
    activations: float
    dp_state: float     # dp's params + gradients + optimizer at the same N

    @property
    def state(self) -> float:
        return self.params + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.activations

    @property
    def state_vs_dp(self) -> float:
        return self.state / self.dp_state


def rows(layouts=LAYOUTS, devices=DEVICES) -> list[Row]:
    """One Row per (device count, layout), device count outer."""
    hw = hardware.get(HARDWARE)
    out = []
    for n in devices:
        got = {lay: formulas(lay, n, hw) for lay in dict.fromkeys(("dp", *layouts))}
        dp_state = sum(got["dp"][k] for k in STATE)
        for lay in layouts:
            m = got[lay]
            out.append(Row(lay, n, m["params"], m["gradients"], m["optimizer"], m["activations"], dp_state))
    return out


def markdown(table: list[Row] | None = None) -> str:
    """The rows as a markdown table, GiB per device."""
    table = rows() if table is None else table
    lines = ["| N | layout | params | gradients | optimizer | state | activations | total | state / dp |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        cells = [f"{v / GIB:.2f}" for v in (r.params, r.gradients, r.optimizer, r.state, r.activations, r.total)]
        lines.append(f"| {r.devices} | {r.layout} | " + " | ".join(cells) + f" | {r.state_vs_dp:.0%} |")
    return "\n".join(lines) + "\n"
