"""The pack directory: what filesystem it is on, how much room it has, and how fast it really reads.

Rates are measured on a temporary file with O_DIRECT so the page cache cannot flatter them: sequential
16 MiB reads (a pack file scan at boot) and expert-sized 4-16 MiB reads at random 4 KiB-aligned offsets (cache
misses at decode). Where O_DIRECT is refused (tmpfs, some overlay/fuse mounts) we fall back to buffered reads
after posix_fadvise(DONTNEED) and say the number may be cached. The temporary file is removed on every exit path,
Ctrl-C and SIGTERM included.
"""
from __future__ import annotations

import contextlib
import errno
import mmap
import os
import random
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from moetplan.contract.errors import UsageError
from moetplan.contract import StorageInfo

MIB = 1024**2
GIB = 1024**3

CHUNK = 16 * MIB  # write/sequential-read unit; the file is always a whole number of chunks
ALIGN = 4096  # O_DIRECT offset/length alignment that every common block device accepts
RAND_MIN, RAND_MAX = 4 * MIB, 16 * MIB  # routed experts are ~6.75-11.8 MiB at 2 bits (FACTS.md)
# Misses of one layer are fetched together, so a few reads are in flight at once (not one at a time).
RAND_QUEUE_DEPTH = 4
MIN_TEST_BYTES = 64 * MIB  # below this a rate is mostly setup noise
DIRECT_FULL_BYTES = 8 * GIB  # with O_DIRECT only drive/hypervisor caches remain to defeat
BUFFERED_FULL_MAX = 64 * GIB  # without O_DIRECT we want > RAM, but not a terabyte file on a big-memory box

NETWORK_FS = ("nfs", "nfs4", "cifs", "smb", "smb3", "smbfs", "9p", "ceph", "glusterfs", "lustre", "virtiofs",
              "afs", "sshfs", "beegfs", "gpfs")
RAM_FS = ("tmpfs", "ramfs")
OVERLAY_FS = ("overlay", "overlayfs", "aufs")


@dataclass(frozen=True)
class StorageBudget:
    """How much the storage probe may write and how long each phase may run."""

    file_bytes: int
    write_s: float
    seq_s: float
    rand_s: float
    seq_passes_max: int = 3
    rand_reads_max: int = 400


QUICK = StorageBudget(file_bytes=512 * MIB, write_s=6.0, seq_s=2.5, rand_s=2.5, rand_reads_max=300)
FULL = StorageBudget(file_bytes=DIRECT_FULL_BYTES, write_s=240.0, seq_s=30.0, rand_s=20.0, seq_passes_max=1,
                     rand_reads_max=3000)


@dataclass
class StorageReport:
    info: StorageInfo
    test_file_bytes: int = 0
    seq_bytes_read: int = 0
    rand_reads: int = 0
    rand_queue_depth: int = RAND_QUEUE_DEPTH


def default_pack_dir() -> Path:
    from moetplan.contract import default_pack_dir as _default

    return _default()


def filesystem_type(path: str | os.PathLike[str]) -> tuple[str | None, str | None]:
    """(fs type, mount point) of the mount holding `path` (longest mount-point prefix wins)."""
    import psutil

    real = os.path.realpath(path)
    best: tuple[str | None, str | None] = (None, None)
    best_len = -1
    try:
        parts = psutil.disk_partitions(all=True)
    except OSError:
        return best
    for p in parts:
        mp = p.mountpoint.rstrip("/") or "/"
        if (real == mp or real.startswith(mp + "/") or mp == "/") and len(mp) > best_len:
            best, best_len = (p.fstype, p.mountpoint), len(mp)
    return best


