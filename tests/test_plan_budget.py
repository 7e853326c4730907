"""max_num_batched_tokens is weighed by the objective on a tiered store: fewer batched tokens shrink the activation
peak and DeepSeek-V4's in-flight KV floor (~0.41 MiB per token), which the GPU expert cache gets (decode), and
cost prefill (more chunks). A pinned budget is kept; a resident plan keeps vLLM's default."""
from __future__ import annotations

import pytest

from moetplan import hwdb
from moetplan.contract import Goals
from moetplan.cost_model import predict
from moetplan.plan import ledger as L
from moetplan.plan.candidates import BudgetOption, pick_budget
from moetplan.plan.solver import parse_set, search, size_placement, solve


def _consumer():
    return hwdb.inline_profile("1xrtx-5090", 96)


def _default_small() -> int:
    return int(L.guards()["planner"]["batched_tokens_default_small"])


def test_a_consumer_tiered_ds4_plan_trades_batched_tokens_for_expert_cache():
    ds4, hw = hwdb.model_spec("deepseek-v4-flash"), _consumer()
    plan = solve(ds4, hw, Goals())
    p = plan.placement
    assert p.expert_tier != "resident" and p.max_num_batched_tokens < _default_small()
    # The same discrete choice and window at vLLM's default budget: less cache, slower decode, faster prefill.
    at_default, why = size_placement(ds4, hw, Goals(), {}, p.tp, p.pp, p.expert_tier, p.kv_dtype, p.mtp, p.context)
    assert at_default is not None and at_default.max_num_batched_tokens == _default_small(), why
    assert p.gpu_expert_cache_slots > at_default.gpu_expert_cache_slots
    gained = (p.gpu_expert_cache_slots - at_default.gpu_expert_cache_slots) * p.expert_row_bytes / 2**30
    assert gained >= 0.3  # GiB: the in-flight floor and the activation peak it no longer books
    base = predict(ds4, hw, at_default)
    assert plan.prediction.decode_tok_s > base.decode_tok_s
    assert plan.prediction.token_hit_rate > base.token_hit_rate
    assert plan.prediction.prefill_tok_s < base.prefill_tok_s  # the price, stated in the reason
    # Balanced gives up at most its own tolerance of decode for prefill.
    keep = L.guards()["planner"]["balanced_keep_decode"]
    fastest = solve(ds4, hw, Goals(objective="decode"))
    assert fastest.placement.max_num_batched_tokens <= p.max_num_batched_tokens
    assert fastest.prediction.decode_tok_s >= plan.prediction.decode_tok_s
    reason = next(r.text for r in plan.reasons if r.knob == "max_num_batched_tokens")
    assert f"{p.max_num_batched_tokens} vs {_default_small()}" in reason and "in-flight KV floor" in reason
    assert "expert cache" in reason and "prefill" in reason and "objective 'balanced'" in reason
    assert f"within {1 - keep:.0%} of the best decode" in reason
    assert "KV floor" in reason  # where the cache came from: DeepSeek-V4's in-flight state per batched token
    from rich.console import Console

    from moetplan.report.plan_view import placement_table

    console = Console(width=240, record=True)
    console.print(placement_table(plan))
    row = next(ln for ln in console.export_text().splitlines() if "max_num_batched_tokens" in ln)
    assert f"{p.max_num_batched_tokens}" in row and "Weighed" in row


@pytest.mark.parametrize("budget", [2048, 512])
def test_a_pinned_budget_is_kept(budget):
    ds4, hw = hwdb.model_spec("deepseek-v4-flash"), _consumer()
    plan = solve(ds4, hw, Goals(pinned=parse_set([f"max_num_batched_tokens={budget}"])))
    assert plan.placement.max_num_batched_tokens == budget
    reason = next(r.text for r in plan.reasons if r.knob == "max_num_batched_tokens")
    assert reason.startswith(f"pinned (--set). {budget}:")


def test_a_resident_plan_keeps_vllms_default():
    plan = solve(hwdb.model_spec("deepseek-v4-flash"), hwdb.inline_profile("1xh200", 256), Goals())
    p = plan.placement
    assert p.expert_tier == "resident"
    assert p.max_num_batched_tokens == L.guards()["planner"]["batched_tokens_default_large"]
    assert "frees no expert cache on a resident plan" in next(
        r.text for r in plan.reasons if r.knob == "max_num_batched_tokens")


def test_a_weighed_budget_always_holds_a_whole_decode_step():
    """max_num_seqs x (1 + MTP) tokens is one decode step: a smaller budget would throttle decode, not speed it."""
    ds4, hw = hwdb.model_spec("deepseek-v4-flash"), _consumer()
    weighed = {}
    for seqs in (64, 128, 192):
        pins = parse_set(["mtp=2", "expert_tier=host", "context=32768", f"max_num_seqs={seqs}"])
        (c,) = search(ds4, hw, Goals(pinned=pins))
        weighed[seqs] = c.budgets_sized
        assert min(weighed[seqs]) >= seqs * 3 and c.placement.max_num_batched_tokens >= seqs * 3
    assert min(weighed[64]) < min(weighed[128]) < min(weighed[192])  # the floor binds, and moves with the step


def _picker(options: list[BudgetOption]):
    asked: list[int] = []

    def option(i: int) -> BudgetOption:
        asked.append(i)
        return options[i]
    return option, asked


def test_pick_budget_follows_the_objective():
    def opt(t: int, dec: float, pre: float) -> BudgetOption:
        return BudgetOption(t, 10.0, 1.0, dec, pre, None)

    options = [opt(2048, 38.0, 1400), opt(1024, 39.5, 900), opt(512, 39.9, 650), opt(256, 40.0, 500)]
    for objective, want in (("decode", 256), ("balanced", 1024), ("context", 1024)):
        # balanced / context: the largest budget within balanced_keep_decode (0.97) of the best decode (40 -> 38.8)
        option, asked = _picker(options)
        assert options[pick_budget(len(options), option, objective)].max_num_batched_tokens == want
        assert len(set(asked)) <= 3  # the ends and the edge of the run, not every budget
    # A budget that buys no decode is never taken.
    flat = [opt(2048, 40.0, 1400), opt(1024, 40.0, 900), opt(512, 40.0, 650)]
    assert {pick_budget(3, _picker(flat)[0], o) for o in ("decode", "balanced", "context")} == {0}
    assert pick_budget(1, _picker(flat[:1])[0], "decode") == 0


def test_decode_never_falls_as_the_budget_shrinks():
    """pick_budget predicts only part of the budgets because more expert cache never slows decode: checked on every
    budget the consumer DS4 plan and a tiered GLM-5.2 plan size."""
    from moetplan.plan.solver import size_budgets

    for model, hw, choice in (("deepseek-v4-flash", _consumer(), (1, 1, "host", "fp8", 2, 262144)),
                              ("glm-5.2", hwdb.box_profile("rtx-5090x4"), (4, 1, "host", "fp8", 2, 32768))):
        spec = hwdb.model_spec(model)
        ps, why = size_budgets(spec, hw, Goals(), {}, *choice)
        assert len(ps) >= 3, why
        decode = [predict(spec, hw, p).decode_tok_s for p in ps]
        assert decode == sorted(decode) and decode[-1] > decode[0], (model, decode)
        prefill = [predict(spec, hw, p).prefill_tok_s for p in ps]
        assert prefill == sorted(prefill, reverse=True)
