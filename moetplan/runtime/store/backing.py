"""Backing stores: where an expert row lives when it is not in a GPU slot.

Three tiers behind one interface (`BackingStore`):

- `PinnedHostStore`     every row in (pinned) host RAM; a fetch hands out zero-copy views.
- `PackArenaStore`      the pack file plus a pinned RAM arena of M rows; hits are zero-copy views of the arena,
                        misses are read into arena slots by a reader thread pool (preadv, optional O_DIRECT).
- `PackPageCacheStore`  the pack file with the page cache as the only RAM tier; rows are read into a pinned
                        staging buffer.

`fetch(keys)` returns one host row view per (layer, expert) key; the views stay valid until `release(fence)` is
called with the event (or None) after which the consumer no longer reads them. That is what lets the GPU store
issue the host->device copies asynchronously straight from the views, without a second host copy.

Rows come from a `RowSource` (num_layers, num_experts, stride, row_index, read_rows): `moetplan.runtime.format.packs.Pack`
is one as is; `FileRowSource` (a raw row file) and `ArrayRowSource` (rows in RAM) serve benches and tests.
Host buffers are page aligned (O_DIRECT reads land in them directly) and, with CUDA, page-locked by
cudaHostRegister; a failed pin raises `PinnedMemoryError` naming the memlock limit, the fix and the fallback.
"""
from __future__ import annotations

import mmap
import os
import resource
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
import xxhash

from moetplan.contract.errors import MoetplanError, UsageError

Key = tuple[int, int]  # (MoE layer, expert)
_PAGE = 4096


class PinnedMemoryError(MoetplanError):
    """Pinned (page-locked) host memory could not be allocated: memlock limit or RAM exhausted."""


def _memlock_limit_text() -> str:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return "unlimited"
    return f"{soft / 2**20:.1f} MiB"


def pinned_error(nbytes: int, what: str, cause: BaseException | None = None) -> PinnedMemoryError:
    """The one message for a failed pin: names the limit, the fix and the plan's fallback."""
    why = f" ({type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''})" if cause else ""
    return PinnedMemoryError(
        f"Could not pin {nbytes / 2**30:.2f} GiB of host RAM for the {what}{why}. "
        f"The locked-memory limit (`ulimit -l`) is {_memlock_limit_text()}. "
        "Fix: raise it (`ulimit -l unlimited`, a `memlock` line in /etc/security/limits.conf, or "
        "`docker run --ulimit memlock=-1`) and check free RAM. "
        "Fallback: re-plan with `--set expert_tier=nvme` and a smaller `host_arena_gib` "
        "(or host_arena_gib=0 to read packs through the page cache, PackPageCacheStore)."
    )


def _anon_map(nbytes: int) -> mmap.mmap:
    # Private, not Python's default MAP_SHARED: shared anonymous memory is shmem-backed (no transparent huge
    # pages, counted as Shmem); private memory is plain process memory.
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


# Registered (page-locked) anonymous mappings by base address -> (mapping, bytes); unregistered by `unpin`.
_REGISTERED: dict[int, tuple[mmap.mmap, int]] = {}


def _pin_alloc(nbytes: int) -> torch.Tensor:
    """Exactly `nbytes` of page-locked, page-aligned host memory: an anonymous mapping registered with CUDA.

    Not torch.empty(pin_memory=True): torch's caching host allocator rounds every pinned block up to a power of
    two, so a 73 GiB host store would try to lock 128 GiB. Tests monkeypatch this function.
    """
    mm = _anon_map(nbytes)
    t = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 1))  # 1 = cudaHostRegisterPortable
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister failed with cudaError {rc}")
    _REGISTERED[t.data_ptr()] = (mm, nbytes)
    return t


def unpin(buf: torch.Tensor | None) -> None:
    """Unregister a buffer from `host_buffer(pin=True)` (the memory itself goes when its last view does)."""
    if buf is None or buf.data_ptr() not in _REGISTERED:
        return
    _REGISTERED.pop(buf.data_ptr())
    try:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    except Exception:  # pragma: no cover - best effort at shutdown
        pass


