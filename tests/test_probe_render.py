"""The people-facing table marks every value as measured (M), datasheet (D) or derived (~)."""
from __future__ import annotations

from rich.console import Console

from moetplan.hw.render import render_profile
from moetplan.contract import GPUInfo, HardwareProfile, HostInfo, StorageInfo


def _profile() -> HardwareProfile:
    g0 = GPUInfo(index=0, name="NVIDIA H200", hwdb_id="h200-sxm", vram_gib=139.8, free_gib=139.2,
                 mem_bw_gbps=4800, compute_capability="9.0", fp8=True, pcie_gen=5, pcie_width=16, pcie_gen_max=5,
                 pcie_width_max=16, h2d_pinned_gbps=54.7, d2d_gbps=4270, nvlink_peers=[1],
                 sources={"vram_gib": "measured", "mem_bw_gbps": "datasheet", "h2d_pinned_gbps": "measured",
                          "pcie_gen": "measured", "d2d_gbps": "measured"})
    g1 = GPUInfo(index=1, name="Mystery 9000", vram_gib=48, mem_bw_gbps=960.0, compute_capability="8.9",
                 sources={"mem_bw_gbps": "derived"})
    return HardwareProfile(
        source="probe", description="box (Linux), probed quick", gpus=[g0, g1], p2p=True,
        host=HostInfo(ram_gib=2015.5, memlock_bytes=None, pinned_alloc_ok=False, cores=96,
                      sources={"ram_gib": "measured", "pinned_alloc_ok": "measured"}),
        storage=StorageInfo(path="/nvme/packs", fs_type="overlay", o_direct=False, seq_read_gbps=1.6,
                            warnings=["pack dir /nvme/packs is on overlay"], sources={"seq_read_gbps": "measured"}),
        warnings=["GPU 1 'Mystery 9000' is not in hwdb"],
    )


def _text(**kw) -> str:
    con = Console(record=True, width=220, color_system=None)
    render_profile(_profile(), console=con, **kw)
    return con.export_text()


def test_table_marks_sources_and_lists_warnings():
    out = _text(details={"memlock_hard_bytes": None, "pinned_test": "torch pinned allocation of 256 MiB failed"},
                elapsed_s=12.3)
    assert "GPU 0" in out and "GPU 1" in out and "(12.3 s)" in out
    assert "54.7 GB/s M" in out  # measured
    assert "4,800.0 GB/s D" in out  # datasheet
    assert "960.0 GB/s ~" in out  # derived from driver clocks
    assert "gen5 x16 M" in out and "unmatched" in out
    assert "4,270.0 GB/s M" in out
    assert "GPU peer-to-peer: yes" in out
    assert "unlimited (hard unlimited)" in out
    assert "FAILS" in out and "256 MiB failed" in out
    assert "no (buffered, may be cached)" in out
    assert "pack dir /nvme/packs is on overlay" in out and "not in hwdb" in out  # storage + profile warnings


def test_table_for_a_loaded_profile_without_details():
    out = _text()
    assert "memlock limit" in out and "unlimited" in out and "(hard" not in out


def test_table_shows_the_cpu_dense_rates_with_their_dtype():
    p = _profile()
    p.host.cpu_gemm_gflops, p.host.cpu_gemm_dtype, p.host.cpu_attention_gflops = 205.0, "bf16", 44.5
    p.host.sources.update(cpu_gemm_gflops="measured", cpu_attention_gflops="measured")
    con = Console(record=True, width=220, color_system=None)
    render_profile(p, console=con)
    out = con.export_text()
    assert "dense GEMM at prefill (1 core)" in out and "205.0 GFLOP/s M  (bf16)" in out
    assert "causal attention at prefill (1 core)" in out and "44.5 GFLOP/s M" in out
