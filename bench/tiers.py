#!/usr/bin/env python
"""Tier bench: does the expert store move bytes as fast as the hardware can?

In one run, on expert rows of the model's real size (DeepSeek-V4-Flash: 6.75 MiB per 2-bit row at TP1):
  1. raw pinned host->device GB/s (one big copy of a batch of rows) vs the store's achieved GB/s for a batch of
     misses (ExpertStore over PinnedHostStore, end to end: ensure() + synchronize) -- target >= 90% of raw;
  2. the disk's raw O_DIRECT GB/s for expert-sized random reads vs the arena's miss reads (PackArenaStore.fetch of
     a batch of rows none of which is in the arena) -- target >= 80% of raw.
Without CUDA, part 1 is reported as skipped and part 2 still runs. Writes JSON (with machine info) to --out.

    .venv/bin/python bench/tiers.py                       # defaults: deepseek-v4-flash, batch 64
    .venv/bin/python bench/tiers.py --batch 32 --disk-rows 96 --out bench/results/tiers_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moetplan import hwdb  # noqa: E402
from moetplan.contract.errors import MoetplanError  # noqa: E402
from moetplan.contract import atomic_write_text  # noqa: E402
from moetplan.runtime.store.backing import (  # noqa: E402
    FileRowSource, PackArenaStore, PackPageCacheStore, PinnedHostStore, host_buffer,
)
from moetplan.runtime.format.format import RowLayout  # noqa: E402
from moetplan.runtime.store.store import ExpertStore  # noqa: E402

GB = 1e9


class PatternSource:
    """Rows filled with a per-row byte (cheap to make, easy to check): stands in for a pack in RAM."""

    def __init__(self, num_layers: int, num_experts: int, stride: int):
        self.num_layers, self.num_experts, self.stride = num_layers, num_experts, stride
        self.identity = f"pattern:{num_layers}x{num_experts}x{stride}"

    def row_index(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    def read_rows(self, rows, out, o_direct: bool = False) -> None:
        for i, r in enumerate(rows):
            out[i].fill_(int(r) % 251)


def _machine(bench_dir: Path) -> dict[str, Any]:
    from moetplan.hw.storage import filesystem_type
    from moetplan.contract.machine import machine_info

    info = machine_info()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = p.name
        info["gpu_mem_gib"] = round(p.total_memory / 2**30, 1)
    fs, dev = filesystem_type(bench_dir)
    info["bench_dir"] = str(bench_dir)
    info["bench_fs"] = fs
    info["bench_device"] = dev
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        info["memlock"] = "unlimited" if soft == resource.RLIM_INFINITY else soft
    except Exception:
        pass
    return info


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 3), "best": round(max(xs), 3), "n": len(xs)}


# --------------------------------------------------------------------------- host -> device


def bench_h2d(stride: int, batch: int, repeats: int) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device: host->device part not measured"}
    dev = torch.device("cuda", 0)
    nbytes = batch * stride
    # The reference is torch's own pinned allocation (cudaHostAlloc); the store pins by cudaHostRegister.
    src = torch.empty((batch, stride), dtype=torch.uint8, pin_memory=True)
    src.fill_(7)
    dst = torch.empty((batch, stride), dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)

    def timed(fn) -> float:
        with torch.cuda.stream(stream):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(stream)
            fn()
            e.record(stream)
        e.synchronize()
        return nbytes / (s.elapsed_time(e) / 1e3) / GB

    timed(lambda: dst.copy_(src, non_blocking=True))  # warm-up
    raw = [timed(lambda: dst.copy_(src, non_blocking=True)) for _ in range(repeats)]
    per_row = [timed(lambda: [dst[i].copy_(src[i], non_blocking=True) for i in range(batch)]) for _ in range(repeats)]
    dst = None  # give the device memory back (to the caching allocator) before the store takes its slots

    # The store, end to end: two layers of `batch` experts and a pool of `batch` slots, alternating layers, so
    # every ensure() is a batch of `batch` misses that evicts the other layer's rows.
    source = PatternSource(2, batch, stride)
    backing = PinnedHostStore(source, pin=True)
    store = ExpertStore(backing, batch, device=dev, protected_share=0.0)
    ids = np.arange(batch)
    achieved, wall = [], []
    rounds = repeats + 2
    for r in range(rounds):
        store.begin_step()
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        slots = store.ensure(r % 2, ids[None, :], prefill=False)
        torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t0
        if r >= 2:  # the first rounds warm the allocator, streams and events
            achieved.append(nbytes / dt / GB)
            wall.append(dt)
    assert store.stats()["decode"]["misses"] == rounds * batch, "every bench batch must miss"
    # Spot-check bytes: the slot of expert 5 of the last layer holds that row's pattern.
    want = source.row_index((rounds - 1) % 2, 5) % 251
    got = int(store.data[int(slots.reshape(-1)[5])][:: stride // 8].min().item())
    store.synchronize()
    st = store.stats()
    res = {
        "batch_rows": batch,
        "row_bytes": stride,
        "batch_bytes": nbytes,
        "raw_pinned_one_copy_gbps": _summary(raw),
        "raw_pinned_per_row_copies_gbps": _summary(per_row),
        "store_achieved_gbps": _summary(achieved),
        "store_copy_only_gbps": round(st["h2d_gbps"], 3) if st["h2d_gbps"] else None,
        "store_batch_ms": _summary([1e3 * w for w in wall]),
        "bytes_check_ok": got == want,
    }
    res["ratio_store_vs_raw"] = round(res["store_achieved_gbps"]["median"] / res["raw_pinned_one_copy_gbps"]["median"], 3)
    store.close()
    return res


# --------------------------------------------------------------------------- bookkeeping overhead


def bench_overhead(layers: int, experts: int, top_k: int, steps: int = 200) -> dict[str, Any]:
    """Host time of ensure() per MoE layer at the model's shape (tiny rows, so bytes do not count): the all-hit
    decode path (ids handed over as a device tensor, as the op does) and a path with one miss per call."""
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    stride = 4096
    store = ExpertStore(PinnedHostStore(PatternSource(layers, experts, stride), pin=dev.type == "cuda"),
                        layers * (top_k + 1), device=dev)
    rng = np.random.default_rng(0)
    ids = [torch.from_numpy(rng.choice(experts, top_k, replace=False)[None, :]).to(dev) for _ in range(layers)]
    for layer in range(layers):
        store.ensure(layer, ids[layer])

    def run(n: int, miss: bool) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for s in range(n):
            for layer in range(layers):
                if miss:  # swap one expert for one the cache does not hold
                    e = (int(ids[layer][0, 0]) + 1 + s) % experts
                    store.ensure(layer, torch.tensor([[e]], device=dev))
                else:
                    store.ensure(layer, ids[layer])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return (time.perf_counter() - t0) / (n * layers) * 1e6

    hit_us = run(steps, False)
    miss_us = run(max(10, steps // 4), True)
    store.close()
    return {"device": str(dev), "layers": layers, "top_k": top_k, "ensure_all_hit_us": round(hit_us, 2),
            "ensure_all_hit_ms_per_step": round(hit_us * layers / 1e3, 3), "ensure_one_miss_us": round(miss_us, 2)}


# --------------------------------------------------------------------------- disk


def _write_pack(path: Path, rows: int, stride: int) -> float:
    buf = host_buffer(1, stride, pin=False, what="bench writer")[0].numpy()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        rng = np.random.default_rng(0)
        noise = rng.integers(0, 256, stride, dtype=np.uint8)  # incompressible: no filesystem shortcut
        for r in range(rows):
            np.bitwise_xor(noise, np.uint8(r % 251), out=buf)
            mv, off = memoryview(buf), r * stride
            while len(mv):
                n = os.pwrite(fd, mv, off)
                mv, off = mv[n:], off + n
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return rows * stride / (time.perf_counter() - t0) / GB


def _drop_cache(path: Path) -> None:
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_reads(path: Path, rows: list[int], stride: int, threads: int, direct: bool) -> float:
    """Expert-sized reads of `rows` (dealt round-robin to `threads` readers), one preadv per row."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    fd = os.open(path, flags)
    bufs = [host_buffer(1, stride, pin=False, what="bench reader")[0].numpy() for _ in range(threads)]
    shares = [rows[i::threads] for i in range(threads)]

    def work(k: int) -> None:
        mv = memoryview(bufs[k])
        for r in shares[k]:
            got = 0
            while got < stride:
                n = os.preadv(fd, [mv[got:]], r * stride + got)
                if n <= 0:
                    raise OSError("short read")
                got += n

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    os.close(fd)
    return len(rows) * stride / dt / GB


