"""The expert cache: bytes always right, never over N slots, step pins hold, prefill cannot evict the hot set."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetplan.contract.errors import ConfigError, UsageError
from moetplan.runtime.store.backing import (
    ArrayRowSource, FileRowSource, PackArenaStore, PackPageCacheStore, PinnedHostStore,
)
from moetplan.contract.runtime import RuntimeSection
from moetplan.runtime.store.store import ExpertStore, StoreCapacityError
from moetplan.runtime.vllm.tiers import expert_store

L, E, S = 4, 10, 4096
ROWS = np.random.default_rng(11).integers(0, 256, (L * E, S), dtype=np.uint8)


def _backing(kind: str, tmp_path=None):
    src = ArrayRowSource(ROWS, L, E)
    if kind == "host":
        return PinnedHostStore(src, pin=False)
    if kind == "pagecache":
        return PackPageCacheStore(src, pin=False, staging_rows=2)
    if kind == "arena":
        return PackArenaStore(src, 5, pin=False, readers=2)
    if kind == "arena-file":
        p = tmp_path / "x.pack"
        if not p.exists():
            p.write_bytes(ROWS.tobytes())
        return PackArenaStore(FileRowSource(p, L, E, S), 7, pin=False, readers=3, o_direct=True)
    raise AssertionError(kind)


def assert_kernel_view_correct(store: ExpertStore) -> None:
    """What a kernel reads, pool[residency[l, e]], must be the pack's row for every resident (l, e)."""
    res = store.residency.cpu().numpy()
    data = store.data.cpu().numpy()
    occupied = np.argwhere(res >= 0)
    assert len(occupied) <= store.pool.num_slots
    slots = res[res >= 0]
    assert len(set(slots.tolist())) == len(slots), "two experts share a slot"
    for layer, e in occupied:
        assert np.array_equal(data[res[layer, e]], ROWS[layer * E + e]), f"wrong bytes for ({layer}, {e})"
    store.pool.check()


# One operation: (kind, layer, expert ids). kind 0 = decode ensure, 1 = prefill chunks, 2 = prefetch, 3 = new step
op = st.tuples(st.integers(0, 3), st.integers(0, L - 1), st.lists(st.integers(0, E - 1), min_size=1, max_size=6))


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("packs")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["host", "pagecache", "arena", "arena-file"]), slots=st.integers(6, 14),
       ops=st.lists(op, min_size=1, max_size=40))
def test_property_bytes_bound_and_pins(pack_dir, kind, slots, ops):
    store = ExpertStore(_backing(kind, pack_dir), slots, decay=0.9, protected_share=0.5)
    for k, layer, ids in ops:
        if k == 3:
            store.begin_step()
            continue
        if k == 2:
            store.prefetch(layer, ids)
            assert_kernel_view_correct(store)
            continue
        if k == 1:
            wanted = np.asarray(ids)
            seen = np.zeros(len(wanted), dtype=bool)
            for mask, sl in store.ensure_chunks(layer, wanted, prefill=True):
                m, s = mask.numpy(), sl.numpy()
                assert not (seen & m).any(), "an entry was served by two chunks"
                seen |= m
                for e, slot in zip(wanted[m], s[m]):  # the chunk's rows are right while the caller computes
                    assert np.array_equal(store.data[slot].numpy(), ROWS[layer * E + e])
                assert (s[~m] == -1).all()
            assert seen.all(), "some routed entry was never served"
            assert_kernel_view_correct(store)
            continue
        before_pinned = store.pinned_keys() if store._step_open and layer > store._last_layer else set()
        uniq = set(ids)
        try:
            out = store.ensure(layer, np.asarray(ids)[None, :], prefill=False)
        except StoreCapacityError:
            # Only legitimate when this step's pins plus this call do not fit.
            assert len(store.pinned_keys() | {(layer, e) for e in uniq}) > slots
            assert_kernel_view_correct(store)
            continue
        out = out.numpy().reshape(-1)
        for e, s in zip(ids, out):
            assert np.array_equal(store.data[s].numpy(), ROWS[layer * E + e])
        resident = store.resident()
        assert before_pinned <= resident, "an expert pinned by the current step was evicted"
        assert {(layer, e) for e in uniq} <= store.pinned_keys()
        assert_kernel_view_correct(store)
    store.close()