def host_buffer(rows: int, stride: int, *, pin: bool, what: str) -> torch.Tensor:
    """A [rows, stride] uint8 host buffer, 4096-byte aligned (O_DIRECT needs it), pinned when `pin`.

    Raises PinnedMemoryError (with the memlock limit, the fix and the fallback) when pinning fails.
    """
    nbytes = max(rows * stride, _PAGE)
    if pin:
        try:
            buf = _pin_alloc(nbytes)
        except (RuntimeError, OSError, MemoryError) as e:
            raise pinned_error(nbytes, what, e) from e
        if buf.data_ptr() % _PAGE:  # mappings are page aligned; a monkeypatched or future allocator may not be
            raise pinned_error(nbytes, what, RuntimeError("pinned buffer is not page aligned"))
    else:
        # An anonymous mapping is page aligned, unlike torch.empty (64-byte aligned).
        try:
            mm = _anon_map(nbytes)
        except (OSError, ValueError) as e:
            raise MoetplanError(f"Could not allocate {nbytes / 2**30:.2f} GiB of host RAM for the {what}: {e}") from e
        buf = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
    return buf[: rows * stride].view(rows, stride) if rows else buf[:0].view(0, stride)


# --------------------------------------------------------------------------- row sources


@runtime_checkable
class RowSource(Protocol):
    """What a backing store needs from a pack: fixed-stride rows read in batches."""

    num_layers: int
    num_experts: int
    stride: int

    def row_index(self, layer: int, expert: int) -> int: ...

    def read_rows(self, rows: Sequence[int], out: Any, o_direct: bool = False) -> None: ...


class ArrayRowSource:
    """Rows held in a numpy array [layers*experts, stride] (tests, synthetic traces, the pinned store's origin)."""

    def __init__(self, data: np.ndarray, num_layers: int, num_experts: int):
        if data.ndim != 2 or data.dtype != np.uint8 or data.shape[0] != num_layers * num_experts:
            raise UsageError(
                f"ArrayRowSource needs a uint8 array [layers*experts, stride] = [{num_layers * num_experts}, S]; "
                f"got {data.dtype} {tuple(data.shape)}"
            )
        self.data, self.num_layers, self.num_experts, self.stride = data, num_layers, num_experts, data.shape[1]
        self.identity = f"array:{num_layers}x{num_experts}x{self.stride}"

    def row_index(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    def read_rows(self, rows: Sequence[int], out: Any, o_direct: bool = False) -> None:
        np.copyto(_as_numpy(out)[: len(rows)], self.data[np.asarray(rows, dtype=np.int64)])


class FileRowSource:
    """A raw pack-like file: row r at byte `header + r * stride`. Reads with preadv, optionally O_DIRECT.

    Stand-in for (and same read contract as) `moetplan.runtime.format.packs.Pack`; used by the bench and tests.
    """

    def __init__(self, path: str | os.PathLike[str], num_layers: int, num_experts: int, stride: int,
                 header_bytes: int = 0):
        self.path = Path(path)
        if not self.path.is_file():
            raise UsageError(f"pack file {self.path} does not exist; write it first (moetplan pack ...)")
        need = header_bytes + num_layers * num_experts * stride
        size = self.path.stat().st_size
        if size < need:
            raise UsageError(
                f"pack file {self.path} is {size} bytes, expected at least {need} "
                f"({num_layers} layers x {num_experts} experts x {stride} B); it is truncated, re-write it"
            )
        self.num_layers, self.num_experts, self.stride, self.header_bytes = num_layers, num_experts, stride, header_bytes
        self._fd = os.open(self.path, os.O_RDONLY)
        self._fd_direct: int | None = None
        self._direct_ok: bool | None = None
        self._lock = threading.Lock()
        st = self.path.stat()
        # Size plus a hash of the file's two ends: a rebuilt pack of the same size still gets a new identity.
        h = xxhash.xxh3_64()
        with open(self.path, "rb") as f:
            h.update(f.read(1 << 16))
            f.seek(max(0, st.st_size - (1 << 16)))
            h.update(f.read(1 << 16))
        self.identity = f"file:{self.path.name}:{st.st_size}:{h.hexdigest()}:{num_layers}x{num_experts}x{stride}"

    def row_index(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    def _direct_fd(self) -> int | None:
        with self._lock:
            if self._direct_ok is None:
                aligned = self.header_bytes % _PAGE == 0 and self.stride % _PAGE == 0
                try:
                    self._fd_direct = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)) if aligned else None
                except OSError:  # tmpfs and some FUSE filesystems refuse O_DIRECT
                    self._fd_direct = None
                self._direct_ok = self._fd_direct is not None
            return self._fd_direct

    @property
    def o_direct_supported(self) -> bool:
        return self._direct_fd() is not None

    def read_rows(self, rows: Sequence[int], out: Any, o_direct: bool = False) -> None:
        arr = _as_numpy(out)
        fd = self._direct_fd() if o_direct else None
        if fd is not None and arr.ctypes.data % _PAGE:
            fd = None  # unaligned destination: O_DIRECT would fail with EINVAL
        fd = self._fd if fd is None else fd
        # Coalesce consecutive rows into one preadv each (the common case after sorting misses).
        i, n = 0, len(rows)
        while i < n:
            j = i + 1
            while j < n and rows[j] == rows[j - 1] + 1:
                j += 1
            off = self.header_bytes + int(rows[i]) * self.stride
            view = memoryview(arr[i:j].reshape(-1))
            want, got = view.nbytes, 0
            while got < want:
                k = os.preadv(fd, [view[got:]], off + got)
                if k <= 0:
                    raise MoetplanError(f"{self.path}: short read at offset {off + got}; the pack is truncated")
                got += k
            i = j

    def close(self) -> None:
        for fd in (self._fd, self._fd_direct):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fd_direct = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


