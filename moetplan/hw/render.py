"""Rich tables of a HardwareProfile that show, value by value, what was measured and what is a datasheet number."""
from __future__ import annotations

from typing import Any, Callable

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from moetplan.contract import GPUInfo, HardwareProfile

MIB = 1024**2

# Tag + colour per source, so the distinction survives a terminal without colour.
_TAG = {"measured": ("M", "green"), "datasheet": ("D", "cyan"), "derived": ("~", "yellow"),
        "user": ("U", "magenta"), "default": ("?", "dim")}
LEGEND = "M = measured on this machine   D = datasheet (hwdb)   ~ = derived/estimated"


def _cell(value: Any, source: str | None, fmt: Callable[[Any], str] = str) -> Text:
    if value is None:
        return Text("-", style="dim")
    tag, style = _TAG.get(source or "", ("", ""))
    t = Text(fmt(value), style=style)
    if tag:
        t.append(f" {tag}", style="dim")
    return t


def _gflops(v: float) -> str:
    return f"{v:,.1f} GFLOP/s" if v >= 10 else f"{v:.2f} GFLOP/s"


def _gbps(v: float) -> str:
    return f"{v:,.1f} GB/s" if v >= 10 else f"{v:.2f} GB/s"


def _gib(v: float) -> str:
    return f"{v:,.1f} GiB"


def _pcie(g: GPUInfo) -> tuple[str | None, str | None]:
    now = f"gen{g.pcie_gen} x{g.pcie_width}" if g.pcie_gen else None
    mx = f"gen{g.pcie_gen_max} x{g.pcie_width_max}" if g.pcie_gen_max else None
    return now, mx


def gpu_table(profile: HardwareProfile) -> Table:
    t = Table(title="GPUs", title_justify="left")
    t.add_column("")
    for g in profile.gpus:
        t.add_column(f"GPU {g.index}")
    src = [g.sources for g in profile.gpus]
    rows: list[tuple[str, Callable[[GPUInfo, dict[str, str]], Text]]] = [
        ("name", lambda g, s: Text(g.name)),
        ("hwdb entry", lambda g, s: Text(g.hwdb_id or "unmatched", style="" if g.hwdb_id else "yellow")),
        ("VRAM", lambda g, s: _cell(g.vram_gib, s.get("vram_gib"), _gib)),
        ("free VRAM", lambda g, s: _cell(g.free_gib, s.get("free_gib"), _gib)),
        ("memory bandwidth", lambda g, s: _cell(g.mem_bw_gbps or None, s.get("mem_bw_gbps"), _gbps)),
        ("compute capability", lambda g, s: _cell(g.compute_capability, s.get("compute_capability"))),
        ("FP8 / FP4 tensor cores", lambda g, s: _cell(f"{'yes' if g.fp8 else 'no'} / {'yes' if g.fp4 else 'no'}",
                                                     s.get("fp4"))),
        ("PCIe now", lambda g, s: _cell(_pcie(g)[0], s.get("pcie_gen"))),
        ("PCIe max", lambda g, s: _cell(_pcie(g)[1], s.get("pcie_gen_max"))),
        ("power limit", lambda g, s: _cell(g.power_limit_w, s.get("power_limit_w"), lambda v: f"{v:.0f} W")),
        ("host->device pinned", lambda g, s: _cell(g.h2d_pinned_gbps, s.get("h2d_pinned_gbps"), _gbps)),
        ("host->device pageable", lambda g, s: _cell(g.h2d_pageable_gbps, s.get("h2d_pageable_gbps"), _gbps)),
        ("host->device 64x6 MiB batch", lambda g, s: _cell(g.h2d_batched_gbps, s.get("h2d_batched_gbps"), _gbps)),
        ("device copy (read+write)", lambda g, s: _cell(g.d2d_gbps, s.get("d2d_gbps"), _gbps)),
        ("NVLink peers", lambda g, s: Text(", ".join(map(str, g.nvlink_peers)) or "-")),
    ]
    for label, fn in rows:
        t.add_row(label, *[fn(g, s) for g, s in zip(profile.gpus, src)])
    return t