def filesystem_warnings(fs_type: str | None, path: str) -> list[str]:
    if not fs_type:
        return [f"could not tell the filesystem of {path}; check it is a local NVMe/SSD mount"]
    base = fs_type.split(".")[0].lower()
    if base in OVERLAY_FS:
        return [f"pack dir {path} is on {fs_type} (a container layer): pack reads pay the overlay and may not "
                "support O_DIRECT; mount a host directory or volume and pass it as --pack-dir"]
    if base in RAM_FS:
        return [f"pack dir {path} is on {fs_type} (RAM): packs there eat the RAM the host tier needs and vanish on "
                "reboot; use a directory on an NVMe drive"]
    if base == "zfs":
        return [f"pack dir {path} is on ZFS: before OpenZFS 2.3 O_DIRECT is accepted but reads still come from the "
                "ARC cache, so measured rates can be RAM speed; trust the full probe's larger file, and note the ARC "
                "competes with the host expert tier for RAM"]
    if base in NETWORK_FS or base == "fuse" or fs_type.lower().startswith("fuse"):
        return [f"pack dir {path} is on {fs_type} (network/FUSE filesystem): expert misses would travel over it; "
                "use a local NVMe directory for --pack-dir"]
    return []


def _prepare_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except PermissionError:
        raise UsageError(f"cannot create pack dir {path} (permission denied): pass a --pack-dir you can write, "
                         "or create it and fix its owner") from None
    except FileExistsError:
        raise UsageError(f"pack dir {path} exists but is not a directory: pass a directory as --pack-dir") from None
    except OSError as e:
        raise UsageError(f"cannot create pack dir {path} ({e.strerror}): pass another --pack-dir") from None
    if not path.is_dir():
        raise UsageError(f"pack dir {path} is not a directory: pass a directory as --pack-dir")


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C so the finally-blocks remove the temporary file."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


class _Progress:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, enabled: bool):
        self._p = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._p = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[rate]}"),
                               TimeRemainingColumn(), console=Console(stderr=True), transient=True)

    def __enter__(self) -> "_Progress":
        if self._p:
            self._p.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._p:
            self._p.stop()

    def task(self, desc: str, total: float) -> int | None:
        return self._p.add_task(desc, total=total, rate="") if self._p else None

    def update(self, task: int | None, completed: float, rate: float | None = None) -> None:
        if self._p is not None and task is not None:
            self._p.update(task, completed=completed, rate=f"{rate:.2f} GB/s" if rate else "")


def _remove_stale_test_files(path: Path) -> list[str]:
    """Test files of probes that were killed outright (SIGKILL, power loss) and could not clean up."""
    import psutil

    removed = []
    for f in path.glob(".moetplan-probe-*.tmp"):
        try:
            pid = int(f.name.split("-")[2])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not psutil.pid_exists(pid):
            with contextlib.suppress(OSError):
                f.unlink()
                removed.append(f.name)
    return removed


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes)  # anonymous mappings are page-aligned, as O_DIRECT requires


