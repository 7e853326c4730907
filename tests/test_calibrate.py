"""Calibration: checked-in constants meet the error bar, the fit is reproducible, `moetplan calibrate` round trip."""
from __future__ import annotations

import json
import statistics

import pytest
import typer
from typer.testing import CliRunner

from moetplan import hwdb
from moetplan.cost_model import load_calibration, predict
from moetplan.cost_model.calibration import (
    PARAMS,
    Calibration,
    FitRow,
    Prior,
    fit_linear,
    linear_value,
    user_calibration_path,
)
from moetplan.cli.calibrate import calibrate_command
from moetplan.cost_model.dataset import load_reference
from moetplan.cost_model.fitting import evaluate, fit
from moetplan.contract.errors import ConfigError, UsageError
from moetplan.contract import Placement


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETPLAN_CONFIG_DIR", str(tmp_path / "config"))


@pytest.fixture(scope="module")
def reference():
    return load_reference()


def test_reference_table_loads_every_row(reference):
    # Both published files: 11 rows (r01..) and 16 more (m01..: batch curves, FP4 pools, the gate, PP4, drafter),
    # and the FACTS.md figure with its recipe (f01: GLM-5.2 on all three tiers, 2x PRO 6000).
    assert len(reference) == 28
    assert {m.row_id for m in reference} == ({f"r{i:02d}" for i in range(1, 12)} | {f"m{i:02d}" for i in range(1, 17)}
                                             | {"f01"})
    f01 = next(m for m in reference if m.row_id == "f01").placement
    assert (f01.tp, f01.expert_tier, f01.context, f01.gpu_memory_utilization) == (2, "nvme", 131072, 0.90)
    # Its MTP depth is assumed and its figure a range: judged, never fitted. So is m16, the only separate-drafter row
    # (its acceptance assumed in the source): judged at the drafter's published acceptance.
    assert [m.row_id for m in reference if m.check] == ["m16", "f01"]
    m16 = next(m for m in reference if m.row_id == "m16")
    assert m16.placement.mtp_acceptance == pytest.approx(2.41)  # the drafter's model card, not hwdb's served figure
    assert "f01" not in fit(reference, scan_stream_overlap=False).fitted_on
    assert {m.model.id for m in reference} == {"deepseek-v4-flash", "glm-5.2", "kimi-k2.7-code"}
    assert sum(1 for m in reference if m.prefill_tok_s) == 6
    gated = {m.row_id: m.placement.gate for m in reference if m.placement.gate.enabled}
    assert set(gated) == {"m04", "m06", "m08", "m13"} and gated["m08"].tau == 1.0
    split = next(m for m in reference if m.row_id == "m07").placement
    plain = split.fp4_reserve_gib * 2**30 / hwdb.model_spec("deepseek-v4-flash").expert_bytes("fp4", 2)
    assert split.fp4_reserve_slots == pytest.approx(plain * 8 / 5, abs=1)  # the split format holds 1.6x the rows
    pp4 = next(m for m in reference if m.row_id == "m11").placement
    assert (pp4.tp, pp4.pp) == (1, 4)


def test_the_served_drafter_acceptance_is_what_its_one_row_implies(reference):
    """hwdb's Kimi drafter acceptance (what the planner uses) is derived from m16 at the checked-in factors: the
    figure m16 implies at the modelled step cost. A refit that moves the step cost shows up here."""
    calib = load_calibration(user=False)
    m16 = next(m for m in reference if m.row_id == "m16")
    (r,) = [r for r in evaluate([m16], calib) if r.metric == "decode_tok_s"]
    implied = m16.placement.mtp_acceptance * r.measured / r.predicted
    assert m16.model.mtp_accept(2) == pytest.approx(implied, rel=0.05)


def test_checked_in_constants_meet_the_error_bar(reference):
    calib = load_calibration(user=False)
    results = [r for r in evaluate([m for m in reference if not m.check], calib) if r.metric != "prefill_tok_s"]
    assert len(results) == 26
    errs = sorted(abs(r.error) for r in results)
    median = statistics.median(errs)
    assert median <= 0.08  # in-sample median over decode and aggregate figures
    # bench/calibrate.py records the leave-one-out figures next to the in-sample ones.
    s = calib.summary
    assert s["leave_one_out_median_abs_error"] <= 0.12
    assert s["in_sample_median_abs_error"] == pytest.approx(median, abs=1e-3)


