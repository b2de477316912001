"""The hardware the planner predicts for: one table, extended by adding an entry here or
by passing `--hardware=FILE.json` (a dict with the same fields; see docs/planner.md).

Peaks, memory, bandwidths and links are the vendors' data-sheet figures (dense, no 2:4
sparsity; one direction of a link). A node's network is its compute NICs: `nics_per_node`
of `network_bandwidth` each (storage NICs left out); planner/roofline.py shares them among
the rings that cross the node. The efficiencies are assumptions, not measurements:
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
    network_bandwidth: float       # bytes/s one way per compute NIC between nodes
    link_latency_s: float = 10e-6     # per collective inside a node
    network_latency_s: float = 30e-6  # per collective across nodes
    matmul_efficiency: float = 0.75   # share of peak_flops large matmuls reach
    link_efficiency: float = 0.8      # share of link/network bandwidth ring collectives reach
    usable_memory: float = 0.9        # share of hbm_bytes a run may plan on (runtime, fragmentation)
    compute_capability: str = "9.0"   # CUDA's, for which attention kernel model.attention=auto takes
    nics_per_node: int = 0            # compute NICs in a node; 0: one per device
    source: str = "the --hardware file"  # where the figures come from, quoted in messages

    @property
    def nics(self) -> int:
        return self.nics_per_node or self.devices_per_node

    @property
    def node_network_bandwidth(self) -> float:
        """bytes/s one way out of a node: all its compute NICs."""
        return self.nics * self.network_bandwidth

    def peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype, self.peak_flops["bfloat16"])

    def describe(self) -> str:
        return (f"{self.name}: {self.peak('bfloat16') / 1e12:,.0f} TFLOP/s bf16, "
                f"{self.hbm_bytes / 1e9:,.0f} GB at {self.hbm_bandwidth / 1e12:.2f} TB/s, "
                f"{self.devices_per_node}/node, links {self.link_bandwidth / 1e9:,.0f} GB/s in a node, "
                f"{self.nics} x {self.network_bandwidth * 8 / 1e9:,.0f} Gb/s NICs a node "
                f"({self.node_network_bandwidth / 1e9:,.0f} GB/s) between nodes")


# NVIDIA H100 SXM5 / H200 SXM / A100 SXM4 data sheets: dense bf16 and TF32 tensor-core
# peaks; NVLink 4 is 900 GB/s per GPU both ways (450 one way), NVLink 3 600 (300).
# DGX H100 and DGX H200 data sheets: 8 single-port ConnectX-7 NICs for compute, 400 Gb/s
# NDR each (50 GB/s); DGX A100: 8 single-port ConnectX-6, 200 Gb/s HDR each (25 GB/s).
_HOPPER = {"bfloat16": 989e12, "float16": 989e12, "float32": 494.5e12}
_AMPERE = {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12}
_H100_SOURCE = "H100 SXM and DGX H100 data sheets: NVLink 4, 8 x 400 Gb/s NDR NICs a node"
_A100_SOURCE = "A100 SXM4 and DGX A100 data sheets: NVLink 3, 8 x 200 Gb/s HDR NICs a node"
TABLE: dict[str, Hardware] = {
    "h100": Hardware("h100", _HOPPER, 80e9, 3.35e12, 8, 450e9, 50e9, nics_per_node=8, source=_H100_SOURCE),
    "h200": Hardware("h200", _HOPPER, 141e9, 4.8e12, 8, 450e9, 50e9, nics_per_node=8,
                     source="H200 SXM and DGX H200 data sheets: NVLink 4, 8 x 400 Gb/s NDR NICs a node"),
    "a100": Hardware("a100", _AMPERE, 80e9, 2.039e12, 8, 300e9, 25e9, matmul_efficiency=0.85,
                     compute_capability="8.0", nics_per_node=8, source=_A100_SOURCE),
    "a100_40gb": Hardware("a100_40gb", _AMPERE, 40e9, 1.555e12, 8, 300e9, 25e9, matmul_efficiency=0.85,
                          compute_capability="8.0", nics_per_node=8, source=_A100_SOURCE),
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
