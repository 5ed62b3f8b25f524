"""Describe the local machine as a :class:`HardwareSpec` (the only module of the core that queries a device).

With CUDA: the device name, ``torch.cuda.mem_get_info`` total bytes, the device count as
``gpus_per_node``, FLOP/s and the network figure from the sourced table matched by name (an unknown chip
gets a warning and the marked fallback). When ``nvidia-ml-py`` (``pynvml``) is importable, the
intra-node bandwidth is measured from the links NVML reports as active: active NVLink links x per-link
bandwidth of their NVLink version, or the PCIe generation x width when no NVLink is up.
Without CUDA: a description of the CPU host (memory from ``sysconf``; speeds unknown).
"""

from __future__ import annotations

import dataclasses
import os
import platform
from typing import Any

from lightning_memplan.hardware.presets import match_device_name
from lightning_memplan.hardware.spec import HardwareSpec

__all__ = [
    "NVLINK_BW_PER_LINK",
    "PCIE_BW_PER_LANE",
    "detect_hardware",
    "nvml_interconnect",
]

#: Bytes/s per NVLink link per direction, by NVLink version (NVIDIA NVLink and NVSwitch page,
#: https://www.nvidia.com/en-us/data-center/nvlink/: V100 6 links / A100 12 links / H100 18 links
#: = 300 / 600 / 900 GB/s bidirectional, i.e. 25 GB/s per link per direction; NVLink 5 doubles it).
NVLINK_BW_PER_LINK: dict[int, float] = {1: 20e9, 2: 25e9, 3: 25e9, 4: 25e9, 5: 50e9}

#: Bytes/s per PCIe lane per direction after line encoding, by generation (PCI-SIG specifications:
#: 2.5/5 GT/s 8b/10b, 8/16/32 GT/s 128b/130b, 64 GT/s PAM4 FLIT).
PCIE_BW_PER_LANE: dict[int, float] = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}


def _pynvml() -> Any | None:
    try:
        import pynvml  # provided by the nvidia-ml-py package
    except ImportError:
        return None
    return pynvml


def nvml_interconnect(device: int = 0, *, pci_bus_id: str | None = None) -> dict[str, Any] | None:
    """Intra-node link of one GPU as NVML reports it, or ``None`` without ``nvidia-ml-py``/NVML.

    Returns:
        ``{"link": "nvlink"|"pcie", "active_links": n, "version": v, "bw": bytes/s per direction}``.
    """
    nvml = _pynvml()
    if nvml is None:
        return None
    try:
        nvml.nvmlInit()
    except Exception:  # NVML present but no driver: nothing to report
        return None
    try:
        handle = None
        if pci_bus_id:
            try:
                handle = nvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id)
            except Exception:
                handle = None
        if handle is None:
            handle = nvml.nvmlDeviceGetHandleByIndex(device)
        active, version = 0, 0
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                state = nvml.nvmlDeviceGetNvLinkState(handle, link)
            except Exception:
                continue
            if state == getattr(nvml, "NVML_FEATURE_ENABLED", 1):
                active += 1
                try:
                    version = max(version, int(nvml.nvmlDeviceGetNvLinkVersion(handle, link)))
                except Exception:
                    pass
        if active:
            per_link = NVLINK_BW_PER_LINK.get(version, NVLINK_BW_PER_LINK[4])
            return {"link": "nvlink", "active_links": active, "version": version, "bw": active * per_link}
        gen = int(nvml.nvmlDeviceGetCurrPcieLinkGeneration(handle))
        width = int(nvml.nvmlDeviceGetCurrPcieLinkWidth(handle))
        return {"link": "pcie", "active_links": width, "version": gen, "bw": width * PCIE_BW_PER_LANE.get(gen, 0.985e9)}
    except Exception:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX
        return 1


def _cpu_spec(num_nodes: int) -> HardwareSpec:
    cpu = platform.processor() or platform.machine() or "unknown cpu"
    cores = os.cpu_count() or 1
    return HardwareSpec(
        f"cpu ({cpu}, {cores} cores)",
        max(1, _host_memory_bytes()),
        gpus_per_node=1,
        num_nodes=num_nodes,
        source="host description (no CUDA device): memory from sysconf; speeds unknown",
    )


def detect_hardware(*, num_nodes: int = 1, device: int | None = None) -> HardwareSpec:
    """The local machine as a :class:`HardwareSpec`.

    Args:
        num_nodes: nodes of the cluster (one machine cannot see the others; pass it).
        device: CUDA device index to describe; ``None`` means the current device.

    Returns:
        A spec whose ``memory_bytes`` is the total the driver reports (``mem_get_info``), whose
        ``gpus_per_node`` is ``torch.cuda.device_count()``, with speeds from the table (matched by device
        name) and the intra-node bandwidth from NVML when available. Without CUDA, the CPU host.
    """
    import torch

    if not torch.cuda.is_available():
        return _cpu_spec(num_nodes)
    index = torch.cuda.current_device() if device is None else device
    props = torch.cuda.get_device_properties(index)
    _, total = torch.cuda.mem_get_info(index)
    count = torch.cuda.device_count()
    chip = match_device_name(props.name)
    if chip is None:
        spec = HardwareSpec.fallback_for(props.name, int(total), gpus_per_node=count, num_nodes=num_nodes)
    else:
        spec = HardwareSpec.from_chip(chip, gpus_per_node=count, num_nodes=num_nodes)
        spec = dataclasses.replace(
            spec,
            memory_bytes=int(total),
            source=f"torch.cuda: {props.name!r}, {int(total)} bytes (mem_get_info); table: {chip.source}",
        )
    bus = None
    # Not in torch's _CudaDeviceProperties stub on every version, so read them dynamically.
    domain, pci_bus, pci_dev = (getattr(props, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    if domain is not None and pci_bus is not None and pci_dev is not None:
        bus = f"{domain:08x}:{pci_bus:02x}:{pci_dev:02x}.0"
    link = nvml_interconnect(index, pci_bus_id=bus)
    if link is not None and link["bw"] > 0 and count > 1:
        spec = dataclasses.replace(
            spec,
            intra_node_bw=float(link["bw"]),
            source=spec.source + f"; nvml: {link['active_links']} active {link['link']} v{link['version']} links",
        )
    return spec