def _drop_cache(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _write_test_file(path: Path, budget: StorageBudget, target: int, prog: _Progress,
                     warnings: list[str]) -> int:
    """Write up to `target` bytes of incompressible data; returns the bytes kept (whole chunks)."""
    rng = random.Random(0x6D6F6574)
    block = bytearray(rng.randbytes(CHUNK))
    written = 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except PermissionError:
        raise UsageError(f"cannot write in pack dir {path.parent} (permission denied): pass a --pack-dir you can "
                         "write, or fix its permissions") from None
    try:
        task = prog.task("writing test file", target)
        t0 = time.perf_counter()
        while written < target:
            block[:8] = written.to_bytes(8, "little")  # distinct chunks, so dedup/compression cannot cheat
            try:
                n = os.write(fd, block)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    warnings.append(f"disk full in {path.parent} after writing {written // MIB} MiB of the "
                                    f"{target // MIB} MiB test file (ENOSPC); free space or pick another --pack-dir")
                    break
                raise
            if n < CHUNK:  # a short write means the device just filled up
                warnings.append(f"disk full in {path.parent} after {(written + n) // MIB} MiB of the test file")
                break
            written += n
            prog.update(task, written, written / max(time.perf_counter() - t0, 1e-9) / 1e9)
            if time.perf_counter() - t0 > budget.write_s:
                warnings.append(f"test file stopped at {written // MIB} MiB (of {target // MIB} MiB) at the "
                                f"{budget.write_s:.0f} s write time limit; rates are measured on that file")
                break
        written -= written % CHUNK
        with contextlib.suppress(OSError):
            os.ftruncate(fd, written)
        with contextlib.suppress(OSError):
            os.fsync(fd)
        _drop_cache(fd)
    finally:
        os.close(fd)
    return written


def _open_for_reads(path: Path) -> tuple[int, bool, str | None]:
    """(fd, o_direct, reason O_DIRECT is unavailable)."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if o_direct:
        try:
            fd = os.open(path, os.O_RDONLY | o_direct)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            reason = f"the filesystem refuses O_DIRECT ({e.strerror})"
        else:
            probe = _aligned_buffer(ALIGN)
            try:
                os.preadv(fd, [probe], 0)
                return fd, True, None
            except OSError as e:
                os.close(fd)
                if e.errno != errno.EINVAL:
                    raise
                reason = f"O_DIRECT reads fail here ({e.strerror})"
            finally:
                probe.close()
    else:
        reason = "this OS has no O_DIRECT"
    fd = os.open(path, os.O_RDONLY)
    _drop_cache(fd)
    return fd, False, reason


def _sequential(fd: int, size: int, budget: StorageBudget, direct: bool, prog: _Progress) -> tuple[float, int]:
    buf = _aligned_buffer(CHUNK)
    task = prog.task("sequential reads", budget.seq_s)
    total = 0
    t0 = time.perf_counter()
    try:
        for _ in range(budget.seq_passes_max):
            if not direct:
                _drop_cache(fd)
            for off in range(0, size, CHUNK):
                n = os.preadv(fd, [buf], off)
                if n <= 0:
                    break
                total += n
                el = time.perf_counter() - t0
                prog.update(task, min(el, budget.seq_s), total / el / 1e9)
                if el > budget.seq_s:
                    break
            if time.perf_counter() - t0 > budget.seq_s:
                break
    finally:
        buf.close()
    prog.update(task, budget.seq_s)
    return total / (time.perf_counter() - t0) / 1e9, total


def _random(fd: int, size: int, budget: StorageBudget, direct: bool, prog: _Progress) -> tuple[float, int]:
    if not direct:
        _drop_cache(fd)
    rng = random.Random(0x5EED)
    max_len = min(RAND_MAX, size)
    jobs = []
    for _ in range(budget.rand_reads_max):
        length = rng.randrange(min(RAND_MIN, max_len), max_len + 1, ALIGN)
        length -= length % ALIGN
        offset = rng.randrange(0, size - length + 1, ALIGN)
        jobs.append((offset, length))
    local = threading.local()
    buffers: list[mmap.mmap] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + budget.rand_s
    stop = threading.Event()

    def read(job: tuple[int, int]) -> int:
        if stop.is_set() or time.perf_counter() > deadline:
            stop.set()
            return 0
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = _aligned_buffer(RAND_MAX)
            with lock:
                buffers.append(buf)
        off, length = job
        return os.preadv(fd, [memoryview(buf)[:length]], off)

    task = prog.task(f"expert-sized random reads (QD{RAND_QUEUE_DEPTH})", budget.rand_s)
    total = reads = 0
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=RAND_QUEUE_DEPTH) as pool:
            for n in pool.map(read, jobs):
                if n:
                    total += n
                    reads += 1
                    el = time.perf_counter() - t0
                    prog.update(task, min(el, budget.rand_s), total / el / 1e9)
        elapsed = time.perf_counter() - t0
    finally:
        for b in buffers:
            b.close()
    prog.update(task, budget.rand_s)
    return (total / elapsed / 1e9 if reads else 0.0), reads


def _target_size(budget: StorageBudget, quick: bool, direct_expected: bool, free: int,
                 ram_bytes: int, warnings: list[str]) -> int:
    if quick:
        want = min(budget.file_bytes, GIB)
    elif direct_expected:
        want = budget.file_bytes
    else:
        # Buffered: the file should outgrow the page cache (DONTNEED usually suffices, this is the backstop).
        want = max(budget.file_bytes, min(int(ram_bytes * 1.25), BUFFERED_FULL_MAX))
    # Leave the disk usable: keep 10% of the free space (at least 1 GiB) untouched.
    room = free - max(GIB, free // 10)
    size = min(want, max(room, 0))
    size -= size % CHUNK
    if size < want and not quick:
        warnings.append(f"test file limited to {size / GIB:.1f} GiB by free disk (wanted {want / GIB:.1f} GiB): "
                        "read rates may be partly served from cache")
    return size


def probe_storage(pack_dir: str | os.PathLike[str] | None = None, quick: bool = True, progress: bool = True,
                  budget: StorageBudget | None = None, ram_bytes: int | None = None) -> StorageReport:
    """Filesystem, free space and measured read rates of the pack directory."""
    path = Path(pack_dir).expanduser() if pack_dir else default_pack_dir()
    path = path.absolute()
    budget = budget or (QUICK if quick else FULL)
    if quick and budget.file_bytes > GIB:
        raise ValueError("quick storage probes write at most 1 GiB")
    _prepare_dir(path)
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        raise UsageError(f"pack dir {path} is not readable and writable by this user: pass another --pack-dir "
                         "or fix its permissions")

    stale = _remove_stale_test_files(path)
    fs_type, _mount = filesystem_type(path)
    warnings = filesystem_warnings(fs_type, str(path))
    if stale:
        warnings.append(f"removed {len(stale)} test file(s) left in {path} by an earlier probe that was killed")
    free = shutil.disk_usage(path).free
    info = StorageInfo(path=str(path), fs_type=fs_type, free_gib=round(free / GIB, 2), warnings=warnings,
                       sources={"fs_type": "measured", "free_gib": "measured"})
    warnings = info.warnings  # pydantic copied the list; keep appending to the one the report holds
    report = StorageReport(info=info)

    if ram_bytes is None:
        import psutil

        ram_bytes = psutil.virtual_memory().total
    # ZFS may honour O_DIRECT only on paper (ARC), so size its file like a buffered one.
    direct_expected = bool(getattr(os, "O_DIRECT", 0)) and (fs_type or "").split(".")[0] not in (*RAM_FS, "zfs")
    target = _target_size(budget, quick, direct_expected, free, ram_bytes, warnings)
    if target < MIN_TEST_BYTES:
        warnings.append(f"only {free / MIB:.0f} MiB free in {path}: too little for a read test, disk rates not "
                        "measured; free space or pick another --pack-dir")
        return report

    tmp = path / f".moetplan-probe-{os.getpid()}-{os.urandom(4).hex()}.tmp"
    fd = -1
    try:
        with _sigterm_as_interrupt(), _Progress(progress) as prog:
            size = _write_test_file(tmp, budget, target, prog, warnings)
            report.test_file_bytes = size
            if size < MIN_TEST_BYTES:
                warnings.append(f"test file only {size // MIB} MiB: disk rates not measured")
                return report
            try:
                fd, direct, why_not = _open_for_reads(tmp)
            except PermissionError:
                raise UsageError(f"cannot read back the test file in {path} (permission denied): pass another "
                                 "--pack-dir or fix its permissions") from None
            info.o_direct = direct
            info.sources["o_direct"] = "measured"
            if not direct:
                warnings.append(f"O_DIRECT not supported for {path} ({why_not}): measured with buffered reads "
                                "after dropping the page cache, so the rates may be partly cached (too high)")
                if not quick and size < ram_bytes:
                    warnings.append("the test file is smaller than RAM, so cached reads are likely")
            seq, report.seq_bytes_read = _sequential(fd, size, budget, direct, prog)
            rnd, report.rand_reads = _random(fd, size, budget, direct, prog)
            info.seq_read_gbps, info.rand_read_gbps = round(seq, 3), round(rnd, 3)
            info.sources.update(seq_read_gbps="measured", rand_read_gbps="measured")
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return report