def bench_disk(bench_dir: Path, stride: int, batch: int, disk_rows: int, readers: int, repeats: int,
               experts: int) -> dict[str, Any]:
    disk_rows = max(disk_rows, 4 * batch)  # four disjoint groups of rows per repeat
    layers, experts = 1, disk_rows  # the file is one "layer" of disk_rows rows: only the row size matters here
    bench_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tiers-", dir=bench_dir))
    path = work / "bench.pack"
    try:
        free = shutil.disk_usage(work).free
        if free < disk_rows * stride * 1.2:
            return {"skipped": f"not enough free space in {work} ({free / GB:.1f} GB) for {disk_rows * stride / GB:.1f} GB"}
        write_gbps = _write_pack(path, disk_rows, stride)
        src = FileRowSource(path, layers, experts, stride)
        direct = src.o_direct_supported
        rng = random.Random(1)
        raw1, rawn, raws, arena_rates, page_rates = [], [], [], [], []
        # Arena misses: an arena of one batch, fed rows it does not hold, so every row is a miss. Raw and arena
        # reads alternate within each repeat so a drifting (virtual) disk weighs on both alike.
        arena = PackArenaStore(src, batch, pin=torch.cuda.is_available(), readers=readers, o_direct=True)
        for rep in range(repeats):
            # Each measurement reads its own rows: re-reading rows another measurement just read would flatter
            # it (a virtual disk can cache below the guest, where dropping the page cache does not reach).
            held = {k[1] for k in arena.resident()}
            fresh = [r for r in range(disk_rows) if r not in held]
            rng.shuffle(fresh)
            arena_rows, rest = fresh[:batch], fresh[batch:] + sorted(held)
            rng.shuffle(rest)
            g1, g2, g3 = rest[:batch], rest[batch: 2 * batch], rest[2 * batch: 3 * batch]
            keys = [(r // experts, r % experts) for r in arena_rows]

            def arena_read(keys=keys) -> float:
                t0 = time.perf_counter()
                f = arena.fetch(keys)
                dt = time.perf_counter() - t0
                assert f.arena_misses == batch, "bench batches must all miss"
                arena.release(None)
                return batch * stride / dt / GB

            jobs = [(raw1, lambda g=g1: _raw_reads(path, g, stride, 1, direct)),
                    (rawn, lambda g=g2: _raw_reads(path, g, stride, readers, direct)),
                    (raws, lambda g=g3: _raw_reads(path, sorted(g), stride, readers, direct)),  # the arena's pattern
                    (arena_rates, arena_read)]
            _drop_cache(path)
            k = rep % len(jobs)  # rotate who goes first: a disk's rate can drift within a repeat
            for out_list, job in jobs[k:] + jobs[:k]:
                out_list.append(job())
        # Byte check: the arena served the right row.
        k = (layers - 1, experts - 1)
        f = arena.fetch([k])
        row = src.row_index(*k)
        expect = np.bitwise_xor(np.random.default_rng(0).integers(0, 256, stride, dtype=np.uint8), np.uint8(row % 251))
        ok = bool(np.array_equal(f.views[0].numpy(), expect))
        arena.release(None)
        arena.close()
        # The page-cache tier, cold (informational: it is what host_arena_gib=0 gets).
        page = PackPageCacheStore(src, pin=torch.cuda.is_available(), staging_rows=batch)
        for _ in range(max(1, repeats // 2)):
            order = list(range(disk_rows))
            rng.shuffle(order)
            _drop_cache(path)
            for i in range(0, disk_rows - batch + 1, batch):
                keys = [(r // experts, r % experts) for r in order[i: i + batch]]
                t0 = time.perf_counter()
                page.fetch(keys)
                page.release(None)
                page_rates.append(batch * stride / (time.perf_counter() - t0) / GB)
        src.close()
        raw_best = max(statistics.median(raw1), statistics.median(rawn), statistics.median(raws))
        return {
            "o_direct": direct,
            "file_rows": disk_rows,
            "file_bytes": disk_rows * stride,
            "readers": readers,
            "write_gbps": round(write_gbps, 3),
            "raw_o_direct_1_thread_gbps": _summary(raw1),
            f"raw_o_direct_{readers}_threads_gbps": _summary(rawn),
            f"raw_o_direct_{readers}_threads_sorted_gbps": _summary(raws),
            "raw_reference_gbps": round(raw_best, 3),  # the best raw pattern: the disk's own rate
            "arena_miss_gbps": _summary(arena_rates),
            "page_cache_store_cold_gbps": _summary(page_rates),
            "ratio_arena_vs_raw": round(statistics.median(arena_rates) / raw_best, 3),
            "bytes_check_ok": ok,
            "note": None if direct else "O_DIRECT unsupported on this filesystem: buffered reads after dropping "
                                        "the page cache (posix_fadvise DONTNEED)",
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek-v4-flash", help="hwdb model whose expert row size is used")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64, help="expert misses per batch")
    ap.add_argument("--disk-rows", type=int, default=0, help="rows in the disk test file (at least 4 x batch)")
    ap.add_argument("--readers", type=int, default=min(8, os.cpu_count() or 1), help="arena reader threads")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dir", default=None, help="where the disk test file goes (default: bench/results/.tiers-tmp "
                                                "on this repository's disk)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/tiers_<host>.json)")
    ap.add_argument("--json", action="store_true", help="print the JSON instead of a table")
    a = ap.parse_args(argv)

    spec = hwdb.model_spec(a.model)
    layout = RowLayout.for_expert(spec.hidden_size, spec.moe_intermediate_size, a.tp, "2bit")
    bench_dir = Path(a.dir) if a.dir else ROOT / "bench" / "results" / ".tiers-tmp"
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"tiers_{socket.gethostname()}.json"
    t0 = time.time()
    try:
        h2d = bench_h2d(layout.stride, a.batch, a.repeats)
        overhead = bench_overhead(spec.moe_layers, spec.n_routed_experts, spec.top_k)
        disk = bench_disk(bench_dir, layout.stride, a.batch, a.disk_rows or 4 * a.batch, a.readers, a.repeats,
                          spec.n_routed_experts)
    except MoetplanError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    finally:
        try:
            bench_dir.rmdir()
        except OSError:
            pass
    h2d_ratio = h2d.get("ratio_store_vs_raw")
    disk_ratio = disk.get("ratio_arena_vs_raw")
    doc = {
        "bench": "tiers",
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - t0, 1),
        "machine": _machine(bench_dir.parent if not bench_dir.exists() else bench_dir),
        "config": {"model": spec.id, "tp": a.tp, "row_bytes": layout.stride, "row_mib": layout.stride / 2**20,
                   "batch": a.batch, "readers": a.readers, "repeats": a.repeats},
        "h2d": h2d,
        "disk": disk,
        "overhead": overhead,
        "targets": {"store_vs_raw_h2d": 0.9, "arena_vs_raw_o_direct": 0.8},
        "met": {"store_vs_raw_h2d": None if h2d_ratio is None else h2d_ratio >= 0.9,
                "arena_vs_raw_o_direct": None if disk_ratio is None else disk_ratio >= 0.8},
    }
    atomic_write_text(out, json.dumps(doc, indent=2) + "\n")
    if a.json:
        print(json.dumps(doc, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"tiers bench: {spec.name}, rows of {layout.stride / 2**20:.2f} MiB, batch {a.batch}")
        t.add_column("measure")
        t.add_column("GB/s (median)", justify="right")
        t.add_column("vs raw", justify="right")
        if "skipped" in h2d:
            t.add_row("host->device", h2d["skipped"], "")
        else:
            t.add_row("raw pinned H2D (one copy)", f"{h2d['raw_pinned_one_copy_gbps']['median']:.2f}", "")
            t.add_row("raw pinned H2D (per-row copies)", f"{h2d['raw_pinned_per_row_copies_gbps']['median']:.2f}", "")
            t.add_row("store ensure() of a miss batch", f"{h2d['store_achieved_gbps']['median']:.2f}",
                      f"{100 * h2d_ratio:.0f}% (target 90%)")
        if "skipped" in disk:
            t.add_row("disk", disk["skipped"], "")
        else:
            t.add_row("raw O_DIRECT, 1 thread", f"{disk['raw_o_direct_1_thread_gbps']['median']:.2f}", "")
            t.add_row(f"raw O_DIRECT, {a.readers} threads",
                      f"{disk[f'raw_o_direct_{a.readers}_threads_gbps']['median']:.2f}", "")
            t.add_row(f"raw O_DIRECT, {a.readers} threads, sorted rows",
                      f"{disk[f'raw_o_direct_{a.readers}_threads_sorted_gbps']['median']:.2f}", "")
            t.add_row("arena miss reads", f"{disk['arena_miss_gbps']['median']:.2f}",
                      f"{100 * disk_ratio:.0f}% (target 80%)")
            t.add_row("page-cache store, cold", f"{disk['page_cache_store_cold_gbps']['median']:.2f}", "")
        t.add_row(f"ensure() host time, all hits ({overhead['device']})", f"{overhead['ensure_all_hit_us']:.1f} us",
                  f"{overhead['ensure_all_hit_ms_per_step']:.2f} ms/step")
        t.add_row("ensure() host time, one miss", f"{overhead['ensure_one_miss_us']:.1f} us", "")
        Console().print(t)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
