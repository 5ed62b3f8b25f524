"""What the local machine says about itself (the only module of the core that queries a device).

:func:`cuda_device`: the device name, ``torch.cuda.mem_get_info`` total bytes, the device count and PCI
bus id. :func:`nvml_interconnect`: when ``nvidia-ml-py`` (``pynvml``) is importable, the intra-node link
NVML reports as active: active NVLink links x per-link bandwidth of their NVLink version, or the PCIe
generation x width when no NVLink is up; :func:`nvml_pcie_bw`: the GPU's PCIe link to the host (the
offloading link). :func:`host_description`: the CPU host; :func:`host_memory_bytes`: its physical memory
(``sysconf``). :meth:`HardwareSpec.detect <lightning_memplan.hardware.spec.HardwareSpec.detect>` (and
:func:`~lightning_memplan.hardware.spec.detect_hardware`) turn these facts into a spec with the sourced
table's speeds; this module builds no spec, so ``spec`` imports it and not the other way round.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "NVLINK_BW_PER_LINK",
    "PCIE_BW_PER_LANE",
    "LocalDevice",
    "cuda_device",
    "host_description",
    "host_memory_bytes",
    "nvml_interconnect",
    "nvml_pcie_bw",
]

#: Bytes/s per NVLink link per direction, by NVLink version (NVIDIA NVLink and NVSwitch page,
#: https://www.nvidia.com/en-us/data-center/nvlink/: V100 6 links / A100 12 links / H100 18 links
#: = 300 / 600 / 900 GB/s bidirectional, i.e. 25 GB/s per link per direction; NVLink 5 doubles it).
NVLINK_BW_PER_LINK: dict[int, float] = {1: 20e9, 2: 25e9, 3: 25e9, 4: 25e9, 5: 50e9}

#: Bytes/s per PCIe lane per direction after line encoding, by generation (PCI-SIG specifications:
#: 2.5/5 GT/s 8b/10b, 8/16/32 GT/s 128b/130b, 64 GT/s PAM4 FLIT).
PCIE_BW_PER_LANE: dict[int, float] = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}


_T = TypeVar("_T")


def _pynvml() -> Any | None:
    try:
        import pynvml  # provided by the nvidia-ml-py package
    except ImportError:
        return None
    return pynvml


def _with_nvml_handle(device: int, pci_bus_id: str | None, query: Callable[[Any, Any], _T | None]) -> _T | None:
    """``query(nvml, handle)`` for one GPU (by PCI bus id when given, else by index) between
    ``nvmlInit`` and ``nvmlShutdown``; ``None`` without ``nvidia-ml-py``, without a driver, or when NVML
    raises (a query is best effort: the caller falls back to the sourced tables)."""
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
        return query(nvml, handle)
    except Exception:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _pcie_link(nvml: Any, handle: Any) -> tuple[int, int, float]:
    """``(generation, width, bytes/s per direction)`` of the GPU's current PCIe link (0.0 for an unknown generation)."""
    gen = int(nvml.nvmlDeviceGetCurrPcieLinkGeneration(handle))
    width = int(nvml.nvmlDeviceGetCurrPcieLinkWidth(handle))
    return gen, width, width * PCIE_BW_PER_LANE.get(gen, 0.0)


def nvml_interconnect(device: int = 0, *, pci_bus_id: str | None = None) -> dict[str, Any] | None:
    """Intra-node link of one GPU as NVML reports it, or ``None`` without ``nvidia-ml-py``/NVML.

    Returns:
        ``{"link": "nvlink"|"pcie", "active_links": n, "version": v, "bw": bytes/s per direction}``.
    """

    def query(nvml: Any, handle: Any) -> dict[str, Any]:
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
        gen, width, bw = _pcie_link(nvml, handle)
        # an unknown (newer) generation is read as Gen3 lanes, the floor of any current GPU's link
        return {"link": "pcie", "active_links": width, "version": gen, "bw": bw or width * PCIE_BW_PER_LANE[3]}

    return _with_nvml_handle(device, pci_bus_id, query)


def _host_memory_bytes() -> int:
    return host_memory_bytes() or 1


def host_memory_bytes() -> int | None:
    """Physical memory of this host in bytes, ``sysconf(SC_PAGE_SIZE) * sysconf(SC_PHYS_PAGES)``; ``None``
    where ``sysconf`` cannot say (not POSIX)."""
    try:
        value = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX
        return None
    return value if value > 0 else None


def nvml_pcie_bw(device: int = 0, *, pci_bus_id: str | None = None) -> float | None:
    """Bytes/s per direction of one GPU's PCIe link to the host as NVML reports it (current generation x
    width x :data:`PCIE_BW_PER_LANE`), or ``None`` without ``nvidia-ml-py``/NVML."""

    def query(nvml: Any, handle: Any) -> float | None:
        bw = _pcie_link(nvml, handle)[2]
        return bw if bw > 0 else None

    return _with_nvml_handle(device, pci_bus_id, query)


@dataclass(frozen=True, kw_only=True)
class LocalDevice:
    """What the driver says about one local CUDA device (what :meth:`HardwareSpec.detect` describes).

    Attributes:
        name: ``torch.cuda.get_device_properties(index).name``.
        index: the CUDA device index.
        total_memory: bytes, ``torch.cuda.mem_get_info(index)[1]``.
        count: ``torch.cuda.device_count()``.
        pci_bus_id: ``"domain:bus:device.0"`` when the properties carry it (NVML looks the device up by it).
    """

    name: str
    index: int
    total_memory: int
    count: int
    pci_bus_id: str | None = None


def host_description() -> tuple[str, int]:
    """``(name, memory bytes)`` of the CPU host: processor and core count, memory from ``sysconf``."""
    cpu = platform.processor() or platform.machine() or "unknown cpu"
    cores = os.cpu_count() or 1
    return f"cpu ({cpu}, {cores} cores)", max(1, _host_memory_bytes())


def cuda_device(device: int | None = None) -> LocalDevice | None:
    """The local CUDA device ``device`` (``None``: the current one), or ``None`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if device is not None and device >= count:  # torch would raise an AssertionError/RuntimeError
        raise ValueError(f"device={device!r} is not a visible CUDA device; use an index in [0, {count - 1}] or None")
    index = torch.cuda.current_device() if device is None else device
    props = torch.cuda.get_device_properties(index)
    _, total = torch.cuda.mem_get_info(index)
    bus = None
    # Not in torch's _CudaDeviceProperties stub on every version, so read them dynamically.
    domain, pci_bus, pci_dev = (getattr(props, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    if domain is not None and pci_bus is not None and pci_dev is not None:
        bus = f"{domain:08x}:{pci_bus:02x}:{pci_dev:02x}.0"
    return LocalDevice(name=props.name, index=index, total_memory=int(total), count=count,
                       pci_bus_id=bus)
