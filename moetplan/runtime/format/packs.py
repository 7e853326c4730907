"""Pack files: the persistent quantization cache and the NVMe expert tier.

One file per (model, TP rank, format): the row of (MoE layer, expert) at byte offset (layer * E + expert) * stride,
next to a JSON sidecar holding the format/quantizer versions, shapes, TP layout, zero mode, the checkpoint's
identity and one xxh3_64 checksum per row. Crash safety: rows are written, fsynced, and only then marked done in
the sidecar (temp file + rename), so an interrupted run redoes at most the rows it had not committed.
A pack whose sidecar does not match the checkpoint or this quantizer is stale: never read, rebuilt by the writer.
A reader checks every row against its checksum the first time it reads it and never hands out a row that fails:
it raises PackCorruptError naming the pack, the layers and the rows, or has the `repair` hook rewrite them first.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import re
import threading
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moetplan.contract.errors import ConfigError, MoetplanError, UsageError
from moetplan.contract import atomic_write_text
from moetplan.runtime.format.format import FORMAT_VERSION, QUANTIZER_VERSION, ROW_ALIGN, RowLayout

PACK_KIND = "moetplan-pack"
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_MAX_IO_BYTES = 1 << 30  # keep one preadv under Linux's ~2 GiB per-call cap
_BOUNCE_BYTES = 64 << 20


class StalePackError(MoetplanError):
    """A pack that must not be read: built from another checkpoint or quantizer, unfinished, or missing rows."""


class PackCorruptError(MoetplanError):
    """Rows whose bytes do not match the checksum recorded when they were written (`rows`: their indices)."""

    def __init__(self, message: str, path: Path | None = None, rows: Sequence[int] = ()):
        super().__init__(message)
        self.path, self.rows = path, list(rows)


def utc_timestamp() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def row_checksum(buf) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(buf).cast("B"))


def model_key_for(path: str | os.PathLike[str]) -> str:
    """A file-name-safe key from a checkpoint directory name."""
    key = re.sub(r"[^a-z0-9._-]+", "-", Path(path).resolve().name.lower()).strip("-.")
    return key or "model"


def pack_paths(pack_dir: str | os.PathLike[str], model_key: str, tp: int, rank: int, fmt: str) -> tuple[Path, Path]:
    """-> (<pack_dir>/<model_key>.tp<tp>.rank<r>.<fmt>.pack, its .json sidecar)."""
    if not re.fullmatch(r"[A-Za-z0-9._-]+", model_key):
        raise UsageError(f"Model key '{model_key}' may only hold letters, digits, '.', '_' and '-'")
    p = Path(pack_dir) / f"{model_key}.tp{tp}.rank{rank}.{fmt}.pack"
    return p, p.with_name(p.name + ".json")


def checkpoint_identity(ckpt_dir: str | os.PathLike[str]) -> str:
    """Hash of the checkpoint's index and shard names with their sizes (not mtimes: a copy is the same; not
    config.json: editing e.g. max_position_embeddings must not force re-quantizing every expert)."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        raise UsageError(f"Checkpoint directory {d} does not exist; pass the folder holding *.safetensors")
    entries = []
    for p in sorted(d.iterdir()):
        if p.is_file() and (p.suffix == ".safetensors" or p.name.endswith(".safetensors.index.json")):
            entries.append(f"{p.name}\t{p.stat().st_size}")
    if not any(e.split("\t")[0].endswith(".safetensors") for e in entries):
        raise UsageError(f"{d} holds no *.safetensors files; point --model at a safetensors checkpoint folder")
    return "sha256:" + hashlib.sha256("\n".join(entries).encode()).hexdigest()[:32]


