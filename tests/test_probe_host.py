"""Host probing: RAM/CPU from psutil and /proc, memlock limits, the pinned-allocation test, torch absent."""
from __future__ import annotations

import ctypes
import errno
import resource
import sys

from moetplan.hw import host as host_mod
from moetplan.hw.transfer import cuda_torch

MIB = 1024**2


def test_host_numbers_on_this_machine():
    rep = host_mod.query_host(measure=True)
    h = rep.info
    assert h.ram_gib > 0.5 and 0 < h.ram_available_gib <= h.ram_gib
    assert h.cores and h.cores >= 1
    assert h.pinned_alloc_ok is not None and h.sources["pinned_alloc_ok"] == "measured"
    assert h.dram_gbps and h.dram_gbps > 0 and h.sources["dram_gbps"] == "measured"
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert h.memlock_bytes == (None if soft == resource.RLIM_INFINITY else soft)
    assert rep.pinned_test  # says what was tried


def test_proc_parsers(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nHugePages_Total:      16\nHugepagesize:    1048576 kB\n")
    mi = host_mod._meminfo(str(tmp_path / "meminfo"))
    assert mi["HugePages_Total"] == 16 and mi["Hugepagesize"] == 1048576
    (tmp_path / "cpuinfo").write_text("processor : 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\n")
    assert host_mod.cpu_model(str(tmp_path / "cpuinfo")) == "AMD EPYC 9654 96-Core Processor"
    nodes = tmp_path / "node"
    for n in ("node0", "node1", "possible", "has_cpu"):
        (nodes / n).mkdir(parents=True)
    assert host_mod._numa_nodes(str(nodes)) == 2
    assert host_mod._numa_nodes(str(tmp_path / "absent")) is None


def test_unlimited_memlock_reads_as_none(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda r: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert host_mod.memlock_limits() == (None, None)
    assert host_mod.query_host(measure=False).info.memlock_bytes is None


class _FakeLibc:
    def __init__(self, fail: bool):
        self.fail = fail

    def mlock(self, addr, size):
        if self.fail:
            ctypes.set_errno(errno.ENOMEM)  # what the kernel returns past RLIMIT_MEMLOCK
            return -1
        return 0

    def munlock(self, addr, size):
        return 0


def test_small_memlock_that_is_enforced_warns_and_fails_pinned_test(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # no torch: the mlock path is the test
    monkeypatch.setattr(resource, "getrlimit", lambda r: (8 * MIB, 8 * MIB))
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: _FakeLibc(fail=True))
    rep = host_mod.query_host(measure=False)
    assert rep.info.memlock_bytes == 8 * MIB and rep.memlock_hard_bytes == 8 * MIB
    assert rep.info.pinned_alloc_ok is False
    assert "mlock of 16 MiB failed" in rep.pinned_test
    assert any("memlock limit is 8 MiB" in w and "ulimit -l unlimited" in w for w in rep.warnings)
    assert any("pinned memory test failed" in w for w in rep.warnings)


def test_small_memlock_not_enforced_does_not_warn(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(resource, "getrlimit", lambda r: (8 * MIB, 8 * MIB))
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: _FakeLibc(fail=False))
    rep = host_mod.query_host(measure=False)
    assert rep.info.pinned_alloc_ok is True
    assert "not enforced" in rep.pinned_test
    assert not any("memlock limit" in w for w in rep.warnings)


def test_torch_absent_and_cpu_torch_report_no_cuda(monkeypatch):
    torch, why = cuda_torch()
    try:
        import torch as real_torch
        has_cuda = real_torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        assert torch is None and why and ("no usable CUDA" in why or "not installed" in why)
    monkeypatch.setitem(sys.modules, "torch", None)
    assert cuda_torch() == (None, "torch is not installed")
    assert host_mod._torch_pin_test(MIB) is None