def as_row_source(obj: Any) -> RowSource:
    """Accept a Pack (moetplan.runtime.format.packs), a FileRowSource/ArrayRowSource, or anything with the RowSource API."""
    missing = [a for a in ("num_layers", "num_experts", "stride", "row_index", "read_rows") if not hasattr(obj, a)]
    if missing:
        raise UsageError(f"{type(obj).__name__} is not a pack/row source (missing {', '.join(missing)})")
    return obj  # type: ignore[return-value]


def source_identity(src: Any) -> str:
    """A string that changes when the pack's content changes (keys the heat file to its pack)."""
    sc = getattr(src, "sidecar", None)
    if sc is not None and getattr(sc, "identity", None):  # a moetplan.runtime.format.packs.Pack
        return (f"{sc.identity}|q{sc.quantizer_version}|f{sc.format_version}|{sc.fmt}|tp{sc.tp}.r{sc.tp_rank}|"
                f"{src.num_layers}x{src.num_experts}x{src.stride}")
    for attr in ("identity", "digest", "header_digest", "fingerprint"):
        v = getattr(src, attr, None)
        if callable(v):
            v = v()
        if v:
            return str(v)
    path = getattr(src, "path", None)
    size = Path(path).stat().st_size if path and Path(path).exists() else 0
    return f"{type(src).__name__}:{size}:{src.num_layers}x{src.num_experts}x{src.stride}"


def _as_numpy(out: Any) -> np.ndarray:
    if isinstance(out, torch.Tensor):
        if out.device.type != "cpu":
            raise UsageError("row reads must target a host (CPU) buffer")
        return out.numpy()
    return out


# --------------------------------------------------------------------------- backing stores


@dataclass
class Fetched:
    """Host views for one batch of keys (in the order asked) and where their bytes came from."""

    views: list[torch.Tensor]
    bytes_ram: int = 0  # served from host RAM (pinned store, arena hits)
    bytes_disk: int = 0  # read from the pack file (arena misses, page-cache store)
    arena_hits: int = 0
    arena_misses: int = 0
    read_s: float = 0.0  # wall time spent reading the file for this batch
    pinned: bool = False  # views are page-locked (async host->device copies are safe and fast)


