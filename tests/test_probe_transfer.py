"""Copy-rate arithmetic and GPU pairing, with torch.cuda faked at the library boundary.

The fake torch keeps a simulated GPU timeline: a copy advances it by bytes / link rate, CUDA events read it.
So the test checks that the probe turns timings into GB/s correctly (incl. read+write counting for device
copies), pairs NVML GPUs with torch devices by UUID, and marks the numbers measured. The real thing runs in the
`gpu`-marked test in test_probe_cli.py.
"""
from __future__ import annotations

import contextlib
import sys
import types

import pytest

from moetplan.hw import transfer as tr
from moetplan.hw.profile_probe import run_probe
from test_probe_gpus import device, fake_pynvml  # tests/ is on sys.path (pytest prepend mode)

PINNED_BPS, PAGEABLE_BPS, HBM_BPS = 55e9, 12e9, 4.2e12  # HBM: read+write bytes per second


class Timeline:
    def __init__(self):
        self.t = 0.0


class FakeTensor:
    def __init__(self, torch, nbytes, rows=None, device="cpu", pinned=False):
        self.torch, self.nbytes, self.rows, self.device, self.pinned = torch, nbytes, rows, device, pinned

    def fill_(self, v):
        return self

    def is_pinned(self):
        return self.pinned

    def view(self, rows, cols):
        return FakeTensor(self.torch, self.nbytes, rows, self.device, self.pinned)

    def __getitem__(self, key):
        if isinstance(key, slice):
            n = len(range(*key.indices(self.nbytes)))
        else:  # a row of a 2-D view
            n = self.nbytes // self.rows
        return FakeTensor(self.torch, n, None, self.device, self.pinned)

    def copy_(self, src, non_blocking=False):
        assert src.nbytes == self.nbytes
        if src.device == "cpu" and self.device == "cpu":
            raise AssertionError("host->host copy is not what the probe should time")
        if src.device != "cpu" and self.device != "cpu":
            dt = 2 * self.nbytes / HBM_BPS
        elif src.pinned:
            dt = self.nbytes / PINNED_BPS
        else:
            dt = self.nbytes / PAGEABLE_BPS  # synchronous: the host clock (faked below) sees it
        self.torch.timeline.t += dt
        return self


def fake_torch(uuids: list[str], free_bytes: int = 100 * 1024**3) -> types.ModuleType:
    t = types.ModuleType("torch")
    t.__version__ = "9.9.9+fake"
    t.uint8 = "uint8"
    t.timeline = Timeline()

    class Device:
        def __init__(self, kind, index=None):
            self.type, self.index = kind, index

    def empty(*shape, dtype=None, pin_memory=False, device=None):
        nbytes, rows = (shape[0] * shape[1], shape[0]) if len(shape) == 2 else (shape[0], None)
        dev = "cpu" if device is None else f"cuda:{device.index}"
        return FakeTensor(t, nbytes, rows, dev, pin_memory)

    t.device = Device
    t.empty = empty
    t.ones = empty
    t.empty_like = lambda x: FakeTensor(t, x.nbytes, x.rows, x.device, x.pinned)

    cuda = types.SimpleNamespace()

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self, stream=None):
            self.at = t.timeline.t

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    cuda.is_available = lambda: True
    cuda.device_count = lambda: len(uuids)
    cuda.get_device_properties = lambda i: types.SimpleNamespace(uuid=uuids[i], name="fake")
    cuda.mem_get_info = lambda dev: (free_bytes, 2 * free_bytes)
    cuda.Stream = lambda device=None: object()
    cuda.stream = lambda s: contextlib.nullcontext()
    cuda.device = lambda i: contextlib.nullcontext()
    cuda.Event = Event
    cuda.synchronize = lambda dev=None: None
    cuda.empty_cache = lambda: None

    def spin(cycles):  # the stream is busy before the start event: must not count as copy time
        t.timeline.t += cycles / 1.5e9

    cuda._sleep = spin
    t.cuda = cuda
    return t


