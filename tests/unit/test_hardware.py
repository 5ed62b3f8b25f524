"""HardwareSpec, the sourced chip table, and detection (CPU path and a faked CUDA/NVML)."""

from __future__ import annotations

import sys
import types
import warnings

import pytest

from lightning_memplan.hardware import (
    CHIP_TABLE,
    FALLBACK_CHIP,
    HardwareSpec,
    detect_hardware,
    known_presets,
    lookup_chip,
    match_device_name,
    nvml_interconnect,
)
from lightning_memplan.hardware import detect as detect_mod

GiB = 2**30

# Datasheet figures typed in independently of the table: (memory GiB, dense 16-bit TFLOP/s, sparse
# TFLOP/s where the datasheet prints one, bidirectional NVLink/PCIe GB/s).
DATASHEET = {
    "a100-40gb": (40, 312, 624, 600),
    "a100-80gb": (80, 312, 624, 600),
    "h100-sxm": (80, 989.5, 1979, 900),
    "h100-pcie": (80, 756, 1513, 128),
    "h200": (141, 989.5, 1979, 900),
    "b200": (180, 2250, 4500, 1800),
    "l4": (24, 121, 242, 64),
    "l40s": (48, 362.05, None, 64),  # its datasheet prints 362.05 dense, 733* sparse (not 2x)
    "a10g": (24, 125, 250, 64),
    "rtx-4090": (24, 165.2, 330.4, 64),
    "v100": (32, 125, None, 300),
}


def test_table_covers_the_required_chips():
    assert set(DATASHEET) == set(CHIP_TABLE)
    assert known_presets() == list(CHIP_TABLE)


@pytest.mark.parametrize("key", sorted(DATASHEET))
def test_table_matches_datasheet(key):
    mem, dense, sparse, link_bidir = DATASHEET[key]
    chip = CHIP_TABLE[key]
    assert chip.memory_bytes == mem * GiB
    assert chip.peak_flops == pytest.approx(dense * 1e12)
    if sparse is not None:  # the dense figure is half the datasheet's sparse one
        assert chip.peak_flops == pytest.approx(sparse * 1e12 / 2, rel=2e-3)
    assert chip.intra_node_bw == pytest.approx(link_bidir * 1e9 / 2)  # per direction
    assert chip.inter_node_bw > 0 and chip.memory_bw > 0 and chip.peak_flops_fp32 < chip.peak_flops
    assert "http" in chip.source and not chip.fallback
    assert chip.supports_bf16 == (key != "v100")


def test_dgx_network_per_gpu():
    # DGX A100: one 200 Gb/s HDR port per GPU; DGX H100: one 400 Gb/s NDR port per GPU.
    assert CHIP_TABLE["a100-80gb"].inter_node_bw == 200e9 / 8
    assert CHIP_TABLE["h100-sxm"].inter_node_bw == 400e9 / 8
    # DGX-1: four 100 Gb/s EDR ports shared by 8 V100s.
    assert CHIP_TABLE["v100"].inter_node_bw == pytest.approx(4 * 100e9 / 8 / 8)


@pytest.mark.parametrize(
    "alias,key",
    [("h100-80gb", "h100-sxm"), ("H100_SXM", "h100-sxm"), ("h100", "h100-sxm"), ("A100-80GB", "a100-80gb"),
     ("a100", "a100-80gb"), ("4090", "rtx-4090"), ("RTX 4090", "rtx-4090"), ("h100 pcie", "h100-pcie")],
)
def test_aliases(alias, key):
    assert lookup_chip(alias) is CHIP_TABLE[key]
    assert HardwareSpec.preset(alias).name == key


def test_preset_cluster_shape_and_roundtrip():
    hw = HardwareSpec.preset("h100-80gb", gpus_per_node=8, num_nodes=32)
    assert hw.world_size == 256 and hw.memory_bytes == 80 * GiB
    assert hw.flops_for("bf16-mixed") == pytest.approx(989.5e12)
    assert hw.flops_for("32-true") == pytest.approx(67e12)
    assert HardwareSpec.from_dict(hw.to_dict()) == hw
    assert hw.replace(num_nodes=2).world_size == 16
    assert "h100-sxm" in hw.describe() and "32 nodes" in hw.describe()


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ValueError) as err:
        HardwareSpec.preset("h300")
    msg = str(err.value)
    assert "'h300'" in msg and "h200" in msg and "a100-80gb" in msg and "known presets" in msg


@pytest.mark.parametrize(
    "kwargs,exc,word",
    [
        ({"memory_bytes": 0}, ValueError, "memory_bytes"),
        ({"memory_bytes": 1.5}, TypeError, "memory_bytes"),
        ({"gpus_per_node": 0}, ValueError, "gpus_per_node"),
        ({"peak_flops": -1.0}, ValueError, "peak_flops"),
        ({"inter_node_bw": True}, TypeError, "inter_node_bw"),
    ],
)
def test_validation(kwargs, exc, word):
    base = {"name": "x", "memory_bytes": GiB}
    base.update(kwargs)
    name, mem = base.pop("name"), base.pop("memory_bytes")
    with pytest.raises(exc, match=word):
        HardwareSpec(name, mem, **base)


