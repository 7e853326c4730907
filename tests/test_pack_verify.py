"""Packs are verified where they are served: every row is checked against its xxh3 at its first read; a bad row
is re-quantized from the checkpoint and rewritten in place, or refused with an error naming the pack, the layers,
the rows and the fix. Never served: not by read_rows, not by the NVMe arena, not through a worker's pack lookup."""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moetplan.launch.supervisor import Server, ServerDiedError
from moetplan.runtime.format import packs as P
from moetplan.runtime.store.backing import PackArenaStore
from moetplan.runtime.format.format import RowLayout
from moetplan.runtime.format.pack_repair import CheckpointRepair
from moetplan.runtime.vllm.pack_resolve import PackResolver
from moetplan.runtime.format.quantize_ckpt import quantize_checkpoint

HIDDEN, INTER, LAYERS, EXPERTS = 64, 64, 3, 4
BAD = [(1, 2), (2, 0), (2, 3)]  # (MoE layer, expert) rows given flipped bytes


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    d = tmp_path_factory.mktemp("ckpt") / "tiny-verify"
    torch.manual_seed(1)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=INTER,
                         num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         num_experts=EXPERTS, num_experts_per_tok=2, mlp_only_layers=[])
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def fresh(ckpt, tmp_path_factory) -> Path:
    """A freshly quantized pack (the reference bytes); tests copy its folder and corrupt the copy."""
    d = tmp_path_factory.mktemp("fresh")
    res = quantize_checkpoint(ckpt, d, report=False, workers=1)
    assert res["complete"]
    return Path(res["packs"][0])


