"""Plan vs run: the rows `moetplan diff plan.json run.json` renders."""
from __future__ import annotations

import pytest

from moetplan.report.compare import COMPARED_METRICS, compare, error_pct, placement_mismatches
from fake_server import FakeOpenAIServer, FakeServerConfig
from moetplan.measure.phases import run_bench
from moetplan.contract import RunRecord
from test_bench_helpers import tiny_plan


def rows_by_metric(rows: list) -> dict:
    return {r["metric"]: r for r in rows}


def test_every_metric_gets_a_row_with_its_error() -> None:
    plan = tiny_plan()
    run = RunRecord(
        measured={"decode_tok_s": 80.0, "prefill_tok_s": 6000.0, "prefill_len": 2048, "ttft_ms": 25.0,
                  "batch_curve": {"1": 80.0, "2": 198.0, "8": 400.0}, "aggregate_tok_s": 400.0,
                  "aggregate_concurrency": 8},
        runtime={"token_hit_rate": 0.81, "zero_miss_step_share": 0.5, "misses_per_step": 4.5},
    )
    rows = compare(plan, run)
    assert [r["metric"] for r in rows] == [m for m, _ in COMPARED_METRICS]
    r = rows_by_metric(rows)
    assert r["decode_tok_s"]["error_pct"] == pytest.approx(-20.0)
    assert r["prefill_tok_s"]["error_pct"] == pytest.approx(20.0) and "2048" in r["prefill_tok_s"]["note"]
    assert r["ttft_ms"]["error_pct"] == pytest.approx(25.0) and r["ttft_ms"]["note"] == ""
    assert r["token_hit_rate"]["error_pct"] == pytest.approx(-10.0) and r["token_hit_rate"]["source"] == "runtime"
    assert r["zero_miss_step_share"]["error_pct"] == 0.0
    assert r["misses_per_step"]["error_pct"] == pytest.approx(50.0)
    # aggregate is compared at the plan's concurrency (2), not the highest measured (8)
    agg = r["aggregate_tok_s"]
    assert agg["measured"] == 198.0 and agg["source"] == "measured.batch_curve[2]"
    assert agg["error_pct"] == pytest.approx(10.0)


def test_missing_sides_are_kept_as_gaps() -> None:
    plan = tiny_plan({"ttft_ms": None, "token_hit_rate": None})
    run = RunRecord(measured={"decode_tok_s": 100.0, "ttft_ms": 30.0})
    r = rows_by_metric(compare(plan, run))
    assert r["decode_tok_s"]["error_pct"] == 0.0
    assert r["ttft_ms"]["predicted"] is None and r["ttft_ms"]["error_pct"] is None
    assert "not predicted" in r["ttft_ms"]["note"]
    assert r["prefill_tok_s"]["measured"] is None and "not measured" in r["prefill_tok_s"]["note"]
    assert r["token_hit_rate"]["measured"] is None and r["token_hit_rate"]["predicted"] is None


def test_aggregate_at_another_concurrency_is_flagged() -> None:
    run = RunRecord(measured={"aggregate_tok_s": 300.0, "aggregate_concurrency": 8, "batch_curve": {"8": 300.0}})
    agg = rows_by_metric(compare(tiny_plan(concurrency=4), run))["aggregate_tok_s"]
    assert agg["measured"] == 300.0 and "not like for like" in agg["note"]


def test_error_pct_edges() -> None:
    assert error_pct(0.0, 5.0) is None
    assert error_pct(None, 5.0) is None and error_pct(5.0, None) is None
    assert error_pct(200.0, 150.0) == -25.0


def test_placement_mismatch() -> None:
    plan = tiny_plan(concurrency=2)
    same = RunRecord(placement=plan.placement.model_dump(mode="json"))
    assert placement_mismatches(plan, same) == []
    other = RunRecord(placement={**plan.placement.model_dump(mode="json"), "expert_tier": "host", "tp": 2})
    assert placement_mismatches(plan, other) == ["expert_tier: plan 'resident', run 'host'", "tp: plan 1, run 2"]
    assert placement_mismatches(plan, RunRecord()) == []


def test_bench_record_compares_against_its_plan() -> None:
    plan = tiny_plan(concurrency=2)
    with FakeOpenAIServer(FakeServerConfig(decode_tok_s=500.0, prefill_tok_s=50000.0)) as srv:
        run = run_bench(srv.url, plan=plan, prompt_lens=(128,), concurrency=(1,), runs=2, max_tokens=48,
                        needle_lens=(), probes=False, timeout=5.0)
    r = rows_by_metric(compare(plan, run))
    for metric in ("decode_tok_s", "aggregate_tok_s", "prefill_tok_s", "ttft_ms"):
        assert r[metric]["measured"] == pytest.approx(
            run.measured["batch_curve"]["2"] if metric == "aggregate_tok_s" else run.measured[metric])
        assert r[metric]["error_pct"] is not None
    assert r["ttft_ms"]["note"] == f"at ~{run.measured['ttft_prompt_tokens']} prompt tokens"
    assert placement_mismatches(plan, run) == []