@pytest.mark.parametrize("kind", ["host", "pagecache", "arena", "arena-file"])
def test_random_history_every_tier(kind, tmp_path):
    store = ExpertStore(_backing(kind, tmp_path), 9, decay=0.8)
    rng = np.random.default_rng(3)
    for step in range(60):
        prefill = step % 15 == 7
        for layer in range(L):
            ids = rng.integers(0, E, (12 if prefill else 1, 2))
            if prefill:
                for _ in store.ensure_chunks(layer, ids, prefill=True):
                    pass
            else:
                store.ensure(layer, ids)
        assert_kernel_view_correct(store)
    store.close()


def test_step_pins_hold_and_overflow_is_a_clear_error():
    store = ExpertStore(_backing("host"), 5)
    store.ensure(0, [[0, 1]])
    store.ensure(1, [[2, 3]])
    calls = store.stats()["decode"]["calls"]
    with pytest.raises(StoreCapacityError) as ei:
        store.ensure(2, [[4, 5]])  # 4 pinned + 2 new > 5 slots
    assert store.stats()["decode"]["calls"] == calls  # a refused call is not counted as served
    msg = str(ei.value)
    assert "gpu_expert_cache_gib" in msg and "max_num_seqs" in msg and "4 pinned" in msg
    assert {(0, 0), (0, 1), (1, 2), (1, 3)} <= store.resident()
    assert_kernel_view_correct(store)
    store.ensure(0, [[4, 5]])  # layer restarts: new step, old pins released, room again
    assert {(0, 4), (0, 5)} <= store.resident()
    assert_kernel_view_correct(store)


def test_refused_layer_can_be_retried_in_chunks_within_the_same_step():
    """The op's fallback: ensure() refuses, ensure_chunks() on the same layer computes it; still one step."""
    store = ExpertStore(_backing("host"), 4, protected_share=0.0)
    store.ensure(0, [[0, 1]])
    with pytest.raises(StoreCapacityError):
        store.ensure(1, [[2, 3, 4]])
    served = []
    for mask, slots in store.ensure_chunks(1, np.array([[2, 3, 4]])):
        served += np.array([2, 3, 4])[mask.numpy()[0]].tolist()
        assert (slots.numpy()[mask.numpy()] >= 0).all()
    assert sorted(served) == [2, 3, 4]
    store.ensure(2, [[0]])  # the step goes on at the next layer
    store.begin_step()
    assert store.stats()["decode"]["steps"] + store.stats()["prefill"]["steps"] == 1
    assert_kernel_view_correct(store)


def test_eviction_prefers_cold_rows():
    store = ExpertStore(_backing("host"), 4, decay=0.9)
    for _ in range(6):  # (0,0) and (0,1) hot
        store.ensure(0, [[0, 1]])
    store.ensure(0, [[2]])
    store.ensure(0, [[3]])
    store.ensure(0, [[4]])  # full: evicts the colder of 2 / 3 (2, older), never 0 or 1
    assert store.resident() == {(0, 0), (0, 1), (0, 3), (0, 4)}


def test_scan_resistance_prefill_keeps_decode_hot_set():
    store = ExpertStore(_backing("host"), 12, decay=0.95, protected_share=0.7, prefill_tokens=32)
    hot = {layer: [layer, layer + 1] for layer in range(L)}  # 8 hot rows < 0.7 x 12
    for _ in range(20):
        for layer in range(L):
            store.ensure(layer, [hot[layer]])
    hot_keys = {(layer, e) for layer, es in hot.items() for e in es}
    assert hot_keys <= store.resident()
    prefill_ids = np.tile(np.arange(E), (40, 1))[:, :8]  # a long prompt touching most experts of every layer
    for layer in range(L):
        chunks = 0
        for mask, slots in store.ensure_chunks(layer, prefill_ids, num_tokens=40, prefill=None):
            chunks += 1
            s = slots.numpy()[mask.numpy()]
            assert (s >= 0).all()
        assert chunks >= 2  # it could not fit at once without touching the hot set
        assert hot_keys <= store.resident(), "prefill evicted the decode hot set"
    assert_kernel_view_correct(store)
    # Prefill feeds no decode heat and is counted apart.
    assert store.stats()["prefill"]["routings"] == 40 * 8 * L
    with pytest.raises(StoreCapacityError, match="hot set"):
        store.ensure(0, prefill_ids, prefill=True)  # one call larger than the unprotected room