@pytest.fixture(autouse=True)
def host_clock_is_the_timeline(monkeypatch):
    """Pageable copies are timed with perf_counter; on the fake, host and GPU share the simulated timeline."""
    clock = {"torch": None}
    real_fake_torch = fake_torch

    def patched(*a, **k):
        t = real_fake_torch(*a, **k)
        clock["torch"] = t
        return t

    monkeypatch.setattr(sys.modules[__name__], "fake_torch", patched)
    monkeypatch.setattr(tr, "time", types.SimpleNamespace(perf_counter=lambda: clock["torch"].timeline.t))


def test_rates_from_a_simulated_timeline():
    torch = fake_torch(["abc"])
    res = tr.measure_device(torch, 0, quick=True)
    assert res.warnings == []
    assert res.h2d_pinned_gbps == pytest.approx(PINNED_BPS / 1e9, rel=1e-3)
    assert res.h2d_batched_gbps == pytest.approx(PINNED_BPS / 1e9, rel=1e-3)
    assert res.d2d_gbps == pytest.approx(HBM_BPS / 1e9, rel=1e-3)  # read + write counted
    assert res.h2d_pageable_gbps == pytest.approx(PAGEABLE_BPS / 1e9, rel=1e-3)
    assert set(res.detail["h2d_pinned_by_size_gbps"]) == {"4MiB", "8MiB", "16MiB"}


def test_full_mode_times_more_sizes():
    res = tr.measure_device(fake_torch(["abc"]), 0, quick=False)
    assert set(res.detail["h2d_pinned_by_size_gbps"]) == {"4MiB", "6MiB", "8MiB", "12MiB", "16MiB"}


def test_too_little_free_gpu_memory_is_a_warning_not_a_crash():
    res = tr.measure_device(fake_torch(["abc"], free_bytes=100 * 1024**2), 0)
    assert res.h2d_pinned_gbps is None
    assert any("free on the GPU" in w and "rerun" in w for w in res.warnings)


def test_probe_pairs_gpus_by_uuid_and_marks_measured(monkeypatch):
    # torch's order differs from NVML's (CUDA orders fastest first): pairing must go by UUID.
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([device("NVIDIA GeForce RTX 5090", "GPU-aaaa"),
                                                            device("NVIDIA GeForce RTX 5090", "GPU-bbbb")]))
    monkeypatch.setitem(sys.modules, "torch", fake_torch(["bbbb", "aaaa"]))
    r = run_probe(quick=True, progress=False, measure_storage=False)
    g0, g1 = r.profile.gpus
    assert r.details["transfers"][0]["torch_index"] == 1 and r.details["transfers"][1]["torch_index"] == 0
    for g in (g0, g1):
        assert g.h2d_pinned_gbps == pytest.approx(55.0, rel=1e-2) and g.sources["h2d_pinned_gbps"] == "measured"
        assert g.d2d_gbps == pytest.approx(4200, rel=1e-2) and g.sources["d2d_gbps"] == "measured"
    assert r.profile.host.pinned_alloc_ok is True and "torch pinned" in r.details["pinned_test"]


def test_gpu_hidden_from_torch_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([device("NVIDIA GeForce RTX 5090", "GPU-aaaa"),
                                                            device("NVIDIA GeForce RTX 5090", "GPU-bbbb")]))
    monkeypatch.setitem(sys.modules, "torch", fake_torch(["aaaa"]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    r = run_probe(quick=True, progress=False, measure_storage=False)
    assert r.profile.gpus[0].sources.get("h2d_pinned_gbps") == "measured"
    assert r.profile.gpus[1].h2d_pinned_gbps is None or r.profile.gpus[1].sources.get("h2d_pinned_gbps") != "measured"
    assert any("GPU 1" in w and "CUDA_VISIBLE_DEVICES" in w for w in r.profile.warnings)


def test_uuid_forms_normalise():
    assert tr.norm_uuid("GPU-ABCD-12") == "abcd-12" == tr.norm_uuid("abcd-12")