class PackSidecar(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    kind: Literal["moetplan-pack"] = PACK_KIND
    format_version: int = FORMAT_VERSION
    quantizer_version: str = QUANTIZER_VERSION
    model_key: str
    tp: int
    tp_rank: int
    fmt: str
    layout: dict[str, Any]
    num_layers: int
    num_experts: int
    zero_mode: str = Field("auto", description="Requested zero mode; the per-tensor outcome is in layer stats")
    identity: str
    source: dict[str, Any] = Field(default_factory=dict)
    checksums: list[str | None] = Field(description="xxh3_64 per row; null = row not written yet")
    layers: dict[str, dict[str, Any]] = Field(default_factory=dict, description="Per-layer stats and timing")
    complete: bool = False
    created_at: str = Field(default_factory=utc_timestamp)
    updated_at: str = Field(default_factory=utc_timestamp)
    runs: int = 0

    # The row geometry lives here, once: writer and reader both answer from their sidecar.
    def row_index(self, layer: int, expert: int) -> int:
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise UsageError(f"(layer {layer}, expert {expert}) outside the pack "
                             f"({self.num_layers} x {self.num_experts})")
        return layer * self.num_experts + expert

    def done(self, row: int) -> bool:
        return self.checksums[row] is not None


def load_sidecar(path: Path) -> PackSidecar:
    try:
        return PackSidecar.model_validate(json.loads(path.read_text()))
    except FileNotFoundError:
        raise StalePackError(f"{path}: no pack sidecar; run `moetplan quantize` to build the pack") from None
    except (json.JSONDecodeError, ValidationError) as e:
        raise StalePackError(
            f"{path}: unreadable pack sidecar ({str(e).splitlines()[0]}); delete it and rerun `moetplan quantize`"
        ) from None


def _mismatches(sc: PackSidecar, expect: dict[str, Any]) -> list[str]:
    out = []
    for key, want in expect.items():
        have = getattr(sc, key)
        if want is not None and have != want:
            out.append(f"{key} is {have!r}, expected {want!r}")
    return out


# --------------------------------------------------------------------------- writer


class PackWriter:
    """Writes one pack file; resumes a matching unfinished pack, rebuilds a stale one.

    Rows are pwritten at their offsets, then `commit()` fsyncs the file and records their checksums in the
    sidecar atomically. `rebuilt_reason` says why an existing pack was discarded; `resumed` whether rows were kept.
    """

    def __init__(self, pack_dir: str | os.PathLike[str], model_key: str, tp_rank: int, tp: int, layout: RowLayout,
                 num_layers: int, num_experts: int, identity: str, zero_mode: str = "auto",
                 source: dict[str, Any] | None = None, fsync: bool = True):
        if layout.tp != tp or not 0 <= tp_rank < tp:
            raise UsageError(f"TP rank {tp_rank} / tp {tp} do not match the row layout (tp={layout.tp})")
        self.layout, self.num_layers, self.num_experts = layout, num_layers, num_experts
        self.path, self.sidecar_path = pack_paths(pack_dir, model_key, tp, tp_rank, layout.fmt)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self.rebuilt_reason: str | None = None
        self.fd = self._lock_fd = -1
        # One writer per pack: a second `moetplan quantize` on the same pack would interleave rows and sidecars.
        self._lock_fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise UsageError(f"Another process is writing {self.path}; wait for it to finish (or stop it) and "
                             "rerun") from None
        try:
            self._open(model_key, tp_rank, tp, zero_mode, identity, source)
        except BaseException:
            self.close()
            raise

    def _open(self, model_key: str, tp_rank: int, tp: int, zero_mode: str, identity: str,
              source: dict[str, Any] | None) -> None:
        layout, num_layers, num_experts = self.layout, self.num_layers, self.num_experts
        expect = dict(kind=PACK_KIND, format_version=FORMAT_VERSION, quantizer_version=QUANTIZER_VERSION,
                      model_key=model_key, tp=tp, tp_rank=tp_rank, fmt=layout.fmt, layout=layout.to_dict(),
                      num_layers=num_layers, num_experts=num_experts, zero_mode=zero_mode, identity=identity)
        sc = None
        if self.sidecar_path.exists():
            try:
                sc = load_sidecar(self.sidecar_path)
                bad = _mismatches(sc, expect)
                if not bad and (not self.path.exists() or self.path.stat().st_size < self.total_bytes):
                    bad = ["pack file missing or truncated"]
            except StalePackError as e:
                bad = [str(e)]
            if bad:
                self.rebuilt_reason = "; ".join(bad)
                sc = None
        elif self.path.exists():
            self.rebuilt_reason = "pack file without sidecar"
        if sc is None:
            for p in (self.sidecar_path, self.path):
                p.unlink(missing_ok=True)
            sc = PackSidecar(**expect, source=source or {}, checksums=[None] * (num_layers * num_experts))
        elif source:
            sc.source = source
        self.resumed = any(c is not None for c in sc.checksums)
        sc.runs += 1
        self.sidecar = sc
        self._pending: dict[int, str] = {}
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if os.fstat(self.fd).st_size < self.total_bytes:
            os.ftruncate(self.fd, self.total_bytes)  # sparse until written
        self._save()

    # -- geometry
    @property
    def num_rows(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def total_bytes(self) -> int:
        return self.num_rows * self.layout.stride

    def row_index(self, layer: int, expert: int) -> int:
        return self.sidecar.row_index(layer, expert)

    @property
    def bytes_to_write(self) -> int:
        """Bytes of the rows not yet written (the file is sparse until then)."""
        return sum(c is None for c in self.sidecar.checksums) * self.layout.stride

    def remove_files(self) -> None:
        """Delete this pack, its sidecar and its lock file (after close())."""
        for p in (self.path, self.sidecar_path, self.path.with_name(self.path.name + ".lock")):
            p.unlink(missing_ok=True)

    # -- state
    def done(self, row: int) -> bool:
        return self.sidecar.done(row)

    def missing_experts(self, layer: int) -> list[int]:
        return [e for e in range(self.num_experts) if not self.done(self.row_index(layer, e))]

    def layer_done(self, layer: int) -> bool:
        return not self.missing_experts(layer)

    # -- writing
    def write_row(self, layer: int, expert: int, row) -> None:
        """pwrite one row (not yet durable or marked done: call commit())."""
        idx = self.row_index(layer, expert)
        buf = np.ascontiguousarray(row.numpy() if hasattr(row, "numpy") else row).view(np.uint8).reshape(-1)
        if buf.size != self.layout.stride:
            raise UsageError(f"Row has {buf.size} bytes, the layout's stride is {self.layout.stride}")
        mv, off = memoryview(buf), idx * self.layout.stride
        while len(mv):
            n = os.pwrite(self.fd, mv, off)
            mv, off = mv[n:], off + n
        self._pending[idx] = row_checksum(buf)

    def commit(self, layer_stats: dict[int, dict[str, Any]] | None = None) -> None:
        """Make pending rows durable, then mark them done (sidecar: temp file + rename)."""
        if self._fsync:
            os.fsync(self.fd)
        for idx, cs in self._pending.items():
            self.sidecar.checksums[idx] = cs
        self._pending.clear()
        for layer, st in (layer_stats or {}).items():
            self.sidecar.layers[str(layer)] = {**self.sidecar.layers.get(str(layer), {}), **st}
        self.sidecar.complete = all(c is not None for c in self.sidecar.checksums)
        self._save()

    def verify_done(self) -> list[int]:
        """Re-read every done row; rows whose checksum fails are unmarked (to be re-quantized) and returned."""
        bad = []
        buf = np.empty(self.layout.stride, dtype=np.uint8)
        for idx, cs in enumerate(self.sidecar.checksums):
            if cs is None:
                continue
            n = os.preadv(self.fd, [memoryview(buf)], idx * self.layout.stride)
            if n != buf.size or row_checksum(buf) != cs:
                bad.append(idx)
                self.sidecar.checksums[idx] = None
        if bad:
            self.sidecar.complete = False
            self._save()
        return bad

    def _save(self) -> None:
        self.sidecar.updated_at = utc_timestamp()
        atomic_write_text(self.sidecar_path, self.sidecar.model_dump_json() + "\n")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def __del__(self) -> None:  # pragma: no cover - best effort when a caller forgets close()
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> "PackWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- reader


def aligned_rows(n: int, stride: int) -> np.ndarray:
    """A page-aligned uint8 [n, stride] buffer (anonymous mmap) that O_DIRECT reads can fill in place."""
    mm = mmap.mmap(-1, max(1, n * stride))
    return np.frombuffer(mm, dtype=np.uint8, count=n * stride).reshape(n, stride)


def find_pack(pack_dir: Path, model_key: str | None, tp: int | None, rank: int, fmt: str) -> Path:
    pat = f"{model_key or '*'}.tp{tp or '*'}.rank{rank}.{fmt}.pack"
    hits = sorted(pack_dir.glob(pat))
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise StalePackError(
            f"No pack matching {pat} in {pack_dir}; run `moetplan quantize --model <checkpoint> --pack-dir {pack_dir}`"
        )
    raise UsageError(f"Several packs match {pat} in {pack_dir} ({', '.join(h.name for h in hits)}); pass model_key/tp")


class Pack:
    """A finished, validated pack file opened for batched reads."""

    def __init__(self, path: Path, sidecar: PackSidecar, verify: bool = True):
        self.path, self.sidecar_path, self.sidecar = path, path.with_name(path.name + ".json"), sidecar
        self.layout = RowLayout.from_dict(sidecar.layout)
        self.stride = self.layout.stride
        self.num_layers, self.num_experts = sidecar.num_layers, sidecar.num_experts
        self.fd = os.open(path, os.O_RDONLY)
        self._dfd: int | None = None
        self.o_direct_supported: bool | None = None
        self._bounce: mmap.mmap | None = None
        self._lock = threading.Lock()  # guards the lazily opened O_DIRECT fd and the shared bounce buffer
        # Each row is checked once, at its first read through this object (docs/FORMAT.md, "Verification").
        self.verify_reads = verify
        self._verified = np.zeros(len(sidecar.checksums), dtype=bool)
        self.rows_verified = 0
        self._repair_lock, self._mark_lock = threading.Lock(), threading.Lock()
        # (pack, rows) -> None: rewrites those rows with good bytes, or raises PackCorruptError saying why not
        self.repair: Callable[["Pack", list[int]], None] | None = None
        self.on_all_verified: Callable[["Pack"], None] | None = None

    @classmethod
    def open(cls, path_or_dir: str | os.PathLike[str], model_key: str | None = None, tp: int | None = None,
             tp_rank: int = 0, fmt: str = "2bit", expect_identity: str | None = None,
             expect_layout: RowLayout | None = None, require_complete: bool = True, verify: bool = True) -> "Pack":
        """Open and validate; raises StalePackError naming what mismatched and how to rebuild.

        `verify`: check each row against its checksum at its first read (off only for raw-read benches)."""
        p = Path(path_or_dir)
        if p.is_dir():
            p = find_pack(p, model_key, tp, tp_rank, fmt)
        elif p.name.endswith(".pack.json"):
            p = p.with_name(p.name[: -len(".json")])
        sc = load_sidecar(p.with_name(p.name + ".json"))
        fix = "; rebuild it with `moetplan quantize` (it replaces stale packs)"
        problems = _mismatches(sc, dict(kind=PACK_KIND, format_version=FORMAT_VERSION,
                                        quantizer_version=QUANTIZER_VERSION, identity=expect_identity,
                                        model_key=model_key, tp=tp))
        if expect_layout is not None and sc.layout != expect_layout.to_dict():
            problems.append(f"row layout {sc.layout} differs from the expected {expect_layout.to_dict()}")
        if problems:
            raise StalePackError(f"Pack {p} is stale: {'; '.join(problems)}{fix}")
        if not p.exists() or p.stat().st_size < sc.num_layers * sc.num_experts * RowLayout.from_dict(sc.layout).stride:
            raise StalePackError(f"Pack {p} is missing or truncated{fix}")
        if require_complete and not sc.complete:
            missing = sum(c is None for c in sc.checksums)
            raise StalePackError(f"Pack {p} is unfinished ({missing} of {len(sc.checksums)} rows missing){fix}")
        return cls(p, sc, verify=verify)

    @property
    def identity(self) -> str:
        return self.sidecar.identity

    def fileno(self) -> int:
        return self.fd

    def row_index(self, layer: int, expert: int) -> int:
        return self.sidecar.row_index(layer, expert)

    def read_rows(self, rows: Sequence[int], out, o_direct: bool = False) -> None:
        """Read rows into out[i] (uint8 [len(rows), stride], numpy or CPU/pinned torch), one preadv per run of
        adjacent rows. With o_direct the page cache is bypassed (falls back to buffered where unsupported); give
        page-aligned buffers (pinned memory, aligned_rows()) or the bytes go through a bounce buffer. A row read
        for the first time is checked against its checksum; one that fails is rewritten by the `repair` hook and
        read again, or PackCorruptError is raised (out then holds no row to use)."""
        buf = self._read_raw(rows, out, o_direct)
        if self.verify_reads and len(rows):
            self._check(rows, buf, o_direct)

    def _read_raw(self, rows: Sequence[int], out, o_direct: bool = False) -> np.ndarray:
        buf = out.numpy() if hasattr(out, "numpy") else out
        if buf.dtype != np.uint8 or buf.ndim != 2 or buf.shape[1] != self.stride or buf.shape[0] < len(rows):
            raise UsageError(f"Output buffer must be uint8 [{len(rows)}, {self.stride}], got {buf.dtype} {buf.shape}")
        if buf.strides[1] != 1:
            raise UsageError("Output buffer rows must be contiguous")
        n_rows = self.num_layers * self.num_experts
        for r in rows:
            if not 0 <= r < n_rows:
                raise UsageError(f"Row {r} outside the pack (0..{n_rows - 1})")
        if not self.sidecar.complete:  # opened with require_complete=False: never hand out unwritten rows
            missing = [r for r in rows if self.sidecar.checksums[r] is None]
            if missing:
                raise StalePackError(f"Pack {self.path}: rows {missing[:8]} are not written yet; finish it with "
                                     "`moetplan quantize`")
        fd = self._direct_fd() if o_direct else self.fd
        use_bounce = fd != self.fd and bool(buf.ctypes.data % ROW_ALIGN or buf.strides[0] % ROW_ALIGN)
        run: list[int] = []  # indices into rows/out whose rows are consecutive in the file
        for i in sorted(range(len(rows)), key=lambda i: rows[i]):
            if run and (rows[i] != rows[run[-1]] + 1 or len(run) >= _IOV_MAX
                        or (len(run) + 1) * self.stride > _MAX_IO_BYTES):
                self._read_run(fd, rows, run, buf, use_bounce)
                run = []
            run.append(i)
        if run:
            self._read_run(fd, rows, run, buf, use_bounce)
        return buf

    # ------------------------------------------------------------------ verification

    def _check(self, rows: Sequence[int], buf: np.ndarray, o_direct: bool) -> None:
        cs, bad = self.sidecar.checksums, []
        for i, r in enumerate(rows):
            if not self._verified[r]:
                if row_checksum(buf[i]) == cs[r]:
                    self._mark(r)
                else:
                    bad.append(i)
        if not bad:
            return
        bad_rows = sorted({int(rows[i]) for i in bad})
        if self.repair is None:
            raise self.corrupt_error(bad_rows)
        with self._repair_lock:  # concurrent readers may meet the same bad row: one repairs it
            todo = [r for r in bad_rows if not self._verified[r]]
            if todo:
                self.repair(self, todo)
        again = np.empty((len(bad), self.stride), dtype=np.uint8)
        self._read_raw([rows[i] for i in bad], again, o_direct)
        still = sorted({int(rows[i]) for j, i in enumerate(bad) if row_checksum(again[j]) != cs[rows[i]]})
        if still:
            raise self.corrupt_error(still, " (still after the repair rewrote them)")
        for j, i in enumerate(bad):
            buf[i] = again[j]
            self._mark(int(rows[i]))

    def _mark(self, r: int) -> None:
        with self._mark_lock:  # reader threads mark rows at once
            if self._verified[r]:
                return
            self._verified[r] = True
            self.rows_verified += 1  # rows checked against their checksums so far (each once)
            done = self.rows_verified == len(self._verified)
        if done and self.on_all_verified is not None:
            self.on_all_verified(self)

    def describe_rows(self, rows: Sequence[int], limit: int = 12) -> str:
        """Rows as "MoE layer 1 (checkpoint layer 3): experts 0, 5; ..." (at most `limit` layers named)."""
        by_layer: dict[int, list[int]] = {}
        for r in sorted({int(r) for r in rows}):
            by_layer.setdefault(r // self.num_experts, []).append(r % self.num_experts)
        parts = []
        for li, ex in list(by_layer.items())[:limit]:
            ck = self.sidecar.layers.get(str(li), {}).get("checkpoint_layer")
            shown = ", ".join(map(str, ex[:16])) + (f", ... ({len(ex)} in all)" if len(ex) > 16 else "")
            parts.append(f"MoE layer {li}{f' (checkpoint layer {ck})' if ck is not None else ''}: "
                         f"expert{'s' if len(ex) > 1 else ''} {shown}")
        return "; ".join(parts) + (f"; ... ({len(by_layer)} layers in all)" if len(by_layer) > limit else "")

    def corrupt_error(self, rows: Sequence[int], why: str = "") -> PackCorruptError:
        """The error for rows that fail their checksum: the pack, the layers and rows, and the fix."""
        model = self.sidecar.source.get("path") or "<checkpoint>"
        return PackCorruptError(
            f"Pack {self.path}: {len(rows)} row(s) fail their xxh3 checksum{why}: {self.describe_rows(rows)}. "
            f"Those rows were not served. Fix: re-run `moetplan quantize --model {model} --pack-dir "
            f"{self.path.parent}` (it re-quantizes just the bad rows), or start `moetplan run` with the checkpoint "
            "present so they are re-quantized at load", self.path, rows)

    def _read_run(self, fd: int, rows: Sequence[int], run: list[int], buf: np.ndarray, bounce: bool) -> None:
        off = rows[run[0]] * self.stride
        total = len(run) * self.stride
        if bounce:  # O_DIRECT into a page-aligned bounce buffer, a few rows at a time, then copy out
            with self._lock:
                self._read_run_bounced(fd, off, run, buf)
            return
        self._pread_full(fd, [memoryview(buf[i]) for i in run], off, total)

    def _read_run_bounced(self, fd: int, off: int, run: list[int], buf: np.ndarray) -> None:
        per = max(1, _BOUNCE_BYTES // self.stride)
        if self._bounce is None:
            self._bounce = mmap.mmap(-1, per * self.stride)  # anonymous mmap: page-aligned
        for j0 in range(0, len(run), per):
            part = run[j0:j0 + per]
            nbytes = len(part) * self.stride
            mv = memoryview(self._bounce)[:nbytes]
            self._pread_full(fd, [mv], off + j0 * self.stride, nbytes)
            tmp = np.frombuffer(self._bounce, dtype=np.uint8, count=nbytes).reshape(len(part), self.stride)
            for j, i in enumerate(part):
                buf[i] = tmp[j]
            del mv, tmp  # release the buffer exports so close() can unmap

    @staticmethod
    def _pread_full(fd: int, bufs: list[memoryview], off: int, total: int) -> None:
        got = os.preadv(fd, bufs, off)
        while got < total:  # short read: continue where it stopped
            if got <= 0:
                raise PackCorruptError(f"Pack read hit end of file at offset {off}; the pack is truncated")
            flat, skip = [], got
            for b in bufs:
                if skip >= len(b):
                    skip -= len(b)
                    continue
                flat.append(b[skip:])
                skip = 0
            bufs, off, total = flat, off + got, total - got
            got = os.preadv(fd, bufs, off)

    def _direct_fd(self) -> int:
        with self._lock:
            return self._open_direct()

    def _open_direct(self) -> int:
        if self._dfd is None and self.o_direct_supported is not False:
            try:
                self._dfd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
                self.o_direct_supported = hasattr(os, "O_DIRECT")
            except OSError:
                self.o_direct_supported = False  # e.g. tmpfs: buffered reads instead
        return self._dfd if self._dfd is not None else self.fd

    def read_row(self, row: int) -> np.ndarray:
        out = np.empty((1, self.stride), dtype=np.uint8)
        self.read_rows([row], out)
        return out[0]

    def verify(self, row: int) -> bool:
        """True when the row's bytes (read again now) match the checksum recorded when it was written."""
        cs = self.sidecar.checksums[row]
        if cs is None:
            return False
        buf = np.empty((1, self.stride), dtype=np.uint8)
        self._read_raw([row], buf)
        ok = row_checksum(buf[0]) == cs
        if ok:
            self._mark(row)
        return ok

    def verify_all(self, batch_bytes: int = 64 << 20, o_direct: bool = False) -> list[int]:
        """Read the whole pack in batches and check every row; returns the rows that fail (none are repaired)."""
        n = len(self.sidecar.checksums)
        per = max(1, batch_bytes // self.stride)
        buf = aligned_rows(min(per, n), self.stride)
        bad = []
        for r0 in range(0, n, per):
            rows = list(range(r0, min(n, r0 + per)))
            self._read_raw(rows, buf, o_direct)
            for i, r in enumerate(rows):
                if self.sidecar.checksums[r] is not None and row_checksum(buf[i]) == self.sidecar.checksums[r]:
                    self._mark(r)
                else:
                    bad.append(r)
        return bad

    def close(self) -> None:
        for fd in (self.fd, self._dfd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.fd, self._dfd = -1, None
        if self._bounce is not None:
            self._bounce.close()
            self._bounce = None

    def __enter__(self) -> "Pack":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def describe_mismatch(path: str | os.PathLike[str], identity: str) -> str | None:
    """None when the pack at `path` matches `identity` and this quantizer, else why not (for status displays)."""
    try:
        Pack.open(path, expect_identity=identity, require_complete=False).close()
        return None
    except (StalePackError, ConfigError) as e:
        return str(e)
