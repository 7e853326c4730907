"""The KV layout a plan books is the one vLLM serves: DeepSeek-V4's KV cache is fp8_ds_mla whatever
--kv-cache-dtype says (hwdb `kv_dtype_forced`, with the vLLM source lines in its status), so its plans carry that
layout, their KV GiB and tokens are its bytes per token, and a bf16 plan (a pin, or one written before the fact) is
never sized or launched as bf16."""
from __future__ import annotations

import pydantic
import pytest

from moetplan import hwdb
from moetplan.contract import Goals, GIB, Placement
from moetplan.contract.errors import UsageError
from moetplan.plan import ledger as L
from moetplan.plan.solver import parse_set, search, solve


def _h200():
    return hwdb.inline_profile("1xh200", 256)


def test_the_fact_lives_in_hwdb_with_its_source():
    ds4 = hwdb.model_spec("deepseek-v4-flash")
    assert ds4.kv_dtype_forced == "fp8" and ds4.kv_dtypes() == ["fp8"]
    status = hwdb.model_entry("deepseek-v4-flash")["status"]["kv_dtype_forced"]
    assert "_resolve_dsv4_kv_cache_dtype" in status and "fp8_ds_mla" in status
    # Models vLLM serves in the dtype it is told keep every layout.
    glm = hwdb.model_spec("glm-5.2")
    assert glm.kv_dtype_forced is None and set(glm.kv_dtypes()) >= {"bf16", "fp8"}


def test_a_resident_h200_ds4_plan_books_fp8_ds_mla_bytes():
    ds4 = hwdb.model_spec("deepseek-v4-flash")
    per_token = ds4.kv_bytes_per_token["fp8"]
    assert per_token < ds4.kv_bytes_per_token["bf16"]  # the bf16 row's size is never what the plan books
    hw = _h200()
    assert {c.placement.kv_dtype for c in search(ds4, hw, Goals())} == {"fp8"}
    plan = solve(ds4, hw, Goals())
    p = plan.placement
    assert p.expert_tier == "resident" and p.kv_dtype == "fp8"
    # KV GiB and the tokens vLLM will report agree through fp8_ds_mla's bytes per token.
    assert p.kv_tokens == int(p.kv_cache_gib * GIB // per_token)
    assert p.kv_tokens * per_token <= p.kv_cache_gib * GIB < (p.kv_tokens + 1) * per_token
    # The window's floor: fp8 tokens + the fixed raw windows + the in-flight state, all in the served layout.
    floor = (per_token * p.context + ds4.kv_fixed_bytes_per_seq["fp8"] * p.max_num_seqs
             + ds4.kv_inflight_bytes_per_token["fp8"] * min(p.max_num_batched_tokens, p.context)) / GIB
    assert L.kv_needed_gib(ds4, p) == pytest.approx(floor)
    kv_item = next(i for gpu in plan.memory.gpus for i in gpu.items if i.name == "kv_cache")
    assert f"{per_token:,.0f} B/token" in kv_item.note and "kv_dtype_forced" in kv_item.note
    reason = next(r.text for r in plan.reasons if r.knob == "kv_dtype")
    assert "the only layout vLLM serves" in reason and "DeepseekV4ForCausalLM" in reason


def test_a_bf16_pin_on_ds4_is_refused_naming_the_served_layout():
    with pytest.raises(UsageError, match=r"only as fp8.*pin kv_dtype=fp8"):
        solve(hwdb.model_spec("deepseek-v4-flash"), _h200(), Goals(pinned=parse_set(["kv_dtype=bf16"])))
    pinned = solve(hwdb.model_spec("deepseek-v4-flash"), _h200(), Goals(pinned=parse_set(["kv_dtype=fp8"])))
    assert pinned.placement.kv_dtype == "fp8"


def test_a_bf16_placement_is_sized_and_launched_as_served():
    """A plan written before the fact (kv_dtype bf16) books, and launches, what vLLM allocates."""
    from moetplan.launch.command import vllm_kv_cache_dtype

    ds4 = hwdb.model_spec("deepseek-v4-flash")
    bf16 = Placement.for_model(ds4, kv_dtype="bf16", context=32768, kv_cache_gib=4.0, max_num_batched_tokens=512)
    fp8 = Placement.for_model(ds4, kv_dtype="fp8", context=32768, kv_cache_gib=4.0, max_num_batched_tokens=512)
    assert ds4.kv_bytes("bf16", 1000, seqs=2) == ds4.kv_bytes("fp8", 1000, seqs=2)
    assert L.kv_tokens(ds4, bf16) == L.kv_tokens(ds4, fp8)
    assert L.kv_needed_gib(ds4, bf16) == pytest.approx(L.kv_needed_gib(ds4, fp8))
    plan = solve(ds4, _h200(), Goals())
    old = plan.model_copy(update={"placement": plan.placement.model_copy(update={"kv_dtype": "bf16"})})
    assert vllm_kv_cache_dtype(old) == vllm_kv_cache_dtype(plan) != "auto"
    # Without the fact, bf16 stays bf16.
    glm = hwdb.model_spec("glm-5.2")
    assert glm.kv_bytes("bf16", 1000) > glm.kv_bytes("fp8", 1000)


def test_a_forced_layout_must_be_one_the_model_has():
    ds4 = hwdb.model_spec("deepseek-v4-flash")
    with pytest.raises(pydantic.ValidationError, match="kv_dtype_forced 'nvfp4'"):
        type(ds4).model_validate({**ds4.model_dump(), "kv_dtype_forced": "nvfp4"})
