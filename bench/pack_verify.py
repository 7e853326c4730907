#!/usr/bin/env python
"""Pack verification cost: checking each row's xxh3 as it is read vs checking the whole pack once at load.

On a pack of --gib GiB (rows of DeepSeek-V4-Flash's 2-bit size, read through hwdb; random bytes: xxh3's cost does
not depend on them), in one run:
  1. xxh3 alone over rows in RAM (GB/s on one core);
  2. the whole pack read at load, in 64 MiB batches: raw, with every row checked at its first read (what a worker
     does), and `Pack.verify_all()` (read + check, separately from the load) -- page cache warm, and O_DIRECT;
  3. NVMe-tier misses: single rows read at random (O_DIRECT where the filesystem allows it), raw vs hashed on
     every read (the "check every read" alternative), per row.
Writes JSON with machine info to --out.

    .venv/bin/python bench/pack_verify.py                      # 2 GiB pack in a temp dir
    .venv/bin/python bench/pack_verify.py --dir /nvme/tmp --out bench/results/pack_verify_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moetplan.contract import atomic_write_text  # noqa: E402
from moetplan.runtime.format.format import RowLayout  # noqa: E402
from moetplan.runtime.format.packs import Pack, PackWriter, aligned_rows, row_checksum  # noqa: E402

GB = 1e9


def machine_info() -> dict:
    from moetplan.contract.machine import machine_info as base

    return base()


def row_layout() -> tuple[RowLayout, str]:
    from moetplan import hwdb

    spec = hwdb.model_spec("deepseek-v4-flash")
    return RowLayout.for_expert(spec.hidden_size, spec.moe_intermediate_size, 1, "2bit"), f"hwdb:{spec.id}"


def write_pack(d: Path, lay: RowLayout, rows: int) -> Path:
    rng = np.random.default_rng(0)
    w = PackWriter(d, "bench", 0, 1, lay, 1, rows, "bench-identity", fsync=False)
    for r in range(rows):
        w.write_row(0, r, rng.integers(0, 256, lay.stride, dtype=np.uint8))
    w.commit()
    w.close()
    os.sync()
    return w.path


def timed(fn) -> tuple[float, float]:
    """(wall, this thread's CPU) seconds of one call."""
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w0, time.thread_time() - c0


def drop_cache(path: Path) -> bool:
    """Evict the file from the page cache (POSIX_FADV_DONTNEED); True when the kernel took the advice."""
    try:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        return True
    except (AttributeError, OSError):
        return False


def whole_pack(path: Path, n: int, stride: int, o_direct: bool, reps: int) -> dict:
    per = max(1, (64 << 20) // stride)
    buf = aligned_rows(per, stride)
    nbytes = n * stride

    def load(verify: bool) -> None:
        with Pack.open(path, verify=verify) as pk:
            for r0 in range(0, n, per):
                rows = list(range(r0, min(n, r0 + per)))
                pk.read_rows(rows, buf[:len(rows)], o_direct=o_direct)
            assert not verify or pk.rows_verified == n

    def verify_all() -> None:
        with Pack.open(path, verify=False) as pk:
            assert pk.verify_all(o_direct=o_direct) == []

    out = {}
    for name, fn in (("read_raw", lambda: load(False)), ("read_checked_at_first_read", lambda: load(True)),
                     ("verify_all", verify_all)):
        best = None
        for _ in range(reps):
            if o_direct:
                drop_cache(path)
            w, c = timed(fn)
            best = (w, c) if best is None or w < best[0] else best
        out[name] = {"wall_s": round(best[0], 4), "cpu_s": round(best[1], 4), "GB_per_s": round(nbytes / best[0] / GB, 3)}
    out["check_overhead_s"] = round(out["read_checked_at_first_read"]["wall_s"] - out["read_raw"]["wall_s"], 4)
    out["check_overhead_share"] = round(out["check_overhead_s"] / out["read_raw"]["wall_s"], 3)
    return out


def random_misses(path: Path, n: int, stride: int, count: int, o_direct: bool) -> dict:
    rng = random.Random(1)
    picks = [rng.randrange(n) for _ in range(count)]
    buf = aligned_rows(1, stride)
    with Pack.open(path, verify=False) as pk:
        def raw() -> None:
            for r in picks:
                pk.read_rows([r], buf, o_direct=o_direct)

        def hashed() -> None:
            cs = pk.sidecar.checksums
            for r in picks:
                pk.read_rows([r], buf, o_direct=o_direct)
                assert row_checksum(buf[0]) == cs[r]

        drop_cache(path)
        w_raw, _ = timed(raw)
        drop_cache(path)
        w_hash, _ = timed(hashed)
    per_raw, per_hash = w_raw / count * 1e6, w_hash / count * 1e6
    return {"rows": count, "o_direct": o_direct, "read_us_per_row": round(per_raw, 1),
            "read_and_hash_us_per_row": round(per_hash, 1), "hash_share_of_a_miss": round(per_hash / per_raw - 1, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="pack size in GiB")
    ap.add_argument("--dir", default=None, help="where to write the pack (default: a temp dir)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each whole-pack pass (best kept)")
    ap.add_argument("--misses", type=int, default=200, help="random single-row reads for the NVMe-miss figures")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pack_verify.json"))
    a = ap.parse_args()
    lay, src = row_layout()
    n = max(1, int(a.gib * 2**30 // lay.stride))
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        path = write_pack(Path(d), lay, n)
        rows = aligned_rows(min(n, 64), lay.stride)
        with Pack.open(path, verify=False) as pk:
            pk.read_rows(list(range(len(rows))), rows)
        _, c = timed(lambda: [row_checksum(rows[i]) for i in range(len(rows)) for _ in range(4)])
        hash_gbs = len(rows) * 4 * lay.stride / c / GB
        with Pack.open(path, verify=False) as pk:
            pk.read_rows([0], aligned_rows(1, lay.stride), o_direct=True)
            direct = bool(pk.o_direct_supported)
        cached = whole_pack(path, n, lay.stride, False, a.reps)
        cold = whole_pack(path, n, lay.stride, True, a.reps) if direct else None
        misses = random_misses(path, n, lay.stride, min(a.misses, n), direct)
    pack_gib = n * lay.stride / 2**30
    doc = {
        "kind": "pack_verify",
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {**machine_info(), "loadavg_before": [round(x, 2) for x in load0],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()], "pack_dir": a.dir or tempfile.gettempdir()},
        "pack": {"gib": round(pack_gib, 3), "rows": n, "row_bytes": lay.stride, "row_source": src,
                 "content": "random bytes (xxh3 cost is content-independent)"},
        "xxh3_GB_per_s_one_core": round(hash_gbs, 2),
        "hash_us_per_row": round(lay.stride / (hash_gbs * GB) * 1e6, 1),
        "whole_pack_page_cache": cached,
        "whole_pack_o_direct": cold,
        "nvme_misses": misses,
        "verify_once_at_load_s": cached["check_overhead_s"],
        "note": ("read_checked_at_first_read is what a worker does at load (each row checked once as it is read); "
                 "verify_all is a separate whole-pack pass; nvme_misses.hash_share_of_a_miss is what checking on "
                 "every NVMe read would add to each miss"),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(a.out, json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
