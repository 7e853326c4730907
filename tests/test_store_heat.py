"""Heat persistence: the hot set survives a restart, keyed to the pack; stale or damaged files are ignored."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from moetplan.runtime.store.backing import FileRowSource, PackArenaStore, PinnedHostStore
from moetplan.runtime.store.heat import HEAT_VERSION, heat_path, load_heat, restore_heat, save_heat
from moetplan.runtime.store.store import ExpertStore

L, E, S = 3, 12, 4096
ROWS = np.random.default_rng(2).integers(0, 256, (L * E, S), dtype=np.uint8)


@pytest.fixture()
def pack(tmp_path):
    p = tmp_path / "ds.pack"
    p.write_bytes(ROWS.tobytes())
    return p


def _warm_store(pack, slots=6):
    store = ExpertStore(PinnedHostStore(FileRowSource(pack, L, E, S), pin=False), slots, decay=0.9)
    rng = np.random.default_rng(0)
    for _ in range(30):
        for layer in range(L):
            # per layer, experts 2*layer and 2*layer+1 dominate; the rest are noise
            ids = [2 * layer, 2 * layer + 1] if rng.random() < 0.8 else [int(rng.integers(E))]
            store.ensure(layer, [ids])
    store.begin_step()
    return store


def test_round_trip_preloads_the_hot_set(pack, tmp_path):
    store = _warm_store(pack)
    path = save_heat(store)
    assert path == heat_path(pack) and path.parent == pack.parent
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # atomic write left nothing behind
    doc = json.loads(path.read_text())
    assert doc["version"] == HEAT_VERSION and doc["pack_identity"] == store.backing.identity
    hot = {(layer, e) for layer in range(L) for e in (2 * layer, 2 * layer + 1)}

    fresh = ExpertStore(PinnedHostStore(FileRowSource(pack, L, E, S), pin=False), 6)
    n = restore_heat(fresh, progress=False)
    assert n == 6 and fresh.resident() == hot  # the six hottest, two per layer, are back
    np.testing.assert_allclose(fresh.heat(), np.round(store.heat(), 6) * (store.heat() > 1e-6), atol=1e-6)
    res, data = fresh.residency.numpy(), fresh.data.numpy()
    for layer, e in hot:
        assert np.array_equal(data[res[layer, e]], ROWS[layer * E + e])
    # The first decode step after the restart finds its working set already there.
    for layer in range(L):
        fresh.ensure(layer, [[2 * layer, 2 * layer + 1]])
    fresh.begin_step()
    assert fresh.stats()["zero_miss_step_share"] == 1.0


def test_preload_respects_capacity_and_interleaves_layers(pack):
    store = _warm_store(pack)
    save_heat(store)
    small = ExpertStore(PackArenaStore(FileRowSource(pack, L, E, S), 4, pin=False), 3)
    assert restore_heat(small, progress=True) == 3  # progress bar forced on (rich, non-tty is fine)
    assert sorted(layer for layer, _ in small.resident()) == [0, 1, 2]  # each layer's hottest first


def test_stale_damaged_or_missing_heat_is_ignored(pack, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="moetplan.store")
    store = _warm_store(pack)
    path = save_heat(store)
    assert load_heat(path, pack_identity="another-pack") is None
    assert "another pack" in caplog.text
    assert load_heat(path, pack_identity=store.backing.identity, num_experts=E + 1) is None
    doc = json.loads(path.read_text())
    doc["version"] = HEAT_VERSION + 1
    path.write_text(json.dumps(doc))
    assert load_heat(path) is None and "version" in caplog.text
    path.write_text("{not json")
    assert load_heat(path) is None and "damaged" in caplog.text
    doc["version"] = HEAT_VERSION
    doc["layers"][0]["experts"] = [E + 5]
    doc["layers"][0]["heat"] = [1.0]
    path.write_text(json.dumps(doc))
    assert load_heat(path) is None
    fresh = ExpertStore(PinnedHostStore(FileRowSource(pack, L, E, S), pin=False), 6)
    assert restore_heat(fresh, tmp_path / "missing.heat.json", progress=False) == 0
    assert fresh.resident() == set()


def test_rebuilt_pack_changes_identity(pack):
    store = _warm_store(pack)
    save_heat(store)
    pack.write_bytes(ROWS.tobytes() + b"\0" * S)  # a different pack file under the same name
    fresh = ExpertStore(PinnedHostStore(FileRowSource(pack, L, E, S), pin=False), 6)
    assert fresh.backing.identity != store.backing.identity
    assert restore_heat(fresh, progress=False) == 0


def test_heat_keeper_saves_periodically_and_survives_a_bad_disk(pack, tmp_path, monkeypatch, caplog):
    from moetplan.runtime.store import heat as heat_mod
    from moetplan.runtime.store.heat import HeatKeeper

    store = ExpertStore(PinnedHostStore(FileRowSource(pack, L, E, S), pin=False), 6)
    keeper = HeatKeeper(store, every_s=0.0).attach()  # every_s=0: periodic saving off
    store.ensure(0, [[1]])
    store.begin_step()
    assert keeper.saves == 0 and not heat_path(pack).exists()
    keeper.every_s = 1e-9  # due at every step
    store.ensure(0, [[2]])
    store.begin_step()
    assert keeper.saves == 1 and load_heat(heat_path(pack)).hot_sets()[0][:2] == [2, 1]

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(heat_mod, "atomic_write_text", full_disk)
    caplog.set_level(logging.WARNING, logger="moetplan.store")
    store.ensure(0, [[3]])
    store.begin_step()  # no exception reaches the model runner
    assert keeper.saves == 2 and "could not save" in caplog.text
