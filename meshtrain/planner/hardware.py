"""The hardware the planner predicts for: one table, extended by adding an entry here or
by passing `--hardware=FILE.json` (a dict with the same fields; see docs/planner.md).

Peaks, memory, bandwidths and links are the vendors' data-sheet figures (dense, no 2:4
sparsity; one direction of a link). A node's network is its compute NICs: `nics_per_node`
of `network_bandwidth` each (storage NICs left out); planner/roofline.py shares them among
the rings that cross the node. The efficiencies say what share of a peak the step's
kernels reach: on H100 and H200 the compute and memory ones are measured
(`HOPPER_MEASURED`, from the runs in benchmarks/results/; docs/planner.md, "Step time",
shows the arithmetic), the links' are assumed everywhere, and A100's are all assumed.
`calibration` says which, and the planner's report quotes it.
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
    # share of peak_flops a flash attention kernel (cuDNN) reaches on the causal half of the
    # square, by head width; widths between entries take the lower entry's
    attention_efficiency: dict = dataclasses.field(default_factory=lambda: {64: 0.2, 128: 0.3})
    elementwise_efficiency: float = 0.75  # share of hbm_bandwidth the memory-bound kernels reach
    idle_share: float = 0.03          # the device's idle time between kernels, per busy second
    calibration: str = "assumed: no measured run on this hardware"  # which figures are measured
    link_efficiency: float = 0.8      # share of link/network bandwidth ring collectives reach
    usable_memory: float = 0.9        # share of hbm_bytes a run may plan on (runtime, fragmentation)
    compute_capability: str = "9.0"   # CUDA's, for which attention kernel model.attention=auto takes
    nics_per_node: int = 0            # compute NICs in a node; 0: one per device
    source: str = "the --hardware file"  # where the figures come from, quoted in messages
    # train.offload's side (planner/host_offload.py): the node's RAM, and the link between a
    # device and its host's memory, one way per device (full duplex)
    host_memory_bytes: float = 2e12
    host_link_bandwidth: float = 64e9  # PCIe 5 x16; the GH200's C2C is 450e9 a way
    host_link_efficiency: float = 0.8  # share of it transfers reach (assumed)

    @property
    def nics(self) -> int:
        return self.nics_per_node or self.devices_per_node

    @property
    def node_network_bandwidth(self) -> float:
        """bytes/s one way out of a node: all its compute NICs."""
        return self.nics * self.network_bandwidth

    def attention_efficiency_at(self, head_dim: int) -> float:
        """attention_efficiency at the widest entry <= head_dim (the narrowest, below all)."""
        table = sorted((int(k), float(v)) for k, v in self.attention_efficiency.items())
        return next((v for k, v in reversed(table) if k <= head_dim), table[0][1])

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
# Host side: DGX H100/H200 have 2 TB of system memory and each GPU a PCIe 5 x16 link to it
# (H100 SXM data sheet: 128 GB/s both ways, 64 one way); DGX A100 (640 GB) 2 TB, DGX A100
# (320 GB) 1 TB, over PCIe 4 x16 (64 GB/s both ways, 32 one way).
_HOPPER = {"bfloat16": 989e12, "float16": 989e12, "float32": 494.5e12}
_AMPERE = {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12}
# Measured on one H200 (GPT-2 small, remat none, 64 x 1024 tokens: the profile in
# docs/benchmarks.md): the matmuls' 48.6 TFLOP in 63.2 ms (0.777 of the peak), cuDNN's
# causal attention (3.71 TFLOP, head width 64) in 17.6 ms (0.213), the device idle 4.3 of
# 155 ms (0.0285 of its busy time), and the loss's four fusions, 16 bytes a logit, at 3.56
# TB/s (0.742 of 4.8). H100 has the same chip: its compute figures are taken as the
# H200's, and its memory-bound kernels' share fitted to its own GPT-2 small step
# (163.9 ms: 0.946 of 3.35 TB/s). Width 128 is not measured: 1.4x width 64's, assumed.
HOPPER_MEASURED = dict(matmul_efficiency=0.777, attention_efficiency={64: 0.213, 128: 0.3}, idle_share=0.0285)
_MEASURED_NOTE = ("matmul, attention at head width 64 and idle share measured on an H200 (GPT-2 small); "
                  "memory-bound share measured on this card; head width 128 and links assumed")
_H100_SOURCE = "H100 SXM and DGX H100 data sheets: NVLink 4, 8 x 400 Gb/s NDR NICs a node"
_A100_SOURCE = "A100 SXM4 and DGX A100 data sheets: NVLink 3, 8 x 200 Gb/s HDR NICs a node"
TABLE: dict[str, Hardware] = {
    "h100": Hardware("h100", _HOPPER, 80e9, 3.35e12, 8, 450e9, 50e9, nics_per_node=8, source=_H100_SOURCE,
                     elementwise_efficiency=0.946, calibration=_MEASURED_NOTE, **HOPPER_MEASURED),
    "h200": Hardware("h200", _HOPPER, 141e9, 4.8e12, 8, 450e9, 50e9, nics_per_node=8,
                     source="H200 SXM and DGX H200 data sheets: NVLink 4, 8 x 400 Gb/s NDR NICs a node",
                     elementwise_efficiency=0.742, calibration=_MEASURED_NOTE, **HOPPER_MEASURED),
    "a100": Hardware("a100", _AMPERE, 80e9, 2.039e12, 8, 300e9, 25e9, matmul_efficiency=0.85,
                     compute_capability="8.0", nics_per_node=8, source=_A100_SOURCE, host_link_bandwidth=32e9),
    "a100_40gb": Hardware("a100_40gb", _AMPERE, 40e9, 1.555e12, 8, 300e9, 25e9, matmul_efficiency=0.85,
                          compute_capability="8.0", nics_per_node=8, source=_A100_SOURCE, host_memory_bytes=1e12,
                          host_link_bandwidth=32e9),
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