def host_table(profile: HardwareProfile, details: dict[str, Any] | None = None) -> Table:
    h, s, d = profile.host, profile.host.sources, details or {}
    t = Table(title="Host", title_justify="left")
    t.add_column("")
    t.add_column("value")
    hard = d.get("memlock_hard_bytes", "n/a")
    lim = "unlimited" if h.memlock_bytes is None else f"{h.memlock_bytes / MIB:g} MiB"
    if hard != "n/a":
        lim += f" (hard {'unlimited' if hard is None else f'{hard / MIB:g} MiB'})"
    t.add_row("RAM", _cell(h.ram_gib, s.get("ram_gib"), _gib))
    t.add_row("RAM available", _cell(h.ram_available_gib, s.get("ram_available_gib"), _gib))
    t.add_row("CPU", Text(f"{h.cpu_model or '?'}, {h.cores or '?'} cores, {h.numa_nodes or '?'} NUMA node(s)"))
    hp = f"{h.hugepages_total} x {h.hugepage_size_kib} KiB" if h.hugepages_total is not None else None
    t.add_row("hugepages", _cell(hp, "measured"))
    t.add_row("memlock limit", _cell(lim, s.get("memlock_bytes")))
    pin = None if h.pinned_alloc_ok is None else ("works" if h.pinned_alloc_ok else "FAILS")
    pin_txt = _cell(pin, s.get("pinned_alloc_ok"))
    if d.get("pinned_test"):
        pin_txt.append(f"  ({d['pinned_test']})", style="dim")
    t.add_row("pinned allocation", pin_txt)
    t.add_row("DRAM copy, 1 thread", _cell(h.dram_gbps, s.get("dram_gbps"), _gbps))
    t.add_row("2-bit experts on the CPU (batch 1, all cores)", _cell(h.cpu_expert_gbps, s.get("cpu_expert_gbps"), _gbps))
    t.add_row("CPU kernels' instruction set", _cell(h.cpu_kernel_isa, s.get("cpu_kernel_isa")))
    t.add_row("2-bit experts at prefill, vector loop (1 core)", _cell(h.cpu_expert_prefill_gflops,
                                                                       s.get("cpu_expert_prefill_gflops"), _gflops))
    t.add_row("2-bit experts at prefill, scalar loop (1 core)", _cell(h.cpu_expert_scalar_gflops,
                                                                       s.get("cpu_expert_scalar_gflops"), _gflops))
    gemm = _cell(h.cpu_gemm_gflops, s.get("cpu_gemm_gflops"), _gflops)
    if h.cpu_gemm_dtype:
        gemm.append(f"  ({h.cpu_gemm_dtype})", style="dim")
    t.add_row("dense GEMM at prefill (1 core)", gemm)
    t.add_row("causal attention at prefill (1 core)", _cell(h.cpu_attention_gflops, s.get("cpu_attention_gflops"),
                                                              _gflops))
    return t


def storage_table(profile: HardwareProfile, details: dict[str, Any] | None = None) -> Table:
    st, s, d = profile.storage, profile.storage.sources, details or {}
    t = Table(title="Pack-dir storage", title_justify="left")
    t.add_column("")
    t.add_column("value")
    t.add_row("path", Text(st.path or "-"))
    t.add_row("filesystem", _cell(st.fs_type, s.get("fs_type")))
    t.add_row("free", _cell(st.free_gib, s.get("free_gib"), _gib))
    od = None if st.o_direct is None else ("yes" if st.o_direct else "no (buffered, may be cached)")
    t.add_row("O_DIRECT", _cell(od, s.get("o_direct")))
    seq = _cell(st.seq_read_gbps, s.get("seq_read_gbps"), _gbps)
    if d.get("test_file_mib"):
        seq.append(f"  ({d['test_file_mib']} MiB test file)", style="dim")
    t.add_row("sequential read", seq)
    rnd = _cell(st.rand_read_gbps, s.get("rand_read_gbps"), _gbps)
    if d.get("rand_reads"):
        rnd.append(f"  ({d['rand_reads']} reads of 4-16 MiB, {d.get('rand_queue_depth', '?')} in flight)",
                   style="dim")
    t.add_row("expert-sized random read", rnd)
    return t


def render_profile(profile: HardwareProfile, details: dict[str, Any] | None = None,
                   console: Console | None = None, elapsed_s: float | None = None) -> None:
    console = console or Console()
    parts: list[Any] = []
    head = f"[bold]{profile.description or 'hardware profile'}[/]"
    if elapsed_s is not None:
        head += f"  [dim]({elapsed_s:.1f} s)[/]"
    parts.append(head)
    if profile.gpus:
        parts.append(gpu_table(profile))
        if len(profile.gpus) > 1:
            parts.append(f"GPU peer-to-peer: {'yes' if profile.p2p else 'no'}")
    else:
        parts.append("[yellow]No GPU found.[/]")
    parts += [host_table(profile, details), storage_table(profile, details), f"[dim]{LEGEND}[/]"]
    warns = [*profile.warnings, *profile.storage.warnings]
    if warns:
        parts.append("[bold yellow]Warnings[/]")
        parts += [Text(f"- {w}", style="yellow") for w in warns]
    console.print(Group(*parts))