def test_checked_in_constants_are_what_the_fit_gives(reference):
    calib = load_calibration(user=False)
    refit = fit(reference)
    assert refit.routing.stream_overlap == calib.routing.stream_overlap
    fam = "sm120"
    for p in PARAMS:
        scope, name = p.split(".", 1)
        src = {"family": (refit.families[fam], calib.families[fam]), "link": (refit.links, calib.links),
               "routing": (refit.routing, calib.routing)}[scope]
        assert getattr(src[0], name) == pytest.approx(getattr(src[1], name), rel=2e-3), \
            f"{p}: rerun bench/calibrate.py --write"


def test_fit_linear_recovers_known_factors():
    truth = {"family.dense_bw_eff": 0.6, "family.step_overhead_ms": 2.5, "link.fetch_overhead_mib": 0.8}
    priors = {p: Prior(v * 1.4, 1.0, "") for p, v in truth.items()}
    rows = []
    for i in range(1, 7):
        coefs = {"family.dense_bw_eff": 3.0 * i, "family.step_overhead_ms": 1.0, "link.fetch_overhead_mib": float((7 - i) ** 2)}
        t = sum(c * linear_value(p, truth[p]) for p, c in coefs.items())
        rows.append(FitRow(f"r{i}", coefs, 0.0, t))
    got = fit_linear(rows, priors, list(truth), meas_sigma=0.001)
    for p, v in truth.items():
        assert got[p] == pytest.approx(v, rel=0.01)


def _run_record(path, placement: Placement, decode: float, prefill: float | None = None):
    measured = {"decode_tok_s": decode}
    if prefill:
        measured.update(prefill_tok_s=prefill, prefill_prompt_tokens=8192)
    path.write_text(json.dumps({"kind": "run", "schema_version": "1.0", "model_id": "deepseek-v4-flash",
                                "placement": placement.model_dump(), "measured": measured}))
    return path


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(calibrate_command)
    return app


