"""Routing traces: synthetic skew behaves as asked, replay reports the Plan's KPIs vs cache size."""
from __future__ import annotations

import json

import numpy as np
import pytest

from moetplan.contract.errors import UsageError
from moetplan.cli.replay import replay_command
from moetplan.runtime.offline.trace import Trace, fit_skew, replay, replay_curve, run_replay, synthetic_trace


def test_synthetic_trace_shape_determinism_and_distinct_topk():
    a = synthetic_trace(5, 32, 4, 50, tokens=3, seed=1)
    b = synthetic_trace(5, 32, 4, 50, tokens=3, seed=1)
    c = synthetic_trace(5, 32, 4, 50, tokens=3, seed=2)
    assert a.ids.shape == (50, 5, 3, 4) and a.num_experts == 32
    assert np.array_equal(a.ids, b.ids) and not np.array_equal(a.ids, c.ids)
    srt = np.sort(a.ids, axis=-1)
    assert (np.diff(srt, axis=-1) > 0).all(), "top-k picks must be distinct experts"
    assert a.ids.min() >= 0 and a.ids.max() < 32


def test_skew_concentrates_routing():
    flat = synthetic_trace(4, 64, 4, 200, skew=0.0, drift=0.0, seed=0).coverage([0.2])[0.2]
    skewed = synthetic_trace(4, 64, 4, 200, skew=2.0, drift=0.5, seed=0).coverage([0.2])[0.2]
    assert flat < 0.33  # uniform routing: top 20% serve ~20% (plus sampling noise of 800 picks over 64)
    assert skewed > 0.8


def test_temporal_correlation_raises_hit_rate():
    kw = dict(skew=0.5, drift=2.0, layer_corr=0.0, seed=3)
    slow = synthetic_trace(4, 64, 4, 200, temporal=0.98, **kw)
    fast = synthetic_trace(4, 64, 4, 200, temporal=0.0, **kw)
    r_slow, r_fast = replay(slow, 48, warmup_steps=20), replay(fast, 48, warmup_steps=20)
    assert r_slow["token_hit_rate"] > r_fast["token_hit_rate"] + 0.05


def test_layer_correlation_links_consecutive_layers():
    """With layer correlation, the preference noise of layer l predicts layer l+1's picks through the link."""
    def agreement(lc: float) -> float:
        tr = synthetic_trace(2, 32, 1, 3000, skew=0.0, drift=3.0, temporal=0.0, layer_corr=lc, seed=9)
        joint = np.zeros((32, 32))
        np.add.at(joint, (tr.ids[:, 0, 0, 0], tr.ids[:, 1, 0, 0]), 1)
        return float(joint.max(axis=1).sum() / joint.sum())  # how well layer 0's pick predicts layer 1's

    assert agreement(0.9) > agreement(0.0) + 0.1


def test_replay_kpis_and_monotone_in_cache_size():
    tr = synthetic_trace(6, 48, 4, 150, skew=1.2, seed=0)
    rows = replay_curve(tr, [24, 72, 144, 288], warmup_steps=30)
    hits = [r["token_hit_rate"] for r in rows]
    assert all(0 <= h <= 1 for h in hits)
    assert hits == sorted(hits)
    # The whole model cached: the only misses are first touches after warm-up.
    seen_early = {(l, e) for l in range(6) for e in np.unique(tr.ids[:30, l])}
    seen_all = {(l, e) for l in range(6) for e in np.unique(tr.ids[:, l])}
    assert rows[-1]["misses_per_step"] * rows[-1]["steps"] == pytest.approx(len(seen_all - seen_early))
    assert rows[0]["misses_per_step"] > rows[1]["misses_per_step"]
    assert rows[0]["steps"] == 120
    json.dumps(rows)


def test_replay_with_prefetch_runs_and_counts_hits():
    tr = synthetic_trace(3, 32, 2, 80, skew=1.0, temporal=0.95, seed=4)
    base = replay(tr, 30, warmup_steps=10)
    pre = replay(tr, 30, warmup_steps=10, prefetch=True)
    assert pre["token_hit_rate"] >= base["token_hit_rate"] - 0.02  # a hint never makes the cache much worse


def test_fit_skew_hits_a_published_coverage_point():
    s = fit_skew(64, 4, 0.19, 0.9, layers=3, steps=150)
    cov = synthetic_trace(3, 64, 4, 150, skew=s).coverage([0.19])[0.19]
    assert cov == pytest.approx(0.9, abs=0.02)
    with pytest.raises(UsageError):
        fit_skew(64, 4, 1.5, 0.9)


