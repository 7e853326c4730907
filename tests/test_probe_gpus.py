"""GPU probing through pynvml, with pynvml faked at the library boundary (module absent, init failing, 2 GPUs)."""
from __future__ import annotations

import sys
import types
from collections import namedtuple

import pytest

from moetplan.hw import gpus as gpus_mod
from moetplan.hw.profile_probe import run_probe

GIB = 1024**3
MemInfo = namedtuple("MemInfo", "total free used")


class FakeNVMLError(Exception):
    pass


class NotSupported(FakeNVMLError):
    pass


def fake_pynvml(devices: list[dict], init_error: Exception | None = None, p2p_ok: bool = True,
                nvlink: bool = False) -> types.ModuleType:
    """A pynvml stand-in: the functions moetplan calls, answering from `devices`."""
    m = types.ModuleType("pynvml")
    m.NVMLError = FakeNVMLError
    m.NVML_CLOCK_MEM = 2
    m.NVML_P2P_CAPS_INDEX_READ = 0
    m.NVML_P2P_CAPS_INDEX_NVLINK = 2
    m.NVML_P2P_STATUS_OK = 0
    m.NVML_P2P_STATUS_NOT_SUPPORTED = 5
    m.calls = []

    def init() -> None:
        if init_error is not None:
            raise init_error
        m.calls.append("init")

    def field(key):
        def get(h, *args):
            v = devices[h].get(key)
            if v is None:
                raise NotSupported("Not Supported")
            return v
        return get

    m.nvmlInit = init
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlSystemGetDriverVersion = lambda: "580.65.06"
    m.nvmlDeviceGetCount = lambda: len(devices)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = field("name")
    m.nvmlDeviceGetUUID = field("uuid")
    m.nvmlDeviceGetMemoryInfo = lambda h: MemInfo(devices[h]["total"], devices[h]["free"],
                                                  devices[h]["total"] - devices[h]["free"])
    m.nvmlDeviceGetCudaComputeCapability = field("cc")
    m.nvmlDeviceGetPowerManagementLimit = field("power_mw")
    m.nvmlDeviceGetCurrPcieLinkGeneration = field("gen")
    m.nvmlDeviceGetCurrPcieLinkWidth = field("width")
    m.nvmlDeviceGetMaxPcieLinkGeneration = field("gen_max")
    m.nvmlDeviceGetMaxPcieLinkWidth = field("width_max")
    m.nvmlDeviceGetMaxClockInfo = field("mem_clock_mhz")
    m.nvmlDeviceGetMemoryBusWidth = field("bus_bits")

    def p2p(a, b, idx):
        if idx == m.NVML_P2P_CAPS_INDEX_NVLINK:
            return m.NVML_P2P_STATUS_OK if nvlink else m.NVML_P2P_STATUS_NOT_SUPPORTED
        return m.NVML_P2P_STATUS_OK if p2p_ok else m.NVML_P2P_STATUS_NOT_SUPPORTED

    m.nvmlDeviceGetP2PStatus = p2p
    return m


def device(name: str, uuid: str, total_gib: float = 32, cc=(12, 0), **kw) -> dict:
    d = dict(name=name, uuid=uuid, total=int(total_gib * GIB), free=int(total_gib * GIB * 0.9), cc=cc,
             power_mw=575_000, gen=5, width=16, gen_max=5, width_max=16, mem_clock_mhz=14001, bus_bits=512)
    d.update(kw)
    return d


def test_pynvml_absent_means_no_gpu_with_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    rep = gpus_mod.query_gpus()
    assert rep.gpus == [] and not rep.driver_available
    assert any("nvidia-ml-py" in w and "pip install" in w for w in rep.warnings)


def test_nvml_init_error_means_no_gpu_and_names_the_driver(monkeypatch):
    fake = fake_pynvml([], init_error=FakeNVMLError("Driver Not Loaded"))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    rep = gpus_mod.query_gpus()
    assert rep.gpus == []
    assert any("Driver Not Loaded" in w and "nvidia-smi" in w for w in rep.warnings)


