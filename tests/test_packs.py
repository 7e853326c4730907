"""Pack files: layout on disk, batched reads, checksums, resume, stale detection."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from moetplan.contract.errors import UsageError
from moetplan.runtime.format import packs as P
from moetplan.runtime.format.format import RowLayout

L, E = 3, 5


def _layout(fmt: str = "2bit") -> RowLayout:
    return RowLayout.for_expert(64, 64, 1, fmt)


def _row(lay: RowLayout, layer: int, expert: int) -> np.ndarray:
    return np.random.default_rng(layer * 100 + expert).integers(0, 256, lay.stride, dtype=np.uint8)


def _write(tmp_path, identity: str = "id-a", layers=range(L), lay: RowLayout | None = None) -> P.PackWriter:
    lay = lay or _layout()
    w = P.PackWriter(tmp_path, "tiny", 0, 1, lay, L, E, identity)
    for li in layers:
        for e in range(E):
            w.write_row(li, e, _row(lay, li, e))
        w.commit({li: {"note": "x"}})
    return w


def test_paths_offsets_and_reads(tmp_path):
    lay = _layout()
    w = _write(tmp_path)
    w.close()
    path, side = P.pack_paths(tmp_path, "tiny", 1, 0, "2bit")
    assert path.name == "tiny.tp1.rank0.2bit.pack" and side.name == "tiny.tp1.rank0.2bit.pack.json"
    assert path.stat().st_size == L * E * lay.stride
    raw = path.read_bytes()
    off = (2 * E + 3) * lay.stride  # row (layer 2, expert 3) at (layer * E + expert) * stride
    assert raw[off:off + lay.stride] == _row(lay, 2, 3).tobytes()
    with P.Pack.open(tmp_path) as pk:
        assert pk.sidecar.complete and pk.stride == lay.stride and pk.row_index(2, 3) == 13
        rows = [13, 2, 3, 4, 0, 14, 13, 7]  # unordered, adjacent runs, a duplicate
        for o_direct in (False, True):
            out = np.zeros((len(rows), lay.stride), np.uint8)
            pk.read_rows(rows, out, o_direct=o_direct)
            for i, r in enumerate(rows):
                np.testing.assert_array_equal(out[i], _row(lay, r // E, r % E))
        tout = torch.zeros((3, lay.stride), dtype=torch.uint8)
        pk.read_rows([5, 6, 1], tout)
        assert torch.equal(tout[1], torch.from_numpy(_row(lay, 1, 1)))
        # a misaligned caller buffer still works with O_DIRECT (bounce buffer)
        base = np.zeros(lay.stride * 2 + 1, np.uint8)
        mis = base[1:].reshape(2, lay.stride)
        pk.read_rows([9, 10], mis, o_direct=True)
        np.testing.assert_array_equal(mis[1], _row(lay, 2, 0))
        with pytest.raises(UsageError, match="outside"):
            pk.read_rows([L * E], np.zeros((1, lay.stride), np.uint8))
        with pytest.raises(UsageError, match="uint8"):
            pk.read_rows([0], np.zeros((1, 8), np.uint8))


def test_flipped_byte_caught_by_checksum(tmp_path):
    lay = _layout()
    _write(tmp_path).close()
    path, _ = P.pack_paths(tmp_path, "tiny", 1, 0, "2bit")
    with open(path, "r+b") as f:
        f.seek(7 * lay.stride + 100)
        b = f.read(1)
        f.seek(7 * lay.stride + 100)
        f.write(bytes([b[0] ^ 0x10]))
    with P.Pack.open(path) as pk:
        assert pk.verify(6) and not pk.verify(7)
        assert pk.verify_all() == [7]
    w = P.PackWriter(tmp_path, "tiny", 0, 1, lay, L, E, "id-a")
    assert w.verify_done() == [7]
    assert w.missing_experts(1) == [2] and not w.sidecar.complete
    w.write_row(1, 2, _row(lay, 1, 2))
    w.commit()
    w.close()
    with P.Pack.open(path) as pk:
        assert pk.verify_all() == [] and pk.sidecar.complete


def test_resume_keeps_committed_rows_and_redoes_uncommitted(tmp_path):
    lay = _layout()
    w = _write(tmp_path, layers=[0])
    for e in range(E):  # written but never committed: a crash before the sidecar update
        w.write_row(1, e, _row(lay, 1, e))
    w.close()
    w2 = P.PackWriter(tmp_path, "tiny", 0, 1, lay, L, E, "id-a")
    assert w2.resumed and w2.rebuilt_reason is None
    assert w2.layer_done(0) and not w2.layer_done(1) and not w2.layer_done(2)
    assert w2.sidecar.layers["0"]["note"] == "x" and w2.sidecar.runs == 2
    w2.close()
    with pytest.raises(P.StalePackError, match="unfinished"):
        P.Pack.open(tmp_path)
    with P.Pack.open(tmp_path, require_complete=False) as pk:
        out = np.zeros((1, lay.stride), np.uint8)
        pk.read_rows([E - 1], out)  # a committed row reads fine
        np.testing.assert_array_equal(out[0], _row(lay, 0, E - 1))
        with pytest.raises(P.StalePackError, match="not written"):
            pk.read_rows([E], out)


def test_stale_identity_and_quantizer_version(tmp_path, monkeypatch):
    _write(tmp_path).close()
    with pytest.raises(P.StalePackError, match=r"identity.*moetplan quantize"):
        P.Pack.open(tmp_path, expect_identity="id-other")
    P.Pack.open(tmp_path, expect_identity="id-a").close()
    assert P.describe_mismatch(next(tmp_path.glob("*.pack")), "id-a") is None
    monkeypatch.setattr(P, "QUANTIZER_VERSION", "999")
    with pytest.raises(P.StalePackError, match="quantizer_version"):
        P.Pack.open(tmp_path)
    # the writer rebuilds a stale pack instead of resuming it
    w = P.PackWriter(tmp_path, "tiny", 0, 1, _layout(), L, E, "id-a")
    assert "quantizer_version" in (w.rebuilt_reason or "") and not w.resumed
    assert w.missing_experts(0) == list(range(E))
    w.close()
    monkeypatch.undo()
    w = P.PackWriter(tmp_path, "tiny", 0, 1, _layout(), L, E, "id-b")
    assert "identity" in (w.rebuilt_reason or "")
    w.close()


def test_corrupt_sidecar_is_stale_and_rebuilt(tmp_path):
    _write(tmp_path).close()
    _, side = P.pack_paths(tmp_path, "tiny", 1, 0, "2bit")
    side.write_text("{not json")
    with pytest.raises(P.StalePackError, match="unreadable"):
        P.Pack.open(tmp_path)
    w = P.PackWriter(tmp_path, "tiny", 0, 1, _layout(), L, E, "id-a")
    assert w.rebuilt_reason and not w.resumed
    w.close()
    assert json.loads(side.read_text())["kind"] == "moetplan-pack"


def test_layout_mismatch_rebuilds(tmp_path):
    _write(tmp_path).close()
    fp4 = _layout("fp4")
    w = P.PackWriter(tmp_path, "tiny", 0, 1, fp4, L, E, "id-a")  # different file (fmt in the name): fresh
    assert w.rebuilt_reason is None and not w.resumed
    w.close()
    with pytest.raises(P.StalePackError, match="layout"):
        P.Pack.open(tmp_path, fmt="2bit", expect_layout=RowLayout.for_expert(64, 128, 1, "2bit"))


def test_checkpoint_identity(tmp_path):
    with pytest.raises(UsageError, match="safetensors"):
        P.checkpoint_identity(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "config.json").write_text("{}")
    a = P.checkpoint_identity(tmp_path)
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 8}')
    assert P.checkpoint_identity(tmp_path) == a
    os.utime(tmp_path / "model.safetensors", (1, 1))
    assert P.checkpoint_identity(tmp_path) == a  # mtime is not identity
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert P.checkpoint_identity(tmp_path) != a
    with pytest.raises(UsageError, match="does not exist"):
        P.checkpoint_identity(tmp_path / "nope")


def test_writer_rejects_bad_rows(tmp_path):
    w = P.PackWriter(tmp_path, "tiny", 0, 1, _layout(), L, E, "id-a")
    with pytest.raises(UsageError, match="stride"):
        w.write_row(0, 0, np.zeros(10, np.uint8))
    with pytest.raises(UsageError, match="outside"):
        w.write_row(L, 0, np.zeros(_layout().stride, np.uint8))
    w.close()
    with pytest.raises(UsageError, match="letters"):
        P.pack_paths(tmp_path, "bad/key", 1, 0, "2bit")


def test_one_writer_per_pack(tmp_path):
    w = P.PackWriter(tmp_path, "tiny", 0, 1, _layout(), L, E, "id-a")
    with pytest.raises(UsageError, match="Another process is writing"):
        P.PackWriter(tmp_path, "tiny", 0, 1, _layout(), L, E, "id-a")
    w.close()
    P.PackWriter(tmp_path, "tiny", 0, 1, _layout(), L, E, "id-a").close()  # free again after close