@dataclass
class BackingStats:
    bytes_ram: int = 0
    bytes_disk: int = 0
    arena_hits: int = 0
    arena_misses: int = 0
    read_s: float = 0.0

    def add(self, f: Fetched) -> None:
        self.bytes_ram += f.bytes_ram
        self.bytes_disk += f.bytes_disk
        self.arena_hits += f.arena_hits
        self.arena_misses += f.arena_misses
        self.read_s += f.read_s


class BackingStore(ABC):
    """One tier below the GPU slots. `tier` uses the Plan's ExpertTier names ("host" or "nvme")."""

    tier: str = "host"
    max_batch_rows: int | None = None  # most rows one fetch can hand out (the arena size); None = any

    def __init__(self, source: Any):
        self.source = as_row_source(source)
        self.num_layers = int(self.source.num_layers)
        self.num_experts = int(self.source.num_experts)
        self.stride = int(self.source.stride)
        self.stats = BackingStats()
        self.identity = source_identity(self.source)

    def _check(self, keys: Sequence[Key]) -> None:
        for layer, expert in keys:
            if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
                raise UsageError(
                    f"expert ({layer}, {expert}) is outside the pack ({self.num_layers} MoE layers x "
                    f"{self.num_experts} experts); the pack does not match this model"
                )

    @abstractmethod
    def fetch(self, keys: Sequence[Key]) -> Fetched:
        """Host views of the rows of `keys`, valid until `release()`."""

    def release(self, fence: Any = None) -> None:
        """The consumer is done with the last fetch once `fence` (a CUDA event, or None = now) completes."""

    def read_into(self, keys: Sequence[Key], out: torch.Tensor) -> None:
        """Copy rows into `out[i]` (a convenience for checks; the store uses fetch)."""
        f = self.fetch(keys)
        for i, v in enumerate(f.views):
            out[i].copy_(v)
        self.release(None)

    def close(self) -> None:
        pass


def _wait(fence: Any) -> None:
    if fence is not None:
        fence.synchronize()