def test_two_gpus_read_from_driver(monkeypatch):
    fake = fake_pynvml([
        device("NVIDIA GeForce RTX 5090", "GPU-aaaa", gen=1, width=16),  # idle link dropped to gen 1
        device("NVIDIA GeForce RTX 5090", "GPU-bbbb", width=8, width_max=16),  # card in an x8 slot
    ], p2p_ok=False)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    rep = gpus_mod.query_gpus()
    assert [g.index for g in rep.gpus] == [0, 1]
    g0, g1 = rep.gpus
    assert g0.uuid == "GPU-aaaa" and g0.name == "NVIDIA GeForce RTX 5090"
    assert g0.vram_gib == pytest.approx(32.0) and g0.free_gib == pytest.approx(28.8)
    assert (g0.pcie_gen, g0.pcie_gen_max, g1.pcie_width, g1.pcie_width_max) == (1, 5, 8, 16)
    assert g0.power_limit_w == 575.0
    assert g0.sources["vram_gib"] == "measured" and g0.sources["pcie_gen_max"] == "measured"
    assert rep.p2p is False and g0.nvlink_peers == []
    assert any("GPU 0" in w and "gen 1" in w and "idle" in w for w in rep.warnings)
    assert any("GPU 1" in w and "x8 of x16" in w for w in rep.warnings)
    assert fake.calls == ["init", "shutdown"]


def test_two_gpus_matched_to_hwdb_use_datasheet_bandwidth(monkeypatch):
    hwdb = pytest.importorskip("moetplan.hwdb")
    fake = fake_pynvml([device("NVIDIA GeForce RTX 5090", "GPU-aaaa"),
                        device("NVIDIA H200", "GPU-bbbb", total_gib=140, cc=(9, 0))], nvlink=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    rep = gpus_mod.query_gpus()
    for g in rep.gpus:
        gid = hwdb.match_gpu(g.name)
        assert gid is not None, f"hwdb should know {g.name}"
        sheet = hwdb.gpu_info(gid, g.index)
        assert g.hwdb_id == gid
        assert g.mem_bw_gbps == sheet.mem_bw_gbps and g.sources["mem_bw_gbps"] == "datasheet"
        assert g.vram_gib == pytest.approx(140 if "H200" in g.name else 32)  # driver's number wins
        assert g.sources["vram_gib"] == "measured"
    assert rep.gpus[1].compute_capability == "9.0" and rep.gpus[1].fp8 and not rep.gpus[1].fp4
    assert rep.p2p and rep.gpus[0].nvlink_peers == [1] and rep.gpus[1].nvlink_peers == [0]
    assert not any("not in hwdb" in w for w in rep.warnings)


def test_unmatched_gpu_keeps_driver_numbers_and_says_so(monkeypatch):
    fake = fake_pynvml([device("NVIDIA Mystery Accelerator 9000", "GPU-cccc", cc=(10, 3),
                               mem_clock_mhz=2619, bus_bits=5120, power_mw=None)])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    rep = gpus_mod.query_gpus()
    (g,) = rep.gpus
    assert g.hwdb_id is None
    # 2619 MHz x 2 (DDR) x 5120 bit / 8 = 3352 GB/s: the driver's clocks, not a datasheet
    assert g.mem_bw_gbps == pytest.approx(3352.3, abs=0.1)
    assert g.sources["mem_bw_gbps"] == "derived"
    assert g.compute_capability == "10.3" and g.fp8 and g.fp4 and g.sources["fp4"] == "derived"
    assert g.power_limit_w is None and "power_limit_w" not in g.sources  # NotSupported -> absent, not 0
    assert any("Mystery Accelerator 9000" in w and "not in hwdb" in w and "hwdb/gpus.yaml" in w
               for w in rep.warnings)


def test_nvml_failure_mid_listing_keeps_what_was_read(monkeypatch):
    fake = fake_pynvml([device("NVIDIA GeForce RTX 5090", "GPU-aaaa")])

    def boom():
        raise FakeNVMLError("GPU is lost")

    fake.nvmlDeviceGetCount = boom
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    rep = gpus_mod.query_gpus()
    assert rep.gpus == [] and any("GPU is lost" in w for w in rep.warnings)
    assert fake.calls[-1] == "shutdown"


def test_gpus_without_cuda_torch_warn_that_copy_rates_were_not_measured(monkeypatch):
    fake = fake_pynvml([device("NVIDIA GeForce RTX 5090", "GPU-aaaa")])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setitem(sys.modules, "torch", None)  # torch absent
    res = run_probe(quick=True, progress=False, measure_storage=False)
    (g,) = res.profile.gpus
    assert g.sources.get("h2d_pinned_gbps") != "measured"
    assert any("torch is not installed" in w and "not measured" in w for w in res.profile.warnings)
    assert res.profile.source == "probe"
    assert "NVIDIA driver 580.65.06" in res.profile.description


def test_driver_without_gpus_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([]))
    rep = gpus_mod.query_gpus()
    assert rep.driver_available and rep.gpus == []
    assert any("driver is loaded but reports no GPU" in w for w in rep.warnings)