def test_calibrate_round_trip(tmp_path):
    ds4, hw = hwdb.model_spec("deepseek-v4-flash"), hwdb.box_profile("rtx-5090x1")
    h200 = hwdb.inline_profile("1xh200", host_ram_gib=256)
    other_before = predict(ds4, h200, Placement()).decode_tok_s
    runs = []
    truth = {}
    for cache in (8.0, 11.0, 14.0):
        pl = Placement.for_model(ds4, expert_tier="host", gpu_expert_cache_gib=cache, context=32768, mtp=2,
                                 mtp_acceptance=2.7)
        p = predict(ds4, hw, pl)
        # This machine is slower than the reference box: 60% of the predicted decode, 70% of prefill.
        truth[cache] = 0.6 * p.decode_tok_s
        runs.append(_run_record(tmp_path / f"run{cache:g}.json", pl, truth[cache], 0.7 * p.prefill_tok_s))
    res = CliRunner().invoke(_app(), [*map(str, runs), "--box", "rtx-5090x1", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["before"]["median_abs_error"] > 0.3
    assert out["after"]["median_abs_error"] < 0.1
    assert out["written_to"] == str(user_calibration_path())

    calib = load_calibration(hw)
    assert calib.overrides_from == str(user_calibration_path())
    for cache, want in truth.items():
        pl = Placement.for_model(ds4, expert_tier="host", gpu_expert_cache_gib=cache, context=32768, mtp=2,
                                 mtp_acceptance=2.7)
        assert predict(ds4, hw, pl, calib).decode_tok_s == pytest.approx(want, rel=0.12)
    # Another GPU family keeps the checked-in factors.
    assert predict(ds4, h200, Placement()).decode_tok_s == pytest.approx(other_before)
    # Without the user layer, the checked-in factors are untouched.
    assert load_calibration(hw, user=False).links == Calibration.model_validate(
        load_calibration(hw, user=False).model_dump()).links


def test_calibrate_takes_the_gate_recompute_share_from_gated_runs(tmp_path):
    from moetplan.contract import Gate
    from moetplan.cost_model.dataset import gate_fire_share

    # 43 MoE layers; 30 of 200 decode steps fired: 30 * 43 second-pass MoE calls.
    rt = {"gate_recompute_moe_calls": 30 * 43, "moe_layers": 43, "decode_steps_timed": 200, "steps": 230}
    assert gate_fire_share(rt) == pytest.approx(0.15)
    assert gate_fire_share({"moe_layers": 43}) is None
    assert gate_fire_share({**rt, "gate_fire_share": 0.12}) == pytest.approx(0.12)  # the gate's own figure first
    ds4, hw = hwdb.model_spec("deepseek-v4-flash"), hwdb.box_profile("rtx-5090x1")
    checked_in = load_calibration(hw).routing
    tau = 0.5
    pl = Placement.for_model(ds4, tp=1, context=32768, fp4_reserve_gib=2.0, gate=Gate(enabled=True, tau=tau))
    runs = []
    for i, share in enumerate((0.05, 0.1, 0.075)):
        path = _run_record(tmp_path / f"gated{i}.json", pl, 0.8 * predict(ds4, hw, pl).decode_tok_s)
        d = json.loads(path.read_text())
        d["runtime"] = {"gate_recompute_moe_calls": int(share * 200) * 43, "moe_layers": 43, "decode_steps_timed": 200}
        path.write_text(json.dumps(d))
        runs.append(path)
    res = CliRunner().invoke(_app(), [*map(str, runs), "--box", "rtx-5090x1", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)["gate_recompute_share"]
    # Measured at tau 0.5, the share is taken back to tau 1 through tau^gate_tau_exponent: median of the three runs.
    want = 0.075 / tau ** checked_in.gate_tau_exponent
    assert out["before"] == pytest.approx(checked_in.gate_recompute_share) and out["after"] == pytest.approx(want)
    assert sorted(m["share"] for m in out["measured"]) == pytest.approx([0.05, 0.075, 0.1])
    calib = load_calibration(hw)
    assert calib.routing.gate_recompute_share == pytest.approx(want)
    assert calib.gate_share(tau) == pytest.approx(0.075)
    res = CliRunner().invoke(_app(), [*map(str, runs), "--box", "rtx-5090x1", "--dry-run"])
    assert res.exit_code == 0 and "FP4 gate recomputed" in res.output, res.output


def test_calibrate_keeps_the_old_factors_when_the_refit_is_worse(tmp_path, monkeypatch):
    import moetplan.cost_model.refit as command

    pl = Placement.for_model(hwdb.model_spec("ds4"), expert_tier="host", gpu_expert_cache_gib=11, context=32768,
                             mtp=2, mtp_acceptance=2.7)
    hw = hwdb.box_profile("rtx-5090x1")
    run = _run_record(tmp_path / "run.json", pl, predict(hwdb.model_spec("ds4"), hw, pl).decode_tok_s)
    real_fit = command.fit

    def bad_fit(*a, **kw):  # a refit that lands far from the records it was given
        calib = real_fit(*a, **kw)
        fam = calib.families["sm120"].model_copy(update={"expert_bw_eff": 0.05})
        return calib.model_copy(update={"families": {**calib.families, "sm120": fam}})

    monkeypatch.setattr(command, "fit", bad_fit)
    res = CliRunner().invoke(_app(), [str(run), "--box", "rtx-5090x1", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["worse_than_before"] and out["kept_previous"] and out["written_to"] is None
    assert out["after"]["median_abs_error"] > out["before"]["median_abs_error"]
    assert not user_calibration_path().exists()
    res = CliRunner().invoke(_app(), [str(run), "--box", "rtx-5090x1"])
    assert "not written" in res.output and "--force" in res.output
    res = CliRunner().invoke(_app(), [str(run), "--box", "rtx-5090x1", "--force", "--json"])
    assert json.loads(res.output)["written_to"] == str(user_calibration_path())
    assert load_calibration(hw).family(hw).expert_bw_eff == pytest.approx(0.05)


def test_calibrate_reads_records_of_tiny_models(tmp_path):
    """A run record of `moetplan run --model tiny-moe` names the tiny model; its plan need not be at hand."""
    from moetplan.contract import HostInfo, HardwareProfile, save_json

    hw = HardwareProfile(gpus=[], host=HostInfo(ram_gib=24, cores=2, dram_gbps=10.0))
    save_json(hw, tmp_path / "hw.json")
    for name in ("tiny-moe", "tiny-moe-mla", "tiny-moe-fp8"):
        pl = Placement(context=2048, kv_dtype="bf16")
        rec = tmp_path / f"{name}.json"
        rec.write_text(json.dumps({"kind": "run", "model_id": name, "placement": pl.model_dump(),
                                   "measured": {"decode_tok_s": 5.0}}))
        res = CliRunner().invoke(_app(), [str(rec), "--hw", str(tmp_path / "hw.json"), "--dry-run", "--json"])
        assert res.exit_code == 0, (name, res.output)
        assert json.loads(res.output)["family"] == "cpu"


def test_calibrate_table_output_and_dry_run(tmp_path):
    pl = Placement.for_model(hwdb.model_spec("deepseek-v4-flash"), expert_tier="host", gpu_expert_cache_gib=11,
                             context=32768, mtp=2, mtp_acceptance=2.7)
    run = _run_record(tmp_path / "run.json", pl, 20.0)
    res = CliRunner().invoke(_app(), [str(run), "--box", "rtx-5090x1", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "median |error|" in res.output and "not written" in res.output
    assert not user_calibration_path().exists()


def test_calibrate_errors_name_the_fix(tmp_path):
    res = CliRunner().invoke(_app(), [str(tmp_path / "missing.json"), "--box", "rtx-5090x1"])
    assert res.exit_code == 2 and "moetplan bench" in res.output and "Traceback" not in res.output
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "run", "model_id": "deepseek-v4-flash", "placement": {}, "measured": {}}))
    res = CliRunner().invoke(_app(), [str(bad), "--box", "rtx-5090x1"])
    assert res.exit_code == 2 and "decode_tok_s" in res.output
    res = CliRunner().invoke(_app(), [str(bad)])
    assert res.exit_code == 2 and "--box" in res.output


def test_malformed_user_calibration_names_the_file():
    path = user_calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("families:\n  sm120:\n    dense_bw_eff: fast\n")
    with pytest.raises(ConfigError, match="calibration.yaml"):
        load_calibration()


def test_calibrate_is_registered_in_the_cli():
    from moetplan.cli import app

    names = {c.name for c in app.registered_commands}
    assert "calibrate" in names


def test_calibrate_fits_miss_correlation_from_runtime_kpis(tmp_path):
    """A run whose runtime reports the zero-miss step share pins the correlation the tok/s alone cannot."""
    glm, hw = hwdb.model_spec("glm-5.2"), hwdb.box_profile("rtx-pro-6000x4")
    pl = Placement.for_model(glm, tp=4, expert_tier="host", gpu_expert_cache_gib=44, context=16384, mtp=0)
    base = load_calibration(hw)
    rho_true = 0.05
    truth = base.model_copy(update={"routing": base.routing.model_copy(update={"miss_correlation": rho_true})})
    p = predict(glm, hw, pl, truth)
    assert 0.05 < p.zero_miss_step_share < 0.95  # the share is informative at this cache size
    rec = {"kind": "run", "model_id": "glm-5.2", "placement": pl.model_dump(),
           "measured": {"decode_tok_s": p.decode_tok_s},
           "runtime": {"zero_miss_step_share": p.zero_miss_step_share, "token_hit_rate": p.token_hit_rate}}
    run = tmp_path / "glm.json"
    run.write_text(json.dumps(rec))
    res = CliRunner().invoke(_app(), [str(run), "--box", "rtx-pro-6000x4", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["miss_correlation"]["after"] == pytest.approx(rho_true, rel=0.15)
    zm = out["miss_correlation"]["zero_miss_step_share"][0]
    assert abs(zm["predicted_after"] - zm["measured"]) < abs(zm["predicted_before"] - zm["measured"]) + 1e-9
    assert load_calibration(hw).routing.miss_correlation == pytest.approx(out["miss_correlation"]["after"])


def _cpu_plan(tmp_path):
    """A plan for a tiny MoE on a host without GPU (vLLM's CPU backend), as the end-to-end runs use."""
    from moetplan.contract.model import Attention, ModelSpec
    from moetplan.contract import HostInfo, HardwareProfile, MemoryLedger, Plan, save_json

    model = ModelSpec(id="local:tiny-moe", name="tiny", num_layers=4, moe_layers=4, hidden_size=256,
                      moe_intermediate_size=128, n_routed_experts=16, top_k=2, vocab_size=4096,
                      max_position_embeddings=4096, attention=Attention(kind="gqa", num_heads=4, num_kv_heads=2,
                                                                         head_dim=64),
                      kv_bytes_per_token={"bf16": 4096.0, "fp8": 2048.0}, kv_shards_with_tp=True,
                      non_routed_params_b=0.004, dense_precision="bf16")
    hw = HardwareProfile(gpus=[], host=HostInfo(ram_gib=24, cores=2, dram_gbps=10.0))
    pl = Placement(context=2048, kv_dtype="bf16")
    plan = Plan(model=model, hardware=hw, placement=pl, memory=MemoryLedger(), prediction=predict(model, hw, pl))
    save_json(plan, tmp_path / "plan.json")
    return model, hw, pl, plan


def test_cpu_host_is_one_rank_with_its_own_family(tmp_path):
    model, hw, pl, plan = _cpu_plan(tmp_path)
    calib = load_calibration(hw)
    assert calib.family(hw) == calib.families["cpu"]
    assert plan.prediction.decode_tok_s > 0 and plan.prediction.prefill_tok_s > 0
    with pytest.raises(UsageError, match="CPU serving is one rank"):
        predict(model, hw, pl.model_copy(update={"tp": 2}))


def test_calibrate_reads_bench_records_on_a_cpu_run(tmp_path):
    """`moetplan bench` records (prefill_by_len, batch_curve) against the CPU-served tiny model, via its plan."""
    model, hw, pl, plan = _cpu_plan(tmp_path)
    measured = {
        "decode_tok_s": 0.5 * plan.prediction.decode_tok_s, "ttft_prompt_tokens": 40,
        "prefill_by_len": {"128": 300.0, "512": 420.0}, "prefill_prompt_tokens": {"128": 131, "512": 515},
        "prefill_tok_s": 420.0, "prefill_len": 512,
        "batch_curve": {"1": 0.5 * plan.prediction.decode_tok_s, "4": 1.6 * plan.prediction.decode_tok_s},
        "aggregate_tok_s": 1.6 * plan.prediction.decode_tok_s, "aggregate_concurrency": 4,
    }
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"kind": "run", "plan_path": "plan.json", "measured": measured}))
    res = CliRunner().invoke(_app(), [str(run), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["family"] == "cpu"
    assert {r["row"] for r in out["rows"]} == {"run.json:decode", "run.json:prefill@128", "run.json:prefill@512",
                                                "run.json:aggregate@4"}
    assert out["after"]["median_abs_error"] < out["before"]["median_abs_error"]
    # The GPU families are untouched by a CPU refit.
    assert load_calibration(hwdb.box_profile("rtx-5090x1")).family(hwdb.box_profile("rtx-5090x1")) == \
        load_calibration(user=False).families["sm120"]


def test_a_user_file_from_before_the_drafter_factor_was_retired_still_loads():
    """An older `moetplan calibrate` wrote drafter_overhead_ms; the model prices a drafter pass from its bytes and
    the MTP rows' proposer cost now, so the key is dropped, and the rest of the refit still applies."""
    path = user_calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("families:\n  sm120:\n    drafter_overhead_ms: 9.8\n    step_overhead_ms: 3.25\n")
    calib = load_calibration(hwdb.box_profile("rtx-5090x1"))
    assert calib.family(hwdb.box_profile("rtx-5090x1")).step_overhead_ms == 3.25
    assert not hasattr(calib.family(hwdb.box_profile("rtx-5090x1")), "drafter_overhead_ms")
