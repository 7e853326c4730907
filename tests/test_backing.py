"""Backing stores: every tier hands back the pack's bytes; pinned-memory failure is a clear, specific error."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from moetplan.contract.errors import MoetplanError, UsageError
from moetplan.runtime.store import backing as bk
from moetplan.runtime.store.backing import (
    ArrayRowSource, FileRowSource, PackArenaStore, PackPageCacheStore, PinnedHostStore, PinnedMemoryError,
    host_buffer, make_backing,
)

L, E, S = 3, 8, 4096


@pytest.fixture()
def rows() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (L * E, S), dtype=np.uint8)


@pytest.fixture()
def pack_file(tmp_path, rows):
    p = tmp_path / "experts.pack"
    header = b"H" * 4096
    p.write_bytes(header + rows.tobytes())
    return p


def _all_stores(rows, pack_file):
    src = FileRowSource(pack_file, L, E, S, header_bytes=4096)
    return [
        PinnedHostStore(ArrayRowSource(rows, L, E), pin=False),
        PinnedHostStore(src, pin=False),
        PackPageCacheStore(src, pin=False, staging_rows=2),
        PackArenaStore(src, 4, pin=False, readers=3, o_direct=True),
        PackArenaStore(src, 4, pin=False, readers=1, o_direct=False),
    ]


def test_file_source_reads_rows_with_and_without_o_direct(rows, pack_file):
    src = FileRowSource(pack_file, L, E, S, header_bytes=4096)
    out = host_buffer(5, S, pin=False, what="test")
    assert out.data_ptr() % 4096 == 0
    picks = [3, 4, 5, 17, 0]  # a contiguous run and scattered rows
    for direct in (False, True):
        out.zero_()
        src.read_rows(picks, out, o_direct=direct)
        assert np.array_equal(out.numpy(), rows[picks])


def test_every_tier_returns_the_pack_rows(rows, pack_file):
    rng = np.random.default_rng(0)
    for store in _all_stores(rows, pack_file):
        for _ in range(12):
            keys = [(int(rng.integers(L)), int(rng.integers(E))) for _ in range(int(rng.integers(1, 4)))]
            keys.append(keys[0])  # repeats are allowed
            f = store.fetch(keys)
            assert len(f.views) == len(keys)
            for (layer, e), v in zip(keys, f.views):
                assert np.array_equal(v.numpy(), rows[layer * E + e]), type(store).__name__
            store.release(None)
        store.close()


def test_arena_counts_hits_and_evicts_cold_rows(rows, pack_file):
    src = FileRowSource(pack_file, L, E, S, header_bytes=4096)
    arena = PackArenaStore(src, 3, pin=False, readers=2)
    f = arena.fetch([(0, 1), (0, 2)])
    assert (f.arena_misses, f.arena_hits, f.bytes_disk) == (2, 0, 2 * S)
    arena.release()
    for _ in range(3):  # make (0, 1) hot
        assert arena.fetch([(0, 1)]).arena_hits == 1
        arena.release()
    arena.fetch([(1, 0)])
    arena.release()
    f = arena.fetch([(2, 5)])  # arena full: the coldest row goes, the hot one stays
    arena.release()
    assert (0, 1) in arena.resident() and (2, 5) in arena.resident()
    assert len(arena.resident()) == 3
    assert arena.stats.arena_hits == 3 and arena.stats.arena_misses == 4


def test_arena_smaller_than_one_batch_is_a_clear_error(rows, pack_file):
    arena = PackArenaStore(FileRowSource(pack_file, L, E, S, header_bytes=4096), 2, pin=False)
    with pytest.raises(MoetplanError, match="host_arena_gib"):
        arena.fetch([(0, 0), (0, 1), (0, 2)])


def test_failed_read_leaves_no_stale_arena_rows(rows, pack_file, monkeypatch):
    src = FileRowSource(pack_file, L, E, S, header_bytes=4096)
    arena = PackArenaStore(src, 4, pin=False, readers=2)

    def boom(*a, **k):
        raise OSError("disk gone")

    monkeypatch.setattr(src, "read_rows", boom)
    with pytest.raises(OSError):
        arena.fetch([(0, 0), (1, 1)])
    assert arena.resident() == set()
    monkeypatch.undo()
    f = arena.fetch([(0, 0), (1, 1)])
    assert np.array_equal(f.views[1].numpy(), rows[1 * E + 1])


def test_pinned_failure_names_limit_fix_and_fallback(rows, monkeypatch):
    def refuse(nbytes):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    monkeypatch.setattr(bk, "_pin_alloc", refuse)
    with pytest.raises(PinnedMemoryError) as ei:
        PinnedHostStore(ArrayRowSource(rows, L, E), pin=True)
    msg = str(ei.value)
    assert "ulimit -l" in msg and "memlock" in msg  # the limit and the fix
    assert "expert_tier=nvme" in msg and "host_arena_gib" in msg  # the plan's fallback
    assert "pinned host expert store" in msg
    with pytest.raises(PinnedMemoryError, match="RAM arena"):
        PackArenaStore(ArrayRowSource(rows, L, E), 4, pin=True)
    # The fallback tier needs no big pin: without pinning it still works.
    assert np.array_equal(make_backing("nvme", ArrayRowSource(rows, L, E), pin=False).fetch([(1, 2)]).views[0].numpy(),
                          rows[E + 2])


def test_bad_inputs_name_the_problem(rows, pack_file, tmp_path):
    with pytest.raises(UsageError, match="truncated"):
        FileRowSource(pack_file, L, E + 1, S, header_bytes=4096)
    with pytest.raises(UsageError, match="does not exist"):
        FileRowSource(tmp_path / "nope.pack", L, E, S)
    store = PinnedHostStore(ArrayRowSource(rows, L, E), pin=False)
    with pytest.raises(UsageError, match="outside the pack"):
        store.fetch([(L, 0)])
    with pytest.raises(UsageError, match="unknown backing tier"):
        make_backing("gpu", ArrayRowSource(rows, L, E))
    with pytest.raises(UsageError, match="uint8"):
        ArrayRowSource(rows.astype(np.int16), L, E)


@pytest.mark.gpu
def test_pinned_buffers_are_page_locked_and_aligned():
    buf = host_buffer(3, S + 4096, pin=True, what="test")  # not a power of two: locked exactly, not rounded up
    assert buf.is_pinned() and buf.data_ptr() % 4096 == 0 and buf.shape == (3, S + 4096)
    dev = torch.empty_like(buf, device="cuda")
    buf.fill_(3)
    dev.copy_(buf, non_blocking=True)
    torch.cuda.synchronize()
    assert int(dev.min()) == 3
    bk.unpin(buf)
    assert not buf.is_pinned()


def test_os_has_preadv():
    assert hasattr(os, "preadv")  # the reader relies on it (Linux)


def test_real_pack_through_every_tier_and_the_store(tmp_path):
    """H2's pack file (moetplan.runtime.format.packs) is a row source as is: rows read back match their checksums."""
    from moetplan.runtime.format.format import RowLayout
    from moetplan.runtime.format.packs import Pack, PackWriter
    from moetplan.runtime.store.store import ExpertStore

    layout = RowLayout.for_expert(64, 64, 1, "2bit")
    nl, ne = 2, 6
    data = np.random.default_rng(4).integers(0, 256, (nl * ne, layout.stride), dtype=np.uint8)
    with PackWriter(tmp_path, "tiny", 0, 1, layout, nl, ne, identity="sha256:test", fsync=False) as w:
        for r in range(nl * ne):
            w.write_row(r // ne, r % ne, data[r])
        w.commit()
    pack = Pack.open(w.path)
    assert bk.source_identity(pack).startswith("sha256:test|q")
    for backing in (PinnedHostStore(pack, pin=False), PackPageCacheStore(pack, pin=False),
                    PackArenaStore(pack, 3, pin=False, readers=2, o_direct=True)):
        store = ExpertStore(backing, 4)
        for step in range(6):
            for layer in range(nl):
                ids = [[(step + layer) % ne, (2 * step + 1) % ne]]
                slots = store.ensure(layer, ids).numpy().reshape(-1)
                for e, s in zip(ids[0], slots):
                    row = store.data[s].numpy()
                    assert np.array_equal(row, data[layer * ne + e])
                    assert bk.row_checksum_ok(pack, layer * ne + e, row)
