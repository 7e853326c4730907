"""AMX on vLLM's CPU backend: ask for the tile state where CPUID reports AMX, hide AMX where it cannot run."""
from __future__ import annotations

import types

import pytest

from moetplan.runtime.vllm import cpu_amx


def test_no_amx_reported_asks_nothing():
    asked = []
    st = cpu_amx.decide(False, lambda: asked.append(1) or True)
    assert not st.reported and not st.usable and asked == [] and st.isa == "no-amx"


def test_granted_permission_makes_amx_usable():
    st = cpu_amx.decide(True, lambda: True)
    assert st.reported and st.usable and st.isa == "amx"


@pytest.mark.parametrize("ask", [lambda: False, lambda: (_ for _ in ()).throw(OSError("EINVAL"))])
def test_refused_or_failing_permission_is_not_usable(ask):
    st = cpu_amx.decide(True, ask)
    assert st.reported and not st.usable
    assert "refused" in st.note or "failed" in st.note


def _fake_torch(amx: bool, granted: bool):
    calls = []
    cpu = types.SimpleNamespace(
        get_capabilities=lambda: {"amx_tile": amx},
        _init_amx=lambda: calls.append("init") or granted,
        _is_amx_tile_supported=lambda: amx,
        _is_amx_fp16_supported=lambda: amx,
    )
    return types.SimpleNamespace(cpu=cpu), calls


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(cpu_amx, "_STATE", None)
    monkeypatch.setattr(cpu_amx.platform, "machine", lambda: "x86_64")


def test_prepare_hides_amx_from_vllm_when_the_kernel_refuses(fresh):
    torch, calls = _fake_torch(amx=True, granted=False)
    st = cpu_amx.prepare(torch)
    assert calls == ["init"] and not st.usable
    # vLLM asks torch.cpu._is_amx_tile_supported() when it picks attention / MLA / linear kernels.
    assert torch.cpu._is_amx_tile_supported() is False and torch.cpu._is_amx_fp16_supported() is False
    assert cpu_amx.prepare(torch) is st and calls == ["init"]  # once per process


def test_prepare_keeps_amx_when_permission_is_granted(fresh):
    torch, calls = _fake_torch(amx=True, granted=True)
    st = cpu_amx.prepare(torch)
    assert calls == ["init"] and st.usable and torch.cpu._is_amx_tile_supported() is True


def test_prepare_on_this_machine_is_consistent_with_torch():
    torch = pytest.importorskip("torch")
    st = cpu_amx.prepare()
    if st.reported and not st.usable:
        assert torch.cpu._is_amx_tile_supported() is False
    if not st.reported:
        assert not st.usable