def test_stats_match_a_hand_computed_history(caplog):
    store = ExpertStore(_backing("host"), 20, kpi_every_steps=2)
    caplog.set_level(logging.INFO, logger="moetplan.store")
    # step 1: all 4 routings miss (3 unique rows); step 2: all hit; step 3: 1 of 2 routings misses
    store.ensure(0, [[1, 2], [1, 3]])
    store.ensure(0, [[1, 2]])
    store.ensure(0, [[1, 5]])
    store.begin_step()
    s = store.stats()
    assert s["decode"]["steps"] == 3
    assert s["token_hit_rate"] == pytest.approx(3 / 8)
    assert s["zero_miss_step_share"] == pytest.approx(1 / 3)
    assert s["misses_per_step"] == pytest.approx(4 / 3)
    assert s["bytes_fetched"]["host"] == 4 * S and s["bytes_fetched"]["nvme"] == 0
    assert s["h2d_gbps"] and s["h2d_gbps"] > 0
    json.dumps(s)  # the run record takes it as is
    resident = store.resident()
    store.reset_stats()  # e.g. after vLLM's profiling runs
    s = store.stats()
    assert s["decode"]["steps"] == 0 and s["token_hit_rate"] is None and s["bytes_fetched"]["host"] == 0
    assert store.resident() == resident and store.heat().max() > 0
    assert any("hit=" in r.message and "zero-miss=" in r.message for r in caplog.records)


def test_arena_stats_and_nvme_bytes():
    store = ExpertStore(_backing("arena"), 3)
    store.ensure(0, [[0, 1, 2]])
    store.ensure(0, [[3]])  # evicts a slot; arena keeps 4 rows
    store.ensure(0, [[0, 1, 2]])  # one of them was evicted from the pool but is still in the arena
    s = store.stats()
    assert s["bytes_fetched"]["nvme"] == 4 * S and s["bytes_fetched"]["host"] == S
    assert s["arena_hit_rate"] == pytest.approx(1 / 5)


def test_prefetch_fills_free_slots_and_never_displaces_hotter_rows():
    store = ExpertStore(_backing("host"), 4, protected_share=0.0)
    for _ in range(5):
        store.ensure(0, [[0, 1, 2]])
    assert store.prefetch(1, [5, 6]) == 1  # one free slot; the others are hotter than an unseen expert
    assert (1, 5) in store.resident() or (1, 6) in store.resident()
    assert {(0, 0), (0, 1), (0, 2)} <= store.resident()
    assert store.stats()["prefetched_rows"] == 1
    before = store.stats()["decode"]["misses"]
    store.begin_step()
    hit = 5 if (1, 5) in store.resident() else 6
    store.ensure(1, [[hit]])
    assert store.stats()["decode"]["misses"] == before  # the prefetched row was a hit
    assert_kernel_view_correct(store)


def test_bad_calls_name_the_problem():
    store = ExpertStore(_backing("host"), 4)
    with pytest.raises(UsageError, match="outside 0..9"):
        store.ensure(0, [[E]])
    with pytest.raises(UsageError, match="layer 7"):
        store.ensure(7, [[0]])
    with pytest.raises(UsageError, match="protected_share"):
        ExpertStore(_backing("host"), 4, protected_share=1.0)


def test_the_store_factory_sizes_the_store_as_the_runtime_section_says():
    src = _backing("host").source
    host = expert_store(RuntimeSection(expert_tier="host", gpu_expert_cache_slots=6), src)
    assert host.pool.num_slots == 6 and type(host.backing).__name__ == "PinnedHostStore"
    arena = expert_store(RuntimeSection(expert_tier="nvme", gpu_expert_cache_slots=4, host_arena_rows=3), src)
    assert type(arena.backing).__name__ == "PackArenaStore" and arena.backing.arena_rows == 3
    assert type(expert_store(RuntimeSection(expert_tier="nvme", gpu_expert_cache_slots=4), src).backing).__name__ == \
        "PackPageCacheStore"  # no arena rows: the page cache is the RAM tier
    with pytest.raises(UsageError, match="resident"):
        expert_store(RuntimeSection(expert_tier="resident", gpu_expert_cache_slots=6), src)
    with pytest.raises(ConfigError, match="re-plan"):
        expert_store(RuntimeSection(expert_tier="host", gpu_expert_cache_slots=6, expert_row_bytes=src.stride + 4096),
                     src)


