"""The hardware the planner predicts for: one table, extended by adding an entry here or
by passing `--hardware=FILE.json` (a dict with the same fields; see docs/planner.md).

Peaks, memory, bandwidths and links are the vendors' data-sheet figures (dense, no 2:4
sparsity; one direction of a link). The efficiencies are assumptions, not measurements:
the share of the peak large bf16 matmuls reach, and of a link's bandwidth NCCL's ring
collectives reach. Calibrate them against a measured step (benchmarks/gpu.py) where one
is at hand; docs/planner.md says which were.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from meshtrain.errors import UserError


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]   # FLOP/s per device by compute dtype (float32 runs as TF32)
    hbm_bytes: float               # device memory
    hbm_bandwidth: float           # bytes/s
    devices_per_node: int
    link_bandwidth: float          # bytes/s one way per device inside a node (NVLink)
    network_bandwidth: float       # bytes/s one way per device between nodes (NIC per GPU)
    link_latency_s: float = 10e-6     # per collective inside a node
    network_latency_s: float = 30e-6  # per collective across nodes
    matmul_efficiency: float = 0.75   # share of peak_flops large matmuls reach
    link_efficiency: float = 0.8      # share of link/network bandwidth ring collectives reach
    usable_memory: float = 0.9        # share of hbm_bytes a run may plan on (runtime, fragmentation)
    compute_capability: str = "9.0"   # CUDA's, for which attention kernel model.attention=auto takes

    def peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype, self.peak_flops["bfloat16"])

    def describe(self) -> str:
        return (f"{self.name}: {self.peak('bfloat16') / 1e12:,.0f} TFLOP/s bf16, "
                f"{self.hbm_bytes / 1e9:,.0f} GB at {self.hbm_bandwidth / 1e12:.2f} TB/s, "
                f"{self.devices_per_node}/node, links {self.link_bandwidth / 1e9:,.0f} GB/s in a node, "
                f"{self.network_bandwidth / 1e9:,.0f} GB/s between nodes")


# NVIDIA H100 SXM5 / H200 SXM / A100 SXM4 data sheets: dense bf16 and TF32 tensor-core
# peaks; NVLink 4 is 900 GB/s per GPU both ways (450 one way), NVLink 3 600 (300);
# one 400 Gb/s (H100/H200, ConnectX-7 NDR) or 200 Gb/s (A100, HDR) NIC per GPU.
TABLE: dict[str, Hardware] = {
    "h100": Hardware("h100", {"bfloat16": 989e12, "float16": 989e12, "float32": 494.5e12},
                     80e9, 3.35e12, 8, 450e9, 50e9),
    "h200": Hardware("h200", {"bfloat16": 989e12, "float16": 989e12, "float32": 494.5e12},
                     141e9, 4.8e12, 8, 450e9, 50e9),
    "a100": Hardware("a100", {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
                     80e9, 2.039e12, 8, 300e9, 25e9, matmul_efficiency=0.85, compute_capability="8.0"),
    "a100_40gb": Hardware("a100_40gb", {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
                          40e9, 1.555e12, 8, 300e9, 25e9, matmul_efficiency=0.85,
                          compute_capability="8.0"),
}


def get(name_or_file: str) -> Hardware:
    """A table entry by name, or a JSON file of Hardware's fields."""
    if name_or_file in TABLE:
        return TABLE[name_or_file]
    path = pathlib.Path(name_or_file)
    if path.suffix == ".json" and path.exists():
        try:
            fields = json.loads(path.read_text())
            fields.setdefault("name", path.stem)
            return Hardware(**fields)
        except (ValueError, TypeError) as e:
            raise UserError(
                f"--hardware={name_or_file}: not a hardware description ({e}). Give a JSON object "
                f"with the fields {', '.join(f.name for f in dataclasses.fields(Hardware))} "
                f"(the first seven are required; see docs/planner.md).") from None
    raise UserError(f"--hardware={name_or_file!r} is not known. Choose one of {', '.join(TABLE)}, "
                    f"or give a .json file with the fields of meshtrain/planner/hardware.py.")
