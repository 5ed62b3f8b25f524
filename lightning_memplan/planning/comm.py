"""Communication cost terms: collectives on a group of ranks over the link that group crosses.

Every term is ``alpha-beta``: a per-step latency plus bytes over achievable bandwidth. Bandwidths are
per GPU per direction (see :mod:`lightning_memplan.hardware.presets`).

Sources:
  [PY09] Patarasuk and Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
         workstations", J. Parallel Distrib. Comput. 69(2): ring all-reduce moves 2 (n-1)/n of the
         message per rank in 2 (n-1) steps; reduce-scatter and all-gather move (n-1)/n in n-1 steps.
  [NCCL] NVIDIA nccl-tests, doc/PERFORMANCE.md: "bus bandwidth" = algorithm bandwidth x 2(n-1)/n for
         all-reduce, x (n-1)/n for all-gather/reduce-scatter; measured bus bandwidth reaches ~75-90 %
         of the link's rated bandwidth on NVLink and InfiniBand.
  [N21]  Narayanan et al. 2021, arXiv 2104.04473, section 3: tensor parallelism inside a DGX node
         (NVLink), pipeline parallelism across nodes; point-to-point pipeline messages b s h.
  [TT-A100] torchtitan ``docs/performance.md``: Llama 3 8B and 70B with FSDP over 64 A100 (8 nodes)
         run at 2,973 and 331 tokens/s/GPU; their per-step FSDP traffic (bf16 gathers twice, fp32
         reduce-scatter) over those step times is 23 GB/s per GPU, 0.92 of a 200 Gb/s HDR port: the
         network efficiency below, calibrated on these network-bound runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_memplan.hardware.spec import HardwareSpec

__all__ = [
    "COLLECTIVE_BW_EFFICIENCY",
    "INTER_NODE_BW_EFFICIENCY",
    "INTER_NODE_LATENCY_S",
    "INTRA_NODE_LATENCY_S",
    "Link",
    "all_gather_time",
    "all_reduce_time",
    "group_link",
    "p2p_time",
    "reduce_scatter_time",
]

#: Fraction of the rated NVLink/PCIe bandwidth a large NCCL collective inside a node achieves (bus
#: bandwidth) [NCCL].
COLLECTIVE_BW_EFFICIENCY = 0.8
#: Fraction of the per-GPU network bandwidth a large NCCL collective across nodes achieves; one NIC
#: per GPU with GPUDirect RDMA runs close to line rate [NCCL], calibrated at 0.92 on [TT-A100].
INTER_NODE_BW_EFFICIENCY = 0.92
#: Per-step latency of a collective inside a node (NVLink/PCIe hop plus kernel launch), seconds.
#: nccl-tests report ~10-20 us for an 8-GPU NVLink all-reduce of a few bytes (14 ring steps) [NCCL].
INTRA_NODE_LATENCY_S = 1e-6
#: Per-step latency across nodes (InfiniBand/RoCE round trip ~ 2-5 us), seconds [NCCL].
INTER_NODE_LATENCY_S = 4e-6


@dataclass(frozen=True)
class Link:
    """The link a process group's traffic crosses: its bandwidth (per GPU per direction), latency,
    and whether it is the inter-node network."""

    bw: float
    latency: float
    inter_node: bool

    @property
    def eff_bw(self) -> float:
        """Achievable bytes/s: the rated bandwidth times the collective efficiency of this kind of link."""
        return self.bw * (INTER_NODE_BW_EFFICIENCY if self.inter_node else COLLECTIVE_BW_EFFICIENCY)


def group_link(hardware: HardwareSpec, stride: int, size: int) -> Link:
    """Link used by a group of ``size`` ranks spaced ``stride`` apart in the rank order.

    Ranks are numbered node by node (rank // gpus_per_node is the node). The mesh order is
    (pp, dp, cp, tp) with tp fastest, so the tp group has stride 1, cp stride t, dp stride t*c and pp
    stride d*c*t. Each group lies in an aligned block of ``stride * size`` consecutive ranks, so every
    group is inside one node iff that block size divides ``gpus_per_node`` (tp=6 on 8-GPU nodes puts
    ranks 6-11 in one group, straddling two nodes); otherwise rings cross the network, whose per-GPU
    bandwidth then bounds every step of the ring [PY09]."""
    if size <= 1:
        return Link(bw=float("inf"), latency=0.0, inter_node=False)
    span = stride * size
    if span <= hardware.gpus_per_node and hardware.gpus_per_node % span == 0:
        return Link(hardware.resolved("intra_node_bw"), INTRA_NODE_LATENCY_S, False)
    return Link(hardware.resolved("inter_node_bw"), INTER_NODE_LATENCY_S, True)


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of ``nbytes`` on n ranks: ``2 (n-1)/n * bytes / (eff * bw) + 2 (n-1) * alpha`` [PY09]."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.eff_bw + 2 * (n - 1) * link.latency


def reduce_scatter_time(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of an ``nbytes`` input: ``(n-1)/n * bytes / (eff * bw) + (n-1) * alpha`` [PY09]."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / link.eff_bw + (n - 1) * link.latency


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather producing ``nbytes``: same cost as reduce-scatter [PY09]."""
    return reduce_scatter_time(nbytes, n, link)


def p2p_time(nbytes: float, link: Link) -> float:
    """One point-to-point send of ``nbytes``: ``bytes / (eff * bw) + alpha`` (pipeline activations [N21])."""
    if nbytes <= 0 or link.bw == float("inf"):
        return 0.0
    return nbytes / link.eff_bw + link.latency