def test_save_load_round_trip_and_bad_files(tmp_path):
    tr = synthetic_trace(2, 16, 2, 10, seed=5)
    tr.save(tmp_path / "t.npz")
    back = Trace.load(tmp_path / "t.npz")
    assert np.array_equal(back.ids, tr.ids) and back.num_experts == 16 and back.meta["skew"] == 1.0
    np.save(tmp_path / "raw.npy", tr.ids[:, :, 0, :])  # [steps, layers, top_k]: one token per step
    raw = Trace.load(tmp_path / "raw.npy", num_experts=16)
    assert raw.ids.shape == (10, 2, 1, 2)
    (tmp_path / "bad.npz").write_bytes(b"nope")
    with pytest.raises(UsageError, match="not a routing trace"):
        Trace.load(tmp_path / "bad.npz")
    with pytest.raises(UsageError, match="does not exist"):
        Trace.load(tmp_path / "missing.npz")
    with pytest.raises(UsageError, match="outside"):
        Trace(np.full((1, 1, 1, 1), 20, dtype=np.int32), 16)
    with pytest.raises(UsageError, match="top_k"):
        synthetic_trace(2, 4, 5, 10)


def _cli():
    import typer

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(replay_command)
    return app


def test_command_line_json_and_table(tmp_path):
    from typer.testing import CliRunner

    out = tmp_path / "curve.json"
    r = CliRunner().invoke(_cli(), ["--layers", "3", "--experts", "16", "--top-k", "2", "--steps", "40",
                                    "--shares", "0.2,0.5", "--json", "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert json.loads(out.read_text()) == doc
    assert [row["slots"] for row in doc["curve"]] == [10, 24] and doc["trace"]["experts"] == 16
    r = CliRunner().invoke(_cli(), ["--layers", "3", "--experts", "16", "--top-k", "2", "--steps", "20"])
    assert r.exit_code == 0 and "zero-miss" in r.stdout
    r = CliRunner().invoke(_cli(), ["--trace", str(tmp_path / "missing.npz")])
    assert isinstance(r.exception, UsageError) and "does not exist" in str(r.exception)
    r = CliRunner().invoke(_cli(), ["--shares", "0.2,x"])
    assert isinstance(r.exception, UsageError) and "--shares" in str(r.exception)


def test_model_shape_comes_from_hwdb_and_skew_is_fitted():
    from moetplan import hwdb

    spec = hwdb.model_spec("deepseek-v4-flash")
    doc = run_replay(model=hwdb.model_spec("deepseek-v4-flash"), steps=12, shares=(0.19,), warmup=4)
    t = doc["trace"]
    assert (t["layers"], t["experts"], t["top_k"]) == (spec.moe_layers, spec.n_routed_experts, spec.top_k)
    assert tuple(t["skew_fitted_to"]) == tuple(spec.coverage_points[0]) and t["skew"] > 0


def test_registered_as_moetplan_replay():
    from typer.testing import CliRunner

    from moetplan.cli import app

    r = CliRunner().invoke(app, ["replay", "--layers", "2", "--experts", "8", "--top-k", "2", "--steps", "10",
                                 "--shares", "0.5", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["curve"][0]["slots"] == 8


def test_recorder_stacks_decode_steps_and_replays(tmp_path):
    import torch

    from moetplan.runtime.offline.trace import TraceRecorder

    src = synthetic_trace(3, 16, 2, 20, seed=8)
    rec = TraceRecorder(3, 16)
    for s in range(20):
        for layer in range(3):
            rec.observe(layer, torch.from_numpy(src.ids[s, layer]))
        if s == 10:  # an odd-shaped step (2 tokens) and a partial one are skipped, not stacked
            for layer in range(3):
                rec.observe(layer, np.zeros((2, 2), dtype=np.int64))
            rec.observe(0, np.zeros((1, 2), dtype=np.int64))
    tr = rec.trace()
    assert np.array_equal(tr.ids, src.ids) and rec.skipped_steps == 2
    tr.save(tmp_path / "rec.npz")
    assert replay(Trace.load(tmp_path / "rec.npz"), 12)["steps"] == 20
    with pytest.raises(UsageError, match="no complete"):
        TraceRecorder(3, 16).trace()
