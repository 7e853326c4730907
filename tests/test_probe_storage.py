"""Pack-dir storage probe: real reads on a tmp dir, and faked OS failures (no O_DIRECT, EACCES, ENOSPC, Ctrl-C)."""
from __future__ import annotations

import errno
import fcntl
import os
import signal
from collections import namedtuple

import psutil
import pytest

from moetplan.contract.errors import UsageError
from moetplan.hw import storage as st

MIB = 1024**2
GIB = 1024**3
SMALL = st.StorageBudget(file_bytes=128 * MIB, write_s=10, seq_s=0.4, rand_s=0.4, seq_passes_max=2,
                         rand_reads_max=40)
Part = namedtuple("Part", "device mountpoint fstype opts")


def leftovers(d) -> list[str]:
    return [p.name for p in d.iterdir() if p.name.startswith(".moetplan-probe-")]


def test_measures_real_reads_and_cleans_up(tmp_path):
    rep = st.probe_storage(tmp_path / "packs", quick=True, progress=False, budget=SMALL)
    info = rep.info
    assert info.path == str(tmp_path / "packs") and (tmp_path / "packs").is_dir()
    assert info.free_gib and info.free_gib > 0 and info.fs_type
    assert info.seq_read_gbps and info.seq_read_gbps > 0
    assert info.rand_read_gbps and info.rand_read_gbps > 0
    assert info.sources["seq_read_gbps"] == "measured" and info.sources["rand_read_gbps"] == "measured"
    assert rep.test_file_bytes == 128 * MIB and rep.rand_reads > 0 and rep.seq_bytes_read >= 128 * MIB
    assert info.o_direct is not None
    assert leftovers(tmp_path / "packs") == []


def test_quick_never_writes_more_than_1_gib(tmp_path):
    assert st.QUICK.file_bytes <= GIB
    with pytest.raises(ValueError, match="1 GiB"):
        st.probe_storage(tmp_path, quick=True, progress=False,
                         budget=st.StorageBudget(file_bytes=2 * GIB, write_s=1, seq_s=1, rand_s=1))


def test_no_o_direct_falls_back_to_buffered_and_says_so(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a, **k):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", no_direct)
    rep = st.probe_storage(tmp_path, quick=True, progress=False, budget=SMALL)
    assert rep.info.o_direct is False
    assert rep.info.seq_read_gbps and rep.info.seq_read_gbps > 0  # still measured, buffered
    assert any("O_DIRECT not supported" in w and "cached" in w for w in rep.info.warnings)
    assert leftovers(tmp_path) == []


def test_o_direct_read_rejected_falls_back(tmp_path, monkeypatch):
    """Some filesystems accept the O_DIRECT open and refuse the read (EINVAL)."""
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this OS")
    real_preadv = os.preadv

    def preadv(fd, bufs, off):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", preadv)
    rep = st.probe_storage(tmp_path, quick=True, progress=False, budget=SMALL)
    assert rep.info.o_direct is False and rep.info.rand_read_gbps > 0
    assert any("O_DIRECT reads fail" in w for w in rep.info.warnings)


def test_unwritable_dir_is_a_usage_error_naming_the_dir(tmp_path, monkeypatch):
    real_open = os.open

    def denied(path, flags, *a, **k):
        if flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(UsageError, match=rf"{tmp_path}.*permission denied.*--pack-dir"):
        st.probe_storage(tmp_path, quick=True, progress=False, budget=SMALL)


def test_unreadable_dir_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    with pytest.raises(UsageError, match="not readable and writable.*--pack-dir"):
        st.probe_storage(tmp_path, quick=True, progress=False, budget=SMALL)


def test_pack_dir_under_a_file_is_a_usage_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UsageError, match="pack dir"):
        st.probe_storage(f / "packs", quick=True, progress=False, budget=SMALL)
    with pytest.raises(UsageError, match="not a directory"):
        st.probe_storage(f, quick=True, progress=False, budget=SMALL)


def _enospc_after(monkeypatch, chunks_ok: int) -> None:
    real_write, count = os.write, [0]

    def write(fd, data):
        if len(data) == st.CHUNK:
            count[0] += 1
            if count[0] > chunks_ok:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)


def test_disk_full_midway_measures_what_was_written(tmp_path, monkeypatch):
    _enospc_after(monkeypatch, chunks_ok=5)  # 80 MiB written, then ENOSPC
    rep = st.probe_storage(tmp_path, quick=True, progress=False, budget=SMALL)
    assert rep.test_file_bytes == 5 * st.CHUNK
    assert rep.info.seq_read_gbps and rep.info.seq_read_gbps > 0
    assert any("disk full" in w and "ENOSPC" in w for w in rep.info.warnings)
    assert leftovers(tmp_path) == []


