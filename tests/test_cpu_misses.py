"""Misses served where cheapest (issue 39): the probe's CPU expert rate in hw.json, the cost model's split of a
tiered step's misses between the CPU and the link, the plan's CPU share, and the split path computing misses on
the CPU from the pinned host rows."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from moetplan import hwdb
from moetplan.cli import app
from moetplan.contract import HardwareProfile, Placement, Plan, save_json
from moetplan.contract.layout import RowLayout
from moetplan.cost_model import predict
from moetplan.cost_model.cpu_compute import cpu_miss_ratio, layer_split
from moetplan.cost_model.terms import MISS_HOST
from moetplan.runtime.op import cpu_kernels
from moetplan.runtime.op.reference import moe_forward_reference
from moetplan.runtime.store.backing import ArrayRowSource, PinnedHostStore
from moetplan.runtime.store.store import ExpertStore
from moetplan.runtime.vllm.layer import LayerState
from test_cost_model import CAL, toy_hw, toy_model
from test_launch_runtime import workers  # noqa: F401 (the fixture)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# --------------------------------------------------------------------------- cost model and plan


def test_layer_split_takes_the_cpu_only_where_it_finishes_sooner():
    assert layer_split(1.0, 0.0) == (0.0, 1.0)
    assert layer_split(1.0, 0.5) == (0.0, 1.0)  # one miss, a CPU half as fast: fetch it
    share, factor = layer_split(1.0, 2.0)  # one miss, a CPU twice as fast: compute it, in half the time
    assert share == 1.0 and factor == pytest.approx(0.5)
    share, factor = layer_split(4.0, 1.0)  # equal speeds: half each, both at once
    assert share == 0.5 and factor == pytest.approx(0.5)
    mid, _ = layer_split(1.5, 1.0)  # between 1 (none) and 2 (half) misses
    assert mid == pytest.approx(1 / 3)


def _host_tier(model, hw, cpu_gbps, moe_graphs="split"):
    hw.host.cpu_expert_gbps = cpu_gbps
    pl = Placement.for_model(model, expert_tier="host", gpu_expert_cache_gib=0.05, moe_graphs=moe_graphs)
    pl.cpu_miss_ratio = cpu_miss_ratio(hw, pl)
    return pl, predict(model, hw, pl, CAL)


def test_a_cpu_faster_per_miss_than_the_link_takes_a_share_and_a_slower_one_none():
    model = toy_model()
    pl_fast, fast = _host_tier(model, toy_hw(h2d=25.0), 60.0)  # 8-channel server next to PCIe 4
    pl_slow, slow = _host_tier(model, toy_hw(h2d=25.0), 5.0)  # a laptop-class CPU
    _, unprobed = _host_tier(model, toy_hw(h2d=25.0), None)
    assert pl_fast.cpu_miss_ratio == pytest.approx(2.4) and pl_slow.cpu_miss_ratio == pytest.approx(0.2)
    assert fast.cpu_miss_share is not None and fast.cpu_miss_share > 0
    assert slow.cpu_miss_share == 0.0 and unprobed.cpu_miss_share == 0.0

    def miss_ms(p):
        return next(t.ms for t in p.terms if t.name == MISS_HOST)

    assert miss_ms(fast) < miss_ms(slow) == miss_ms(unprobed)
    assert "computed on the CPU" in next(t.note for t in fast.terms if t.name == MISS_HOST)
    # the replay path fetches every miss: no CPU share claimed there, a note names the split path's
    _, replay = _host_tier(model, toy_hw(h2d=25.0), 60.0, moe_graphs="replay")
    assert replay.cpu_miss_share == 0.0 and any("moe_graphs=split" in n for n in replay.notes)
    # resident plans have no misses to split
    assert predict(model, toy_hw(), Placement(), CAL).cpu_miss_share is None


def test_no_cpu_rate_for_other_tiers_or_without_a_gpu():
    model = toy_model()
    hw = toy_hw()
    hw.host.cpu_expert_gbps = 60.0
    assert cpu_miss_ratio(hw, Placement.for_model(model, expert_tier="nvme", gpu_expert_cache_gib=0.05)) == 0.0
    assert cpu_miss_ratio(hw, Placement.for_model(model, expert_tier="host", gpu_expert_cache_gib=0.05, tp=1)) > 0


@pytest.mark.parametrize("cpu_gbps, share", [(200.0, "positive"), (5.0, "zero")])
def test_plan_shows_the_cpu_share_from_the_probe(tmp_path, cpu_gbps, share):
    hw = hwdb.box_profile("rtx-5090x1")
    hw.host.cpu_expert_gbps = cpu_gbps
    path = tmp_path / "hw.json"
    save_json(hw, path)
    args = ["plan", "--model", "qwen3-30b-a3b", "--hw", str(path), "--set", "expert_tier=host",
            "--set", "gpu_expert_cache_gib=4", "--set", "moe_graphs=split"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["placement"]["cpu_miss_ratio"] == pytest.approx(cpu_miss_ratio(hw, Placement(**{
        k: v for k, v in doc["placement"].items() if k in Placement.model_fields})), rel=1e-3)
    got = doc["prediction"]["cpu_miss_share"]
    assert (got > 0) if share == "positive" else (got == 0.0)
    assert Plan.model_validate(doc).runtime.cpu_miss_ratio == doc["placement"]["cpu_miss_ratio"]  # the worker's
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0 and "computed on the CPU" in table.output
    off = CliRunner().invoke(app, [*args, "--set", "cpu_miss_ratio=0", "--json"])  # the knob turns it off
    assert off.exit_code == 0 and json.loads(off.stdout)["prediction"]["cpu_miss_share"] == 0.0


def test_old_hw_json_without_the_cpu_rate_still_loads():
    hw = hwdb.box_profile("rtx-5090x1").model_dump(mode="json")
    hw["host"].pop("cpu_expert_gbps", None)
    assert HardwareProfile.model_validate(hw).host.cpu_expert_gbps is None


# --------------------------------------------------------------------------- probe


def test_probe_records_the_cpu_expert_rate(cpu_mod, monkeypatch):
    from moetplan.hw import profile_probe

    monkeypatch.setattr(profile_probe, "CPU_PROBE_EXPERT", (256, 128))  # a small expert: a quick test
    hw = HardwareProfile(host={"ram_gib": 8.0})
    details: dict = {}
    profile_probe.measure_cpu_experts(hw, quick=True, details=details)
    assert hw.host.cpu_expert_gbps and hw.host.cpu_expert_gbps > 0
    assert hw.host.sources["cpu_expert_gbps"] == "measured" and details["cpu_experts"]["isa"] == cpu_kernels.best_isa(cpu_mod)
    # without the kernels the field stays absent and the probe says why
    monkeypatch.setattr(cpu_kernels, "get_module", lambda: None)
    monkeypatch.setattr(cpu_kernels, "fallback_reason", lambda: "no C++ compiler")
    bare = HardwareProfile(host={"ram_gib": 8.0})
    profile_probe.measure_cpu_experts(bare, quick=True, details=details)
    assert bare.host.cpu_expert_gbps is None and "no C++ compiler" in details["cpu_experts"]


# --------------------------------------------------------------------------- runtime (split path)


class _Tiers:
    def __init__(self, store: ExpertStore):
        self.store = store

    def get(self) -> ExpertStore:
        return self.store


def _rows(lay: RowLayout, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 256, (n, lay.stride), dtype=torch.uint8, generator=g)
    for off, size in ((lay.w13_s_off, lay.w13_s_size), (lay.w2_s_off, lay.w2_s_size)):
        rows[:, off:off + size] = torch.randint(118, 133, (n, size), dtype=torch.uint8, generator=g)
    return rows


def test_misses_computed_on_the_cpu_give_the_fetched_result_and_the_reference(cpu_mod):
    """The split path (moe_graphs=split, tier host): one layer's misses computed on the CPU from the pinned host
    rows, at three CPU/link ratios (0: all fetched; 2: shared; 100: all on the CPU), against the torch reference."""
    L, E, H, I, k = 2, 8, 256, 128, 4
    lay = RowLayout.for_expert(H, I, fmt="2bit")
    rows = _rows(lay, L * E, 3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, H, generator=g) * 0.1
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(3)])
    w = torch.rand(3, k, generator=g)
    ref = moe_forward_reference(x, ids, w, rows[E:2 * E], torch.arange(E), lay)
    outs, stats = {}, {}
    for ratio in (0.0, 2.0, 100.0):
        store = ExpertStore(PinnedHostStore(ArrayRowSource(rows.numpy(), L, E), pin=False), 12)
        st = LayerState(key=1, moe_index=1, name="l1", fmt="2bit", tier="host", num_experts=E, hidden=H, inter=I,
                        layout=lay, store=_Tiers(store), cpu_miss_ratio=ratio)
        outs[ratio] = st.forward(x, w, ids)
        stats[ratio] = store.stats()
    routed = len(torch.unique(ids))
    assert stats[0.0]["cpu_computed_rows"] == 0 and stats[0.0]["bytes_fetched"]["host"] == routed * lay.stride
    assert 0 < stats[2.0]["cpu_computed_rows"] < routed  # both links at once
    assert stats[100.0]["cpu_computed_rows"] == routed and stats[100.0]["bytes_fetched"]["host"] == 0
    # the CPU's misses count as misses and feed the heat, as fetched ones do
    assert len({(s["decode"]["misses"], s["decode"]["routings"], s["token_hit_rate"]) for s in stats.values()}) == 1
    assert stats[2.0]["decode"]["misses"] == routed
    for ratio, y in outs.items():
        assert y.shape == x.shape and _rel(y, ref) < 2e-2, ratio  # the CPU kernels' tolerance (q8_0 activations)
        # the same kernels, the same per-pair sums: only the order of the final additions differs
        assert _rel(y, outs[0.0]) < 1e-5, ratio


def test_a_split_host_plan_wires_its_ratio_into_the_worker_layers(cpu_mod, tmp_path, workers):  # noqa: F811
    """The plan's cpu_miss_ratio reaches the split path's layers through the worker (RuntimeSection), and a decode
    call there computes misses on the CPU and gives the reference's result."""
    from test_launch_runtime import _load_through_method, _plan, _routing

    plan = _plan(expert_tier="host", gpu_expert_cache_slots=4, moe_graphs="split", cpu_miss_ratio=100.0)
    w, _ = _load_through_method(plan, workers, tmp_path)
    st = w.layers[1]
    assert st.cpu_miss_ratio == 100.0 and st.store is not None
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(5))  # a decode step (max_num_seqs 1)
    ids, wt = _routing(1, 2, 8)
    got = st.forward(x, wt, ids)
    store = st.store.get()
    rows, slot_of = store.backing.layer_rows(1)
    ref = moe_forward_reference(x, ids, wt, rows, slot_of, st.layout)
    assert store.stats()["cpu_computed_rows"] > 0 and _rel(got, ref) < 2e-2
