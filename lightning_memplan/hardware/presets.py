"""Sourced hardware table: one entry per accelerator, each citing its datasheet (as Lightning's
``lightning/fabric/utilities/throughput.py`` table of peak FLOPs).

Units and conventions (every entry follows them, so entries compare):

- ``memory_bytes``: the datasheet capacity read as GiB (HBM and GDDR capacities are binary: an
  "80GB" A100/H100 has 80 GiB of DRAM). ``torch.cuda`` reports 0.3-2 % less (ECC and driver
  reservations); the planner's CUDA-context term covers that difference.
- ``peak_flops``: dense (no 2:4 sparsity) 16-bit tensor-core FLOP/s with fp32 accumulation: bf16
  where the chip has bf16, fp16 otherwise (V100). Datasheets print the sparse figure first, marked
  with an asterisk; the dense figure is half of it.
- ``peak_flops_fp32``: dense fp32 FLOP/s without TF32 (PyTorch's default for matmuls).
- ``intra_node_bw``: bytes/s one GPU can send to the others of its node *per direction*: half the
  datasheet's bidirectional NVLink figure, or the PCIe x16 link for boards without an NVLink switch.
- ``inter_node_bw``: bytes/s per GPU per direction across nodes in the reference system named in the
  source (e.g. DGX A100: one 200 Gb/s HDR InfiniBand port per GPU = 25 GB/s). Clusters differ; pass
  your own value with ``HardwareSpec(..., inter_node_bw=...)`` or ``HardwareSpec.preset(...).replace(...)``.
- ``memory_bw``: device-memory bandwidth in bytes/s (used for the memory-bound optimizer step).
- ``host_link_bw``: bytes/s one GPU moves to or from host memory *per direction* over its host interface
  (half the datasheet's bidirectional "PCIe GenN: X GB/s" figure): what offloading to the host costs.

Values in decimal units as printed (1 TB/s = 10**12 B/s, 1 TFLOPS = 10**12 FLOP/s).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["CHIP_ALIASES", "CHIP_TABLE", "FALLBACK_CHIP", "ChipEntry", "lookup_chip", "match_device_name"]

GiB = 2**30
TB = 10**12
GB = 10**9
TFLOPS = 10**12


@dataclass(frozen=True, kw_only=True)
class ChipEntry:
    """One row of the table (see the module docstring for units).

    Args:
        key: canonical preset name, e.g. ``"h100-sxm"``.
        label: marketing name.
        memory_bytes: device memory, bytes.
        peak_flops: dense 16-bit tensor FLOP/s.
        peak_flops_fp32: dense fp32 FLOP/s (no TF32).
        intra_node_bw: per-GPU, per-direction bytes/s inside a node.
        inter_node_bw: per-GPU, per-direction bytes/s across nodes (reference system).
        memory_bw: device-memory bytes/s.
        host_link_bw: per-direction bytes/s between the GPU and host memory (its PCIe x16 link).
        supports_bf16: whether the tensor cores run bf16 (False: V100, fp16 only).
        intra_node_link: what the intra-node figure is (``"NVLink 4 / NVSwitch"``, ``"PCIe 4.0 x16"``).
        source: datasheet title and URL text, plus the reference system for the network figure.
        fallback: True only for :data:`FALLBACK_CHIP` (values are assumptions, not a datasheet).
    """

    key: str
    label: str
    memory_bytes: int
    peak_flops: float
    peak_flops_fp32: float
    intra_node_bw: float
    inter_node_bw: float
    memory_bw: float
    host_link_bw: float = 0.0
    supports_bf16: bool = True
    intra_node_link: str = ""
    source: str = ""
    fallback: bool = False


#: Host interface, bytes/s per direction: half the datasheets' bidirectional PCIe x16 figure ("PCIe Gen4:
#: 64 GB/s" on the A100, L4, L40S, A10 datasheets; "PCIe Gen5: 128 GB/s" on the H100/H200 ones; the V100's
#: "PCIe 32 GB/s" is Gen3; the RTX 4090 is a Gen4 x16 board (Ada whitepaper); for the B200 no per-GPU
#: figure is printed and HGX B200's Gen5 host links are assumed), the per-lane rates of
#: ``hardware/detect.py`` ``PCIE_BW_PER_LANE`` x 16 agree to 2 %.
PCIE_GEN3_X16 = 16 * GB
PCIE_GEN4_X16 = 32 * GB
PCIE_GEN5_X16 = 64 * GB

_A100_DS = (
    "NVIDIA A100 Tensor Core GPU Datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf, "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): BF16 312 TFLOPS dense (624* sparse), FP32 19.5 "
    "TFLOPS, NVLink 600 GB/s, PCIe Gen4 64 GB/s; network: NVIDIA DGX A100 Datasheet, 8x single-port "
    "ConnectX-6 200 Gb/s HDR "
    "InfiniBand (one per GPU)"
)
_H100_DS = (
    "NVIDIA H100 Tensor Core GPU Datasheet (https://resources.nvidia.com/en-us-tensor-core/"
    "nvidia-tensor-core-gpu-datasheet): SXM BF16 1,979* TFLOPS sparse = 989.5 dense, FP32 67 TFLOPS, "
    "3.35 TB/s, NVLink 900 GB/s; PCIe BF16 1,513* sparse = 756 dense, FP32 51 TFLOPS, 2.0 TB/s, "
    "PCIe Gen5 128 GB/s (NVLink bridge 600 GB/s pairs GPUs only)"
)

CHIP_TABLE: dict[str, ChipEntry] = {
    "a100-40gb": ChipEntry(
        key="a100-40gb", label="NVIDIA A100-SXM4-40GB", memory_bytes=40 * GiB,
        peak_flops=312 * TFLOPS, peak_flops_fp32=19.5 * TFLOPS,
        intra_node_bw=300 * GB, inter_node_bw=25 * GB, memory_bw=1.555 * TB, host_link_bw=PCIE_GEN4_X16,
        intra_node_link="NVLink 3 / NVSwitch (600 GB/s bidirectional)",
        source=_A100_DS + "; 40GB HBM2 at 1,555 GB/s",
    ),
    "a100-80gb": ChipEntry(
        key="a100-80gb", label="NVIDIA A100-SXM4-80GB", memory_bytes=80 * GiB,
        peak_flops=312 * TFLOPS, peak_flops_fp32=19.5 * TFLOPS,
        intra_node_bw=300 * GB, inter_node_bw=25 * GB, memory_bw=2.039 * TB, host_link_bw=PCIE_GEN4_X16,
        intra_node_link="NVLink 3 / NVSwitch (600 GB/s bidirectional)",
        source=_A100_DS + "; 80GB HBM2e at 2,039 GB/s",
    ),
    "h100-sxm": ChipEntry(
        key="h100-sxm", label="NVIDIA H100 SXM5 80GB", memory_bytes=80 * GiB,
        peak_flops=989.5 * TFLOPS, peak_flops_fp32=67 * TFLOPS,
        intra_node_bw=450 * GB, inter_node_bw=50 * GB, memory_bw=3.35 * TB, host_link_bw=PCIE_GEN5_X16,
        intra_node_link="NVLink 4 / NVSwitch (900 GB/s bidirectional)",
        source=_H100_DS + "; network: NVIDIA DGX H100 Datasheet, 8x ConnectX-7 400 Gb/s NDR InfiniBand",
    ),
    "h100-pcie": ChipEntry(
        key="h100-pcie", label="NVIDIA H100 PCIe 80GB", memory_bytes=80 * GiB,
        peak_flops=756 * TFLOPS, peak_flops_fp32=51 * TFLOPS,
        intra_node_bw=64 * GB, inter_node_bw=25 * GB, memory_bw=2.0 * TB, host_link_bw=PCIE_GEN5_X16,
        intra_node_link="PCIe Gen5 x16 (128 GB/s bidirectional)",
        source=_H100_DS + "; network: typical 200 Gb/s per GPU (assumption for PCIe servers)",
    ),
    "h200": ChipEntry(
        key="h200", label="NVIDIA H200 SXM 141GB", memory_bytes=141 * GiB,
        peak_flops=989.5 * TFLOPS, peak_flops_fp32=67 * TFLOPS,
        intra_node_bw=450 * GB, inter_node_bw=50 * GB, memory_bw=4.8 * TB, host_link_bw=PCIE_GEN5_X16,
        intra_node_link="NVLink 4 / NVSwitch (900 GB/s bidirectional)",
        source=(
            "NVIDIA H200 Tensor Core GPU Datasheet (https://nvdam.widen.net/s/nb5zzzsjdf/"
            "hpc-datasheet-sc23-h200-datasheet-3002446): SXM BF16 1,979* TFLOPS sparse = 989.5 dense, "
            "FP32 67 TFLOPS, 141GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; network: NVIDIA DGX H200, "
            "8x ConnectX-7 400 Gb/s"
        ),
    ),
    "b200": ChipEntry(
        key="b200", label="NVIDIA B200 180GB", memory_bytes=180 * GiB,
        peak_flops=2250 * TFLOPS, peak_flops_fp32=75 * TFLOPS,
        intra_node_bw=900 * GB, inter_node_bw=50 * GB, memory_bw=8.0 * TB, host_link_bw=PCIE_GEN5_X16,
        intra_node_link="NVLink 5 / NVSwitch (1.8 TB/s bidirectional)",
        source=(
            "NVIDIA DGX B200 Datasheet (https://resources.nvidia.com/en-us-dgx-systems/dgx-b200-datasheet): "
            "8 GPUs, 1,440GB total (180GB each), 8x ConnectX-7 400 Gb/s; NVIDIA HGX B200 "
            "(https://www.nvidia.com/en-us/data-center/hgx/): FP16/BF16 4.5* PFLOPS sparse = 2.25 dense, "
            "FP32 75 TFLOPS, HBM3e 8 TB/s, NVLink 5 1.8 TB/s"
        ),
    ),
    "l4": ChipEntry(
        key="l4", label="NVIDIA L4 24GB", memory_bytes=24 * GiB,
        peak_flops=121 * TFLOPS, peak_flops_fp32=30.3 * TFLOPS,
        intra_node_bw=32 * GB, inter_node_bw=100 * GB / 8 / 8, memory_bw=300 * GB, host_link_bw=PCIE_GEN4_X16,
        intra_node_link="PCIe Gen4 x16 (64 GB/s bidirectional), no NVLink",
        source=(
            "NVIDIA L4 Tensor Core GPU Datasheet (https://resources.nvidia.com/en-us-data-center-overview/"
            "l4-gpu-datasheet): BF16 242* TFLOPS sparse = 121 dense, FP32 30.3 TFLOPS, 24GB GDDR6 at 300 GB/s; "
            "network: Google Cloud g2-standard-96, 8x L4 with 100 Gb/s per VM"
        ),
    ),
    "l40s": ChipEntry(
        key="l40s", label="NVIDIA L40S 48GB", memory_bytes=48 * GiB,
        peak_flops=362.05 * TFLOPS, peak_flops_fp32=91.6 * TFLOPS,
        intra_node_bw=32 * GB, inter_node_bw=25 * GB, memory_bw=864 * GB, host_link_bw=PCIE_GEN4_X16,
        intra_node_link="PCIe Gen4 x16 (64 GB/s bidirectional), no NVLink",
        source=(
            "NVIDIA L40S GPU Datasheet (https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413): "
            "BF16 733* TFLOPS sparse = 362.05 dense, FP32 91.6 TFLOPS, 48GB GDDR6 at 864 GB/s; network: "
            "typical 200 Gb/s per GPU (assumption)"
        ),
    ),
    "a10g": ChipEntry(
        key="a10g", label="NVIDIA A10G 24GB", memory_bytes=24 * GiB,
        peak_flops=125 * TFLOPS, peak_flops_fp32=31.2 * TFLOPS,
        intra_node_bw=32 * GB, inter_node_bw=100 * GB / 8 / 8, memory_bw=600 * GB, host_link_bw=PCIE_GEN4_X16,
        intra_node_link="PCIe Gen4 x16 (64 GB/s bidirectional), no NVLink",
        source=(
            "NVIDIA A10 Tensor Core GPU Datasheet (https://www.nvidia.com/content/dam/en-zz/Solutions/"
            "Data-Center/a10/pdf/a10-datasheet.pdf): BF16 250* TFLOPS sparse = 125 dense, FP32 31.2 "
            "TFLOPS, 24GB GDDR6 at 600 GB/s (the A10G is AWS's A10 variant; AWS publishes no FLOP figure); "
            "network: Amazon EC2 G5 (https://aws.amazon.com/ec2/instance-types/g5/), g5.48xlarge 8 GPUs, "
            "100 Gb/s"
        ),
    ),
    "rtx-4090": ChipEntry(
        key="rtx-4090", label="NVIDIA GeForce RTX 4090 24GB", memory_bytes=24 * GiB,
        peak_flops=165.2 * TFLOPS, peak_flops_fp32=82.6 * TFLOPS,
        intra_node_bw=32 * GB, inter_node_bw=10 * GB / 8, memory_bw=1008 * GB, host_link_bw=PCIE_GEN4_X16,
        intra_node_link="PCIe Gen4 x16 (64 GB/s bidirectional), no NVLink, no P2P",
        source=(
            "NVIDIA Ada GPU Architecture whitepaper v2.1 (https://images.nvidia.com/aem-dam/Solutions/"
            "Data-Center/l4/nvidia-ada-gpu-architecture-whitepaper-v2.1.pdf), Appendix A: RTX 4090 peak "
            "BF16 tensor TFLOPS with FP32 accumulate 165.2 dense (330.4* sparse), FP32 82.6 TFLOPS, "
            "24GB GDDR6X at 1,008 GB/s; network: 10 GbE workstation (assumption)"
        ),
    ),
    "v100": ChipEntry(
        key="v100", label="NVIDIA Tesla V100-SXM2-32GB", memory_bytes=32 * GiB,
        peak_flops=125 * TFLOPS, peak_flops_fp32=15.7 * TFLOPS,
        intra_node_bw=150 * GB, inter_node_bw=100 * GB / 8 * 4 / 8, memory_bw=900 * GB, host_link_bw=PCIE_GEN3_X16,
        supports_bf16=False,
        intra_node_link="NVLink 2 hybrid cube mesh (300 GB/s bidirectional)",
        source=(
            "NVIDIA Tesla V100 GPU Accelerator Datasheet (https://images.nvidia.com/content/technologies/"
            "volta/pdf/tesla-volta-v100-datasheet-letter-fnl-web.pdf): SXM2 tensor (FP16) 125 TFLOPS, "
            "FP32 15.7 TFLOPS, 32GB HBM2 at 900 GB/s, NVLink 300 GB/s; no bf16 (peak_flops is fp16); "
            "network: NVIDIA DGX-1 Datasheet, 4x 100 Gb/s EDR InfiniBand for 8 GPUs"
        ),
    ),
}

#: Used when a detected device is not in the table; every value is an assumption, marked as such.
#: Conservative on purpose (an L4-class accelerator on PCIe Gen4 with 100 Gb/s networking) so a plan
#: made with it errs towards more sharding rather than an out-of-memory error.
FALLBACK_CHIP = ChipEntry(
    key="unknown", label="unknown accelerator (fallback values)", memory_bytes=16 * GiB,
    peak_flops=100 * TFLOPS, peak_flops_fp32=20 * TFLOPS,
    intra_node_bw=32 * GB, inter_node_bw=100 * GB / 8 / 8, memory_bw=500 * GB, host_link_bw=PCIE_GEN4_X16,
    intra_node_link="assumed PCIe Gen4 x16",
    source="fallback: no datasheet; assumed values, pass HardwareSpec(...) with your chip's figures",
    fallback=True,
)

#: Alternative spellings accepted by :meth:`HardwareSpec.preset` (lower case, ``_``/space -> ``-``).
CHIP_ALIASES: dict[str, str] = {
    "a100": "a100-80gb",
    "a100-80": "a100-80gb",
    "a100-40": "a100-40gb",
    "a100-sxm-80gb": "a100-80gb",
    "a100-sxm4-80gb": "a100-80gb",
    "a100-sxm4-40gb": "a100-40gb",
    "h100": "h100-sxm",
    "h100-80gb": "h100-sxm",
    "h100-sxm5": "h100-sxm",
    "h100-sxm-80gb": "h100-sxm",
    "h100-pcie-80gb": "h100-pcie",
    "h200-141gb": "h200",
    "h200-sxm": "h200",
    "b200-180gb": "b200",
    "l4-24gb": "l4",
    "l40s-48gb": "l40s",
    "a10": "a10g",
    "a10g-24gb": "a10g",
    "4090": "rtx-4090",
    "rtx4090": "rtx-4090",
    "geforce-rtx-4090": "rtx-4090",
    "v100-32gb": "v100",
    "v100-sxm2": "v100",
    "v100-sxm2-32gb": "v100",
}


def _normalise(name: str) -> str:
    return re.sub(r"[-_\s]+", "-", name.strip().lower()).strip("-")


def lookup_chip(name: str) -> ChipEntry | None:
    """The table entry for a preset name or alias (case-insensitive), or ``None``."""
    key = _normalise(name)
    key = CHIP_ALIASES.get(key, key)
    return CHIP_TABLE.get(key)


# Substrings of ``torch.cuda.get_device_name()`` / NVML names, most specific first.
_DEVICE_NAME_PATTERNS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("h100", "pcie"), "h100-pcie"),
    (("h100",), "h100-sxm"),
    (("h200",), "h200"),
    (("gh200",), "h200"),
    (("b200",), "b200"),
    (("a100", "40gb"), "a100-40gb"),
    (("a100",), "a100-80gb"),
    (("l40s",), "l40s"),
    (("a10g",), "a10g"),
    (("a10",), "a10g"),
    (("4090",), "rtx-4090"),
    (("v100",), "v100"),
    (("l4",), "l4"),
)


def match_device_name(device_name: str) -> ChipEntry | None:
    """Map a CUDA device name (``"NVIDIA H100 80GB HBM3"``, ``"NVIDIA A100-SXM4-40GB"``) to an entry."""
    low = device_name.lower()
    tokens = set(low.replace("-", " ").split())
    for needles, key in _DEVICE_NAME_PATTERNS:
        if key == "l4":
            if "l4" in tokens:
                return CHIP_TABLE[key]
            continue
        if key == "a10g" and needles == ("a10",):
            if "a10" in tokens:
                return CHIP_TABLE[key]
            continue
        if all(n in low for n in needles):
            return CHIP_TABLE[key]
    return None