class PinnedHostStore(BackingStore):
    """Every row in host RAM, pinned when CUDA is in use: fetches are zero-copy views."""

    tier = "host"

    def __init__(self, source: Any, *, pin: bool | None = None, progress: bool | None = None,
                 load_batch_rows: int = 64):
        from moetplan.runtime.store.progress import progress_bar

        super().__init__(source)
        self.pinned = torch.cuda.is_available() if pin is None else pin
        n = self.num_layers * self.num_experts
        self.rows = host_buffer(n, self.stride, pin=self.pinned, what="pinned host expert store")
        # O_DIRECT: a whole-pack load through the page cache would hold a second copy of every byte in RAM.
        with progress_bar(n, "loading experts into host RAM", enabled=progress) as advance:
            for start in range(0, n, load_batch_rows):
                idx = [self.source.row_index(r // self.num_experts, r % self.num_experts)
                       for r in range(start, min(n, start + load_batch_rows))]
                self.source.read_rows(idx, self.rows[start: start + len(idx)], o_direct=True)
                advance(len(idx))

    def _row(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    def layer_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(every row in host RAM, slot_of for `layer`): what the CPU kernels compute one layer's experts from."""
        return self.rows, layer * self.num_experts + torch.arange(self.num_experts, dtype=torch.int64)

    def close(self) -> None:
        unpin(self.rows)

    def fetch(self, keys: Sequence[Key]) -> Fetched:
        self._check(keys)
        views = [self.rows[self._row(l, e)] for l, e in keys]
        f = Fetched(views, bytes_ram=len(keys) * self.stride, pinned=self.pinned)
        self.stats.add(f)
        return f


class PackPageCacheStore(BackingStore):
    """The pack file with the page cache as the only RAM tier; rows land in a (pinned) staging buffer."""

    tier = "nvme"

    def __init__(self, source: Any, *, pin: bool | None = None, staging_rows: int = 64):
        super().__init__(source)
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self._staging = host_buffer(staging_rows, self.stride, pin=self.pinned, what="page-cache staging buffer")
        self._fence: Any = None

    def fetch(self, keys: Sequence[Key]) -> Fetched:
        self._check(keys)
        _wait(self._fence)  # the previous batch's copies must have left the staging buffer
        self._fence = None
        n = len(keys)
        if n > self._staging.shape[0]:
            unpin(self._staging)
            self._staging = host_buffer(max(n, 2 * self._staging.shape[0]), self.stride, pin=self.pinned,
                                        what="page-cache staging buffer")
        order = sorted(range(n), key=lambda i: self.source.row_index(*keys[i]))
        rows = [self.source.row_index(*keys[i]) for i in order]
        t0 = time.perf_counter()
        if n:
            self.source.read_rows(rows, self._staging[:n], o_direct=False)
        dt = time.perf_counter() - t0
        views: list[torch.Tensor] = [None] * n  # type: ignore[list-item]
        for pos, i in enumerate(order):
            views[i] = self._staging[pos]
        f = Fetched(views, bytes_disk=n * self.stride, read_s=dt, pinned=self.pinned)
        self.stats.add(f)
        return f

    def release(self, fence: Any = None) -> None:
        self._fence = fence

    def close(self) -> None:
        _wait(self._fence)
        unpin(self._staging)


class PackArenaStore(BackingStore):
    """Pack file + a RAM arena of M rows (pinned with CUDA). Arena eviction: decayed frequency (LFU with decay).

    Misses are read by `readers` threads, each issuing preadv calls (O_DIRECT when asked and possible) straight
    into arena slots, so a miss costs one disk read and no extra host copy.
    """

    tier = "nvme"

    def __init__(self, source: Any, arena_rows: int, *, pin: bool | None = None, readers: int = 4,
                 o_direct: bool = True, decay: float = 0.98):
        super().__init__(source)
        if arena_rows < 1:
            raise UsageError("PackArenaStore needs arena_rows >= 1; use PackPageCacheStore for no arena")
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self.arena_rows = int(arena_rows)
        self.max_batch_rows = self.arena_rows
        self.arena = host_buffer(self.arena_rows, self.stride, pin=self.pinned, what="pinned RAM arena")
        self.o_direct = o_direct
        self.readers = max(1, int(readers))
        self._pool = ThreadPoolExecutor(max_workers=self.readers, thread_name_prefix="moetplan-reader")
        self._slot_of: dict[Key, int] = {}
        self._key_of: list[Key | None] = [None] * self.arena_rows
        self._score = np.zeros(self.arena_rows, dtype=np.float64)  # decayed frequency of the slot's row
        self._inc, self._decay = 1.0, float(decay)
        self._free = list(range(self.arena_rows - 1, -1, -1))
        self._occ = np.zeros(self.arena_rows, dtype=bool)  # slot holds a row
        self._busy = np.zeros(self.arena_rows, dtype=bool)  # slot handed out by the current fetch: not evictable
        self._fence: Any = None
        if o_direct:  # open the O_DIRECT descriptor now, not racily from several reader threads
            self.source.read_rows([], self.arena[:1], o_direct=True)

    def _bump(self, slot: int) -> None:
        self._score[slot] += self._inc

    def _tick(self) -> None:
        self._inc /= self._decay
        if self._inc > 1e100:  # renormalise: decay is relative, so scaling everything keeps the order
            self._score /= self._inc
            self._inc = 1.0

    def _victims(self, n: int) -> list[int]:
        out: list[int] = []
        while self._free and len(out) < n:
            out.append(self._free.pop())
        if len(out) < n:
            cand = np.flatnonzero(self._occ & ~self._busy)
            if len(cand) < n - len(out):
                self._free.extend(reversed(out))
                raise MoetplanError(
                    f"the RAM arena ({self.arena_rows} rows) is smaller than one batch of misses "
                    f"({n + int(self._busy.sum())} rows); raise host_arena_gib in the plan"
                )
            k = n - len(out)
            pick = cand[np.argpartition(self._score[cand], k - 1)[:k]] if k < len(cand) else cand
            for s in pick.tolist():
                del self._slot_of[self._key_of[s]]  # type: ignore[arg-type]
                self._key_of[s] = None
                self._occ[s] = False
                self._score[s] = 0.0
                out.append(s)
        return out

    def fetch(self, keys: Sequence[Key]) -> Fetched:
        self._check(keys)
        _wait(self._fence)  # arena slots about to be overwritten may still feed the last batch's copies
        self._fence = None
        self._busy[:] = False
        self._tick()
        uniq = list(dict.fromkeys(keys))
        hits = [k for k in uniq if k in self._slot_of]
        for k in hits:
            self._busy[self._slot_of[k]] = True
        miss = [k for k in uniq if k not in self._slot_of]
        dt = 0.0
        if miss:
            slots = self._victims(len(miss))
            for k, s in zip(miss, slots):
                self._slot_of[k], self._key_of[s] = s, k
                self._occ[s] = self._busy[s] = True
            t0 = time.perf_counter()
            self._read(miss, slots)
            dt = time.perf_counter() - t0
        for k in uniq:
            self._bump(self._slot_of[k])
        views = [self.arena[self._slot_of[k]] for k in keys]
        f = Fetched(views, bytes_ram=len(hits) * self.stride, bytes_disk=len(miss) * self.stride,
                    arena_hits=len(hits), arena_misses=len(miss), read_s=dt, pinned=self.pinned)
        self.stats.add(f)
        return f

    def _read(self, keys: list[Key], slots: list[int]) -> None:
        jobs = sorted(zip((self.source.row_index(*k) for k in keys), slots))
        # Deal the sorted rows round-robin: the readers then work on neighbouring rows at once (one row per preadv).
        shares = [jobs[i:: self.readers] for i in range(self.readers)] if len(jobs) >= self.readers else [[j] for j in jobs]

        def work(share: list[tuple[int, int]]) -> None:
            for row, slot in share:
                self.source.read_rows([row], self.arena[slot: slot + 1], o_direct=self.o_direct)

        try:
            for fut in [self._pool.submit(work, s) for s in shares if s]:
                fut.result()
        except BaseException:
            for k in keys:  # a failed read must not leave a key mapped to garbage
                s = self._slot_of.pop(k, None)
                if s is not None:
                    self._key_of[s] = None
                    self._occ[s] = self._busy[s] = False
                    self._score[s] = 0.0
                    self._free.append(s)
            raise

    def release(self, fence: Any = None) -> None:
        self._fence = fence
        self._busy[:] = False

    def resident(self) -> set[Key]:
        return set(self._slot_of)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        _wait(self._fence)
        unpin(self.arena)


def make_backing(kind: str, source: Any, *, arena_rows: int = 0, pin: bool | None = None, readers: int = 4,
                 o_direct: bool = True) -> BackingStore:
    """Backing store for a Plan's expert_tier: "host" -> pinned store; "nvme" -> arena (or page cache if 0 rows)."""
    if kind == "host":
        return PinnedHostStore(source, pin=pin)
    if kind == "nvme":
        if arena_rows > 0:
            return PackArenaStore(source, arena_rows, pin=pin, readers=readers, o_direct=o_direct)
        return PackPageCacheStore(source, pin=pin)
    raise UsageError(f"unknown backing tier '{kind}'; use 'host' (pinned RAM) or 'nvme' (pack file)")


__all__ = [
    "ArrayRowSource", "BackingStats", "BackingStore", "Fetched", "FileRowSource", "Key", "PackArenaStore",
    "PackPageCacheStore", "PinnedHostStore", "PinnedMemoryError", "RowSource", "as_row_source", "host_buffer",
    "make_backing", "pinned_error", "row_checksum_ok", "source_identity", "unpin",
]


def row_checksum_ok(pack: Any, row: int, data: Any) -> bool:
    """True when `data` (a row as served by any tier) matches the checksum the pack recorded for `row`."""
    from moetplan.runtime.format.packs import row_checksum

    want = pack.sidecar.checksums[row]
    arr = data.cpu().numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
    return want is not None and row_checksum(np.ascontiguousarray(arr)) == want