def test_disk_full_at_once_reports_no_rates(tmp_path, monkeypatch):
    _enospc_after(monkeypatch, chunks_ok=0)
    rep = st.probe_storage(tmp_path, quick=True, progress=False, budget=SMALL)
    assert rep.info.seq_read_gbps is None and rep.info.rand_read_gbps is None
    assert any("disk full" in w for w in rep.info.warnings)
    assert any("not measured" in w for w in rep.info.warnings)
    assert leftovers(tmp_path) == []


def test_too_little_free_space_skips_the_test(tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(st.shutil, "disk_usage", lambda p: Usage(10 * GIB, 10 * GIB - 500 * MIB, 500 * MIB))
    rep = st.probe_storage(tmp_path, quick=True, progress=False, budget=SMALL)
    assert rep.info.free_gib == pytest.approx(500 / 1024, abs=0.01)
    assert rep.info.seq_read_gbps is None
    assert any("too little for a read test" in w for w in rep.info.warnings)


def test_ctrl_c_removes_the_test_file(tmp_path, monkeypatch):
    def interrupted(fd, bufs, off):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "preadv", interrupted)
    with pytest.raises(KeyboardInterrupt):
        st.probe_storage(tmp_path, quick=True, progress=False, budget=SMALL)
    assert leftovers(tmp_path) == []


def test_sigterm_removes_the_test_file_and_restores_the_handler(tmp_path, monkeypatch):
    before = signal.getsignal(signal.SIGTERM)
    real_preadv = os.preadv

    def terminated(fd, bufs, off):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_preadv(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", terminated)
    with pytest.raises(KeyboardInterrupt):
        st.probe_storage(tmp_path, quick=True, progress=False, budget=SMALL)
    assert leftovers(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize("fstype,needle", [
    ("overlay", "overlay"), ("tmpfs", "RAM"), ("nfs4", "network"), ("fuse.sshfs", "network/FUSE"),
    ("cifs", "network"), ("zfs", "ARC"), ("ext4", None), ("xfs", None),
])
def test_filesystem_type_and_warnings(tmp_path, monkeypatch, fstype, needle):
    parts = [Part("/dev/vda", "/", "ext4", "rw"), Part("x", str(tmp_path), fstype, "rw")]
    monkeypatch.setattr(psutil, "disk_partitions", lambda all=False: parts)
    fs, mount = st.filesystem_type(tmp_path / "deeper")
    assert (fs, mount) == (fstype, str(tmp_path))
    warns = st.filesystem_warnings(fs, str(tmp_path))
    if needle is None:
        assert warns == []
    else:
        assert len(warns) == 1 and needle in warns[0]


def test_full_mode_sizes_bounded_by_free_disk_and_ram():
    w: list[str] = []
    # O_DIRECT: a fixed size beats drive caches; plenty of room -> no warning.
    assert st._target_size(st.FULL, False, True, free=500 * GIB, ram_bytes=64 * GIB, warnings=w) == st.FULL.file_bytes
    assert w == []
    # Buffered: the file must outgrow RAM (x1.25).
    assert st._target_size(st.FULL, False, False, free=500 * GIB, ram_bytes=32 * GIB, warnings=w) == 40 * GIB
    assert st._target_size(st.FULL, False, False, free=5000 * GIB, ram_bytes=1024 * GIB, warnings=w) == 64 * GIB
    # Not enough disk: bounded, keeps 10% free, and says so.
    size = st._target_size(st.FULL, False, False, free=20 * GIB, ram_bytes=64 * GIB, warnings=w)
    assert size == 18 * GIB and any("limited to 18.0 GiB by free disk" in x for x in w)
    assert st._target_size(st.QUICK, True, True, free=500 * GIB, ram_bytes=GIB, warnings=[]) <= GIB


def test_stale_test_files_of_dead_probes_are_removed(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".moetplan-probe-{int(dead.stdout)}-deadbeef.tmp"
    live = tmp_path / f".moetplan-probe-{os.getppid()}-cafef00d.tmp"  # a running process: not ours to delete
    stale.write_bytes(b"x" * 4096)
    live.write_bytes(b"x")
    rep = st.probe_storage(tmp_path, quick=True, progress=False, budget=SMALL)
    assert not stale.exists() and live.exists()
    assert any("left in" in w and "killed" in w for w in rep.info.warnings)


def test_default_pack_dir_is_the_user_cache_dir(tmp_path, monkeypatch):
    import platformdirs

    monkeypatch.delenv("MOETPLAN_CACHE_DIR", raising=False)
    monkeypatch.setattr(platformdirs, "user_cache_dir", lambda app=None, *a, **k: str(tmp_path / "cache" / (app or "")))
    assert st.default_pack_dir() == tmp_path / "cache" / "moetplan" / "packs"
    rep = st.probe_storage(None, quick=True, progress=False, budget=SMALL)
    assert rep.info.path == str(tmp_path / "cache" / "moetplan" / "packs")
