"""``HardwareSpec``: the devices a plan runs on (one chip type), how many, and how they are connected."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any

from lightning_memplan.hardware import detect as _device
from lightning_memplan.hardware.presets import (
    CHIP_ALIASES,
    CHIP_TABLE,
    FALLBACK_CHIP,
    ChipEntry,
    lookup_chip,
    match_device_name,
)
from lightning_memplan.validation import (
    MAX_WORLD_SIZE,
    check_bool,
    check_int,
    check_mapping,
    check_number,
    check_optional_int,
)

__all__ = ["MAX_GPUS_PER_NODE", "HardwareSpec", "detect_hardware", "known_presets"]


def known_presets() -> list[str]:
    """Canonical preset names, in table order."""
    return list(CHIP_TABLE)


#: Most GPUs per node (the NVLink/PCIe domain) a spec accepts: 7x the largest NVLink domain announced
#: (NVIDIA's NVL576), so the planner's loops over in-node widths stay bounded whatever the user passes.
MAX_GPUS_PER_NODE = 4096


def _check_positive_number(name: str, value: Any, unit: str) -> float:
    return check_number(name, value, minimum=0.0, min_inclusive=False,
                        hint=f"a finite number of {unit}; leave it None when unknown")


@dataclass(frozen=True)
class HardwareSpec:
    """One cluster of identical accelerators: per-device memory and speed, and its topology.

    Bandwidths are per GPU and per direction (what one GPU can push while all others do the same);
    FLOP/s are dense (no sparsity). ``None`` means unknown: the planner then uses the clearly marked
    values of :data:`~lightning_memplan.hardware.presets.FALLBACK_CHIP` and says so in its explanation.

    Args:
        name: label (a preset key such as ``"h100-sxm"``, or the detected device name).
        memory_bytes: device memory per GPU in bytes (what tensors, the CUDA context and NCCL share).
        gpus_per_node: GPUs per node (the NVLink/PCIe domain).
        num_nodes: nodes; ``world_size = gpus_per_node * num_nodes``.
        peak_flops: dense bf16 (fp16 where bf16 is absent) tensor FLOP/s per GPU.
        peak_flops_fp32: dense fp32 FLOP/s per GPU (used for ``precision="32-true"``).
        intra_node_bw: bytes/s per GPU per direction to GPUs of the same node.
        inter_node_bw: bytes/s per GPU per direction to other nodes.
        memory_bw: device-memory bandwidth, bytes/s.
        host_link_bw: bytes/s per GPU per direction between the GPU and host memory (its PCIe link): what
            the planner charges for offloading to the host.
        host_memory_bytes: host (CPU) memory per node in bytes, shared by the node's ``gpus_per_node``
            ranks; ``None`` (unknown) means the planner never offloads to the host.
        supports_bf16: whether bf16 runs on the tensor cores.
        source: where the numbers come from (datasheet title/URL, or ``"torch.cuda"``/``"nvml"``).
        fallback: True when any figure is an assumption for an unknown chip (shown in reports).
    """

    name: str
    memory_bytes: int
    gpus_per_node: int = field(default=1, kw_only=True)
    num_nodes: int = field(default=1, kw_only=True)
    peak_flops: float | None = field(default=None, kw_only=True)
    peak_flops_fp32: float | None = field(default=None, kw_only=True)
    intra_node_bw: float | None = field(default=None, kw_only=True)
    inter_node_bw: float | None = field(default=None, kw_only=True)
    memory_bw: float | None = field(default=None, kw_only=True)
    host_link_bw: float | None = field(default=None, kw_only=True)
    host_memory_bytes: int | None = field(default=None, kw_only=True)
    supports_bf16: bool = field(default=True, kw_only=True)
    source: str = field(default="", kw_only=True)
    fallback: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        # checked values stored back plain (np.int64 -> int), so to_dict()/asdict() is JSON with exact ints
        keep = functools.partial(object.__setattr__, self)
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name={self.name!r} must be a non-empty string such as 'h100-sxm'")
        keep("name", str(self.name))
        keep("memory_bytes", check_int("memory_bytes", self.memory_bytes, hint="device memory in bytes, e.g. 80 * 2**30"))
        keep("gpus_per_node", check_int(
            "gpus_per_node", self.gpus_per_node, maximum=MAX_GPUS_PER_NODE,
            hint=f"GPUs per node, e.g. 8 (at most MAX_GPUS_PER_NODE={MAX_GPUS_PER_NODE}, 7x the largest NVLink "
            "domain announced); describe more GPUs with num_nodes"))
        keep("num_nodes", check_int("num_nodes", self.num_nodes, maximum=MAX_WORLD_SIZE,
                                    hint=f"nodes, e.g. 1 (at most MAX_WORLD_SIZE={MAX_WORLD_SIZE} devices in all)"))
        if self.world_size > MAX_WORLD_SIZE:
            raise ValueError(
                f"gpus_per_node={self.gpus_per_node} x num_nodes={self.num_nodes} = {self.world_size} GPUs exceeds "
                f"MAX_WORLD_SIZE={MAX_WORLD_SIZE} (over ten times the largest cluster announced; the bound keeps "
                "every per-rank loop of the planner bounded); use fewer nodes"
            )
        keep("supports_bf16", check_bool("supports_bf16", self.supports_bf16))
        keep("fallback", check_bool("fallback", self.fallback))
        if not isinstance(self.source, str):
            raise TypeError(f"source={self.source!r} must be a string (where the figures come from)")
        for attr, unit in (
            ("peak_flops", "FLOP/s"),
            ("peak_flops_fp32", "FLOP/s"),
            ("intra_node_bw", "bytes/s"),
            ("inter_node_bw", "bytes/s"),
            ("memory_bw", "bytes/s"),
            ("host_link_bw", "bytes/s"),
        ):
            value = getattr(self, attr)
            if value is not None:
                keep(attr, _check_positive_number(attr, value, unit))
        keep("host_memory_bytes", check_optional_int(
            "host_memory_bytes", self.host_memory_bytes,
            hint="host memory per node in bytes, e.g. 2 * 2**40, or None when unknown (then nothing is offloaded)"))

    # Derived ------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """gpus_per_node * num_nodes."""
        return self.gpus_per_node * self.num_nodes

    def resolved(self, attr: str) -> float:
        """The value of a speed field, or the fallback's when it is ``None`` (see :meth:`assumed`)."""
        if attr not in ("peak_flops", "peak_flops_fp32", "intra_node_bw", "inter_node_bw", "memory_bw", "host_link_bw"):
            raise ValueError(f"attr={attr!r} is not a speed field of HardwareSpec")
        value = getattr(self, attr)
        return float(value) if value is not None else float(getattr(FALLBACK_CHIP, attr))

    def assumed(self) -> list[str]:
        """Names of the speed fields that are unknown and replaced by fallback values."""
        fields = ("peak_flops", "peak_flops_fp32", "intra_node_bw", "inter_node_bw", "memory_bw")
        missing = [f for f in fields if getattr(self, f) is None]
        if self.num_nodes == 1 and "inter_node_bw" in missing:
            missing.remove("inter_node_bw")  # never used on one node
        return missing

    def flops_for(self, precision: str) -> float:
        """Dense peak FLOP/s for a Lightning precision string (fp32 for ``"32-true"``)."""
        if precision in ("32-true", "32"):
            if self.peak_flops_fp32 is not None:
                return float(self.peak_flops_fp32)
            return self.resolved("peak_flops") / 16  # fp32 is ~1/16 of 16-bit tensor rate on NVIDIA
        return self.resolved("peak_flops")

    # Constructors -------------------------------------------------------------------------------
    @classmethod
    def from_chip(cls, chip: ChipEntry, *, gpus_per_node: int = 1, num_nodes: int = 1, name: str | None = None) -> HardwareSpec:
        """A spec from a table entry (see :mod:`lightning_memplan.hardware.presets`)."""
        return cls(
            name or chip.key,
            chip.memory_bytes,
            gpus_per_node=gpus_per_node,
            num_nodes=num_nodes,
            peak_flops=chip.peak_flops,
            peak_flops_fp32=chip.peak_flops_fp32,
            intra_node_bw=chip.intra_node_bw,
            inter_node_bw=chip.inter_node_bw,
            memory_bw=chip.memory_bw,
            host_link_bw=chip.host_link_bw or None,
            supports_bf16=chip.supports_bf16,
            source=chip.source,
            fallback=chip.fallback,
        )

    @classmethod
    def preset(cls, name: str, *, gpus_per_node: int = 1, num_nodes: int = 1) -> HardwareSpec:
        """A datasheet preset: ``HardwareSpec.preset("h100-80gb", gpus_per_node=8, num_nodes=4)``.

        Names are case-insensitive; aliases such as ``"h100"``, ``"h100-80gb"``, ``"a100"``,
        ``"a100-80gb"``, ``"4090"`` are accepted (see :data:`~lightning_memplan.hardware.presets.CHIP_ALIASES`).

        Raises:
            ValueError: unknown name (the message lists the known presets).
        """
        if not isinstance(name, str):
            raise TypeError(f"name={name!r} must be a preset name string such as 'h100-sxm'")
        chip = lookup_chip(name)
        if chip is None:
            import difflib

            names = list(CHIP_TABLE) + list(CHIP_ALIASES)
            close = difflib.get_close_matches(name.strip().lower(), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"hardware preset {name!r} is unknown{hint}; known presets: {', '.join(CHIP_TABLE)} "
                f"(aliases: {', '.join(CHIP_ALIASES)}); or build HardwareSpec(name, memory_bytes, ...) "
                "with your own figures"
            )
        return cls.from_chip(chip, gpus_per_node=gpus_per_node, num_nodes=num_nodes)

    @classmethod
    def detect(cls, *, num_nodes: int = 1, device: int | None = None) -> HardwareSpec:
        """The local machine (what :mod:`lightning_memplan.hardware.detect` reads from the driver).

        Args:
            num_nodes: nodes of the cluster (one machine cannot see the others; pass it).
            device: CUDA device index to describe; ``None`` means the current device.

        Returns:
            A spec whose ``memory_bytes`` is the total the driver reports (``mem_get_info``), whose
            ``gpus_per_node`` is ``torch.cuda.device_count()``, with speeds from the table (matched by
            device name; an unknown chip gets a warning and the marked fallback) and the intra-node
            bandwidth from NVML when available. Without CUDA, the CPU host (speeds unknown).

        Raises:
            TypeError / ValueError: ``num_nodes`` not a positive int; ``device`` not ``None`` or an int >= 0
                (checked with or without CUDA), or not a visible device index.
        """
        device = check_optional_int("device", device, minimum=0,
                                    hint="a CUDA device index, e.g. 0, or None for the current device")
        local = _device.cuda_device(device)
        host_memory = _device.host_memory_bytes()
        if local is None:
            name, memory = _device.host_description()
            return cls(name, memory, gpus_per_node=1, num_nodes=num_nodes, host_memory_bytes=host_memory,
                       source="host description (no CUDA device): memory from sysconf; speeds unknown")
        chip = match_device_name(local.name)
        if chip is None:
            spec = cls.fallback_for(local.name, local.total_memory, gpus_per_node=local.count, num_nodes=num_nodes)
        else:
            spec = cls.from_chip(chip, gpus_per_node=local.count, num_nodes=num_nodes)
            spec = dataclasses.replace(
                spec,
                memory_bytes=local.total_memory,
                source=f"torch.cuda: {local.name!r}, {local.total_memory} bytes (mem_get_info); table: {chip.source}",
            )
        spec = dataclasses.replace(spec, host_memory_bytes=host_memory,
                                   source=spec.source + "; host memory from sysconf" if host_memory else spec.source)
        pcie = _device.nvml_pcie_bw(local.index, pci_bus_id=local.pci_bus_id)
        if pcie:
            spec = dataclasses.replace(spec, host_link_bw=pcie, source=spec.source + "; nvml: host PCIe link")
        link = _device.nvml_interconnect(local.index, pci_bus_id=local.pci_bus_id)
        if link is not None and link["bw"] > 0 and local.count > 1:
            spec = dataclasses.replace(
                spec,
                intra_node_bw=float(link["bw"]),
                source=spec.source + f"; nvml: {link['active_links']} active {link['link']} v{link['version']} links",
            )
        return spec

    @classmethod
    def fallback_for(cls, device_name: str, memory_bytes: int, *, gpus_per_node: int = 1, num_nodes: int = 1) -> HardwareSpec:
        """A spec for a chip not in the table: real memory, fallback speeds, and a warning."""
        warnings.warn(
            f"device {device_name!r} is not in lightning_memplan's hardware table; using fallback speeds "
            f"({FALLBACK_CHIP.peak_flops / 1e12:.0f} TFLOP/s, {FALLBACK_CHIP.intra_node_bw / 1e9:.0f} GB/s "
            "intra-node). Plans stay memory-correct but their time ranking is approximate; pass "
            "HardwareSpec(..., peak_flops=..., intra_node_bw=..., inter_node_bw=...) for your chip",
            UserWarning,
            stacklevel=3,
        )
        spec = cls.from_chip(FALLBACK_CHIP, gpus_per_node=gpus_per_node, num_nodes=num_nodes, name=f"{device_name} (fallback)")
        return dataclasses.replace(spec, memory_bytes=memory_bytes)

    def replace(self, **changes: Any) -> HardwareSpec:
        """A copy with some fields changed (e.g. ``num_nodes=4`` or a measured ``inter_node_bw``)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One line: ``h100-sxm x 8/node x 32 nodes, 80.0 GiB, 990 TFLOP/s``."""
        flops = f"{self.peak_flops / 1e12:.0f} TFLOP/s" if self.peak_flops else "TFLOP/s unknown"
        mark = " [fallback values]" if self.fallback else ""
        return (
            f"{self.name} x {self.gpus_per_node}/node x {self.num_nodes} node{'s' if self.num_nodes > 1 else ''}, "
            f"{self.memory_bytes / 2**30:.1f} GiB, {flops}{mark}"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareSpec:
        """The inverse of :meth:`to_dict`.

        Raises:
            TypeError: ``data`` is not a dict, or a field has the wrong type.
            ValueError: ``name`` or ``memory_bytes`` is missing, or a key is not a field.
        """
        check_mapping("HardwareSpec.from_dict(data)", data, ("name", "memory_bytes"),
                      hint="pass what HardwareSpec.to_dict() returns")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"HardwareSpec.from_dict(data): unknown key(s) {', '.join(map(repr, unknown))}; "
                f"the fields are {', '.join(sorted(known))}"
            )
        data = dict(data)
        name, memory = data.pop("name"), data.pop("memory_bytes")
        return cls(name, memory, **data)


def detect_hardware(*, num_nodes: int = 1, device: int | None = None) -> HardwareSpec:
    """The local machine as a :class:`HardwareSpec`: :meth:`HardwareSpec.detect` (see there)."""
    return HardwareSpec.detect(num_nodes=num_nodes, device=device)