def _corrupt_copy(fresh: Path, tmp_path: Path, bad=BAD) -> Path:
    d = tmp_path / "packs"
    shutil.copytree(fresh.parent, d)
    path = d / fresh.name
    stride = P.Pack.open(path).stride
    raw = bytearray(path.read_bytes())
    for li, e in bad:
        off = (li * EXPERTS + e) * stride
        raw[off + 3] ^= 0x40  # in the w13 codes
        raw[off + stride // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    return path


def _all_rows(pk: P.Pack) -> np.ndarray:
    out = np.zeros((LAYERS * EXPERTS, pk.stride), np.uint8)
    pk.read_rows(list(range(LAYERS * EXPERTS)), out)
    return out


def test_a_good_pack_passes_and_each_row_is_checked_once(fresh):
    seen = []
    with P.Pack.open(fresh) as pk:
        pk.on_all_verified = lambda p: seen.append(p.rows_verified)
        for li in range(LAYERS):
            out = np.zeros((EXPERTS, pk.stride), np.uint8)
            pk.read_rows([pk.row_index(li, e) for e in range(EXPERTS)], out)
            assert pk.rows_verified == (li + 1) * EXPERTS
        _all_rows(pk)  # a second read of verified rows is not counted again
        assert seen == [LAYERS * EXPERTS] and pk.verify_all() == []


def test_flipped_bytes_are_refused_naming_the_pack_layers_and_rows(ckpt, fresh, tmp_path):
    path = _corrupt_copy(fresh, tmp_path)
    with P.Pack.open(path) as pk:
        assert pk.verify_all() == [li * EXPERTS + e for li, e in BAD]  # the whole-pack check finds the same rows
    with P.Pack.open(path) as pk:
        good = np.zeros((EXPERTS, pk.stride), np.uint8)
        pk.read_rows([pk.row_index(0, e) for e in range(EXPERTS)], good)  # layer 0 is intact
        with pytest.raises(P.PackCorruptError) as ei:
            pk.read_rows(list(range(LAYERS * EXPERTS)), np.zeros((LAYERS * EXPERTS, pk.stride), np.uint8))
        msg = str(ei.value)
        assert str(path) in msg and "3 row(s) fail their xxh3 checksum" in msg
        assert "MoE layer 1 (checkpoint layer 1): expert 2" in msg and "MoE layer 2 (checkpoint layer 2): experts 0, 3" in msg
        assert f"moetplan quantize --model {ckpt.resolve()} --pack-dir {path.parent}" in msg and "not served" in msg
        assert ei.value.rows == [6, 8, 11] and ei.value.exit_code == 1
        # a row that failed stays unverified: reading it again fails again
        with pytest.raises(P.PackCorruptError):
            pk.read_row(pk.row_index(1, 2))


def test_the_nvme_arena_never_serves_a_bad_row(fresh, tmp_path):
    path = _corrupt_copy(fresh, tmp_path)
    with P.Pack.open(path) as pk:
        store = PackArenaStore(pk, arena_rows=4, pin=False, readers=2, o_direct=False)
        try:
            with pytest.raises(P.PackCorruptError, match="MoE layer 1"):
                store.fetch([(0, 1), (1, 2)])
            assert (1, 2) not in store.resident()  # the slot it was read into is free again, not mapped
            f = store.fetch([(0, 1), (1, 3)])
            np.testing.assert_array_equal(f.views[1].numpy(), P.Pack.open(fresh).read_row(7))
            store.release()
        finally:
            store.close()


def test_bad_rows_are_requantized_from_the_checkpoint_and_equal_a_fresh_pack(ckpt, fresh, tmp_path, caplog):
    path = _corrupt_copy(fresh, tmp_path)
    before = json.loads(path.with_name(path.name + ".json").read_text())
    repair = CheckpointRepair(ckpt, tp_rank=0)
    with caplog.at_level(logging.WARNING, logger="vllm.moetplan"), P.Pack.open(path) as pk:
        pk.repair = repair
        rows = _all_rows(pk)
        assert pk.rows_verified == LAYERS * EXPERTS
    with P.Pack.open(fresh) as ref:
        np.testing.assert_array_equal(rows, _all_rows(ref))
    assert path.read_bytes() == fresh.read_bytes()  # rewritten in place: the file equals a fresh pack
    assert sorted(r for _, r in repair.repaired) == [6, 8, 11]  # just the bad rows
    after = json.loads(path.with_name(path.name + ".json").read_text())
    assert after["checksums"] == before["checksums"]  # the quantizer reproduced the recorded rows exactly
    text = caplog.text
    assert "3 row(s) fail their xxh3 checksum" in text and "repaired and rewritten" in text
    with P.Pack.open(path) as pk:
        assert pk.verify_all() == []


def test_without_a_checkpoint_the_error_is_logged_first_and_raised(fresh, tmp_path, caplog):
    path = _corrupt_copy(fresh, tmp_path)
    with caplog.at_level(logging.WARNING, logger="vllm.moetplan"), P.Pack.open(path) as pk:
        pk.repair = CheckpointRepair(None, tp_rank=0)
        with pytest.raises(P.PackCorruptError, match=r"no local checkpoint.*MoE layer 1 \(checkpoint layer 1\)"):
            _all_rows(pk)
    first = next(r for r in caplog.records if r.name == "vllm.moetplan")
    assert first.levelno == logging.ERROR and first.getMessage().startswith(f"moetplan: Pack {path}: 3 row(s)")
    assert "Traceback" not in first.getMessage()



def test_moetplan_run_names_the_workers_error_line_however_long_the_traceback(tmp_path):
    """A worker's "ERROR ... moetplan: <message>" line is what `moetplan run` says when the server dies loading,
    even with hundreds of traceback lines after it."""
    msg = "Pack /p/x.pack: 2 row(s) fail their xxh3 checksum: MoE layer 0: experts 1, 5. Fix: re-run quantize"
    script = tmp_path / "dies.py"
    script.write_text("import sys\n"
                      "print('INFO Starting to load model /tmp/x', flush=True)\n"
                      f"print('(Worker pid=7) ERROR 12-02 03:00:00 [pack_repair.py:88] moetplan: {msg}', flush=True)\n"
                      "for i in range(400): print(f'ERROR [multiproc_executor.py:953]   File \"x.py\", line {i}')\n"
                      "print('RuntimeError: Engine core initialization failed. See root cause above.', flush=True)\n"
                      "sys.exit(1)\n")
    srv = Server([sys.executable, str(script)], {}, tmp_path / "dies.log", port=1)
    srv.start()
    with pytest.raises(ServerDiedError) as ei:
        srv.wait_ready(timeout=60, poll_s=0.05)
    srv.stop(timeout=5)
    assert str(ei.value).endswith(f"while loading: {msg}") and ei.value.returncode == 1


def test_another_checkpoint_or_an_unwritable_pack_is_refused(ckpt, fresh, tmp_path, monkeypatch):
    path = _corrupt_copy(fresh, tmp_path)
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    with open(next(other.glob("*.safetensors")), "ab") as f:
        f.write(b"\0" * 8)  # another size: another identity
    with P.Pack.open(path) as pk:
        pk.repair = CheckpointRepair(other, tp_rank=0)
        with pytest.raises(P.PackCorruptError, match="is not the checkpoint the pack was built from"):
            _all_rows(pk)
    real_open = os.open

    def read_only(p, flags, *a):
        if str(p) == str(path) and flags & os.O_WRONLY:
            raise PermissionError(13, "Read-only file system")
        return real_open(p, flags, *a)

    import moetplan.runtime.format.pack_repair as R

    monkeypatch.setattr(R.os, "open", read_only)
    with P.Pack.open(path) as pk:
        pk.repair = CheckpointRepair(ckpt, tp_rank=0)
        with pytest.raises(P.PackCorruptError, match=r"could not be written back \(Read-only file system\)"):
            _all_rows(pk)
    assert path.read_bytes() != fresh.read_bytes()  # nothing half-repaired was claimed


def test_a_workers_pack_lookup_repairs_with_the_served_checkpoint(ckpt, fresh, tmp_path):
    path = _corrupt_copy(fresh, tmp_path)
    packs = PackResolver(str(path.parent), lambda: 0)
    packs.set_model_dir(str(ckpt))
    layout = RowLayout.for_expert(HIDDEN, INTER, 1, "2bit")
    pk = packs.valid_pack(layout, EXPERTS)
    assert pk is not None and isinstance(pk.repair, CheckpointRepair)
    _all_rows(pk)
    assert path.read_bytes() == fresh.read_bytes()
    # the NVMe tier's store gets that same pack: rows checked at load are not hashed again
    assert packs.write_and_open(None, LAYERS, EXPERTS, layout) is pk


def test_a_hub_model_without_a_local_copy_cannot_repair(fresh, tmp_path):
    """No local checkpoint (a hub name vLLM resolved elsewhere): the lookup still guards the pack and refuses."""
    lay = RowLayout.for_expert(HIDDEN, INTER, 1, "2bit")
    d = tmp_path / "hubpacks"
    with P.Pack.open(fresh) as src:
        rows = _all_rows(src)
    w = P.PackWriter(d, "none", 0, 1, lay, LAYERS, EXPERTS, "hub:nobody/none")
    for r in range(LAYERS * EXPERTS):
        w.write_row(r // EXPERTS, r % EXPERTS, rows[r])
    w.commit()
    w.close()
    raw = bytearray(w.path.read_bytes())
    raw[5 * lay.stride] ^= 0xFF
    w.path.write_bytes(bytes(raw))
    packs = PackResolver(str(d), lambda: 0)
    packs.set_model_dir("nobody/none")
    pk = packs.valid_pack(lay, EXPERTS)
    with pytest.raises(P.PackCorruptError, match=r"no local checkpoint.*MoE layer 1: expert 1"):
        _all_rows(pk)


def test_a_wrong_recorded_checksum_is_corrected_from_the_requantized_row(ckpt, fresh, tmp_path):
    """The bytes are intact but the sidecar's checksum is not: the row fails, the checkpoint's row (the same bytes)
    is rewritten and its checksum recorded atomically in the sidecar."""
    d = tmp_path / "packs"
    shutil.copytree(fresh.parent, d)
    path = d / fresh.name
    side = path.with_name(path.name + ".json")
    doc = json.loads(side.read_text())
    want = doc["checksums"][9]
    doc["checksums"][9] = "0" * 16
    side.write_text(json.dumps(doc))
    with P.Pack.open(path) as pk:
        pk.repair = CheckpointRepair(ckpt, tp_rank=0)
        _all_rows(pk)
    assert json.loads(side.read_text())["checksums"][9] == want
    assert path.read_bytes() == fresh.read_bytes()