def test_the_cache_floor_is_checked_once_where_the_plan_becomes_the_runtime_section():
    """A tiered section without a slot is refused where it is made (plan load, launch, worker), before any pack
    is written; the fix is named."""
    with pytest.raises(ConfigError, match=r"expert_tier 'host' needs at least 1 .*--set gpu_expert_cache_gib"):
        RuntimeSection(expert_tier="host")
    assert RuntimeSection(expert_tier="resident").gpu_expert_cache_slots == 0  # resident: no cache, no floor


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["host", "pagecache", "arena"])
def test_cuda_pool_matches_pack_rows(kind):
    src = ArrayRowSource(ROWS, L, E)
    backing = {"host": lambda: PinnedHostStore(src, pin=True),
               "pagecache": lambda: PackPageCacheStore(src, pin=True, staging_rows=2),
               "arena": lambda: PackArenaStore(src, 6, pin=True)}[kind]()
    store = ExpertStore(backing, 8, device="cuda", protected_share=0.5)
    assert store.residency.is_cuda and store.data.is_cuda and store.residency.dtype == torch.int32
    rng = np.random.default_rng(5)
    for step in range(40):
        for layer in range(L):
            if step % 10 == 9:  # a prefill layer, computed in chunks
                ids = rng.integers(0, E, (16, 2))
                for mask, slots in store.ensure_chunks(layer, torch.from_numpy(ids).cuda(), prefill=True):
                    m = mask.cpu().numpy()
                    got = store.data[slots[mask].long()].cpu().numpy()
                    assert np.array_equal(got, ROWS[layer * E + ids[m]])
                continue
            ids = torch.from_numpy(rng.integers(0, E, (1, 2))).cuda()
            if step % 3 == 0 and layer + 1 < L:
                store.prefetch(layer + 1, rng.integers(0, E, 2))
            slots = store.ensure(layer, ids)
            # What a kernel does: read the rows through residency[layer] on the compute stream.
            via_table = store.residency[layer][ids.reshape(-1)]
            assert torch.equal(via_table, slots.reshape(-1))
            got = store.data[slots.reshape(-1).long()].cpu().numpy()
            assert np.array_equal(got, ROWS[layer * E + ids.reshape(-1).cpu().numpy()])
    store.synchronize()
    assert_kernel_view_correct(store)
    s = store.stats()
    assert s["h2d_gbps"] > 0 and s["decode"]["misses"] > 0
    store.close()


def test_coalesce_merges_adjacent_rows_into_one_copy():
    from moetplan.runtime.store.slots import coalesce_runs

    src = torch.arange(10 * 64, dtype=torch.int64).to(torch.uint8).view(10, 64)
    views = [src[2], src[3], src[4], src[7], src[1]]
    runs = coalesce_runs(views, [5, 6, 7, 8, 9], 64)
    assert [(r.shape[0], s0) for r, s0 in runs] == [(3, 5), (1, 8), (1, 9)]
    assert torch.equal(runs[0][0], src[2:5])
    # Slots out of order: pairs are sorted by slot, and rows only merge when both sides are consecutive.
    runs = coalesce_runs([src[4], src[3]], [1, 0], 64)
    assert [(r.shape[0], s0) for r, s0 in runs] == [(2, 0)] and torch.equal(runs[0][0], src[3:5])


@pytest.mark.gpu
def test_cuda_copy_waits_for_kernels_still_reading_a_victim_slot():
    """A kernel queued on the compute stream must read the old row even if the next ensure() evicts its slot."""
    store = ExpertStore(PinnedHostStore(ArrayRowSource(ROWS, L, E), pin=True), 4, device="cuda",
                        protected_share=0.0)
    store.ensure(0, [[0, 1, 2, 3]])
    before = store.residency[0].cpu().numpy().copy()
    store.begin_step()
    torch.cuda._sleep(200_000_000)  # keep the compute stream busy (~0.1 s) ...
    snap = store.data.clone()  # ... so this read of the layer-0 rows is still queued
    store.ensure(1, [[4, 5, 6, 7]])  # evicts every layer-0 slot from the host right away
    torch.cuda.synchronize()
    for e in range(4):
        assert np.array_equal(snap[before[e]].cpu().numpy(), ROWS[e]), "a victim slot was overwritten too early"
    assert_kernel_view_correct(store)
    store.close()


def test_chunks_progress_even_when_the_step_pinned_every_slot():
    store = ExpertStore(_backing("host"), 6, protected_share=0.5)
    store.ensure(0, [[0, 1, 2, 3, 4]])
    store.ensure(1, [[0]])  # the step now pins all 6 slots
    served = []
    for mask, slots in store.ensure_chunks(2, np.array([[0, 5]]), prefill=True):
        served += np.array([0, 5])[mask.numpy()[0]].tolist()
        for e, s in zip(np.array([0, 5])[mask.numpy()[0]], slots.numpy()[mask.numpy()]):
            assert np.array_equal(store.data[s].numpy(), ROWS[2 * E + e])
    assert sorted(served) == [0, 5]
    assert_kernel_view_correct(store)