def test_unknown_speeds_resolve_to_marked_fallback():
    hw = HardwareSpec("mystery", 16 * GiB, gpus_per_node=4, num_nodes=2)
    assert hw.resolved("peak_flops") == FALLBACK_CHIP.peak_flops
    assert set(hw.assumed()) == {"peak_flops", "peak_flops_fp32", "intra_node_bw", "inter_node_bw", "memory_bw"}
    assert "inter_node_bw" not in HardwareSpec("one", GiB).assumed()  # never used on one node


@pytest.mark.parametrize(
    "name,key",
    [("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
     ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA H200", "h200"), ("NVIDIA B200", "b200"), ("NVIDIA L4", "l4"),
     ("NVIDIA L40S", "l40s"), ("NVIDIA A10G", "a10g"), ("NVIDIA GeForce RTX 4090", "rtx-4090"),
     ("Tesla V100-SXM2-32GB", "v100"), ("NVIDIA RTX A6000", None)],
)
def test_match_device_name(name, key):
    chip = match_device_name(name)
    assert (chip.key if chip else None) == key


def test_detect_without_cuda_describes_the_host(monkeypatch):
    import os

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    hw = detect_hardware(num_nodes=3)
    assert hw.name.startswith("cpu (") and hw.num_nodes == 3 and hw.gpus_per_node == 1
    assert hw.memory_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert hw.peak_flops is None and "no CUDA" in hw.source


def _fake_cuda(monkeypatch, name, total, count=8):
    import torch

    props = types.SimpleNamespace(name=name, total_memory=total, pci_domain_id=0, pci_bus_id=0x18, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=None: (total // 2, total))


def test_detect_known_gpu_uses_driver_memory_and_table_speeds(monkeypatch):
    monkeypatch.setattr(detect_mod, "_pynvml", lambda: None)
    _fake_cuda(monkeypatch, "NVIDIA H100 80GB HBM3", 85_031_714_816)
    hw = HardwareSpec.detect(num_nodes=2)
    assert hw.memory_bytes == 85_031_714_816  # what the driver reports, not the datasheet's 80 GiB
    assert hw.gpus_per_node == 8 and hw.num_nodes == 2
    assert hw.peak_flops == CHIP_TABLE["h100-sxm"].peak_flops and not hw.fallback
    assert "mem_get_info" in hw.source


def test_detect_unknown_gpu_warns_and_marks_fallback(monkeypatch):
    monkeypatch.setattr(detect_mod, "_pynvml", lambda: None)
    _fake_cuda(monkeypatch, "NVIDIA RTX A6000", 51_527_024_640, count=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hw = HardwareSpec.detect()
    assert any("not in lightning_memplan's hardware table" in str(w.message) for w in caught)
    assert hw.fallback and "(fallback)" in hw.name and hw.memory_bytes == 51_527_024_640
    assert hw.peak_flops == FALLBACK_CHIP.peak_flops


class _FakeNVML(types.ModuleType):
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1

    def __init__(self, links: int, version: int, pcie=(5, 16)):
        super().__init__("pynvml")
        self.links, self.version, self.pcie = links, version, pcie
        self.bus_ids: list[str] = []

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        self.bus_ids.append(bus)
        return "h"

    def nvmlDeviceGetHandleByIndex(self, i):
        return "h"

    def nvmlDeviceGetNvLinkState(self, h, link):
        return 1 if link < self.links else 0

    def nvmlDeviceGetNvLinkVersion(self, h, link):
        return self.version

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self.pcie[0]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self.pcie[1]


def test_nvml_nvlink_bandwidth(monkeypatch):
    fake = _FakeNVML(links=18, version=4)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    link = nvml_interconnect(0, pci_bus_id="00000000:18:00.0")
    # H100 SXM: 18 NVLink 4 links x 25 GB/s per direction = 450 GB/s (= 900 GB/s bidirectional)
    assert link == {"link": "nvlink", "active_links": 18, "version": 4, "bw": 450e9}
    assert fake.bus_ids == ["00000000:18:00.0"]


def test_nvml_pcie_when_no_nvlink(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNVML(links=0, version=0, pcie=(4, 16)))
    link = nvml_interconnect(0)
    assert link["link"] == "pcie" and link["bw"] == pytest.approx(16 * 1.969e9)


def test_detect_uses_nvml_for_intra_node(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNVML(links=12, version=3))
    _fake_cuda(monkeypatch, "NVIDIA A100-SXM4-80GB", 85_198_045_184)
    hw = HardwareSpec.detect()
    assert hw.intra_node_bw == pytest.approx(12 * 25e9)  # A100: 12 links = 300 GB/s per direction
    assert "nvml" in hw.source


def test_nvml_absent_returns_none(monkeypatch):
    monkeypatch.setattr(detect_mod, "_pynvml", lambda: None)
    assert nvml_interconnect(0) is None
