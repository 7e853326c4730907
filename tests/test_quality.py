"""The quality harness: metrics, the quantized-expert plumbing, the checkpoint cache, and a small end-to-end run."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moetplan import hwdb
from moetplan.contract.errors import UsageError
from moetplan.runtime.offline import quality as Q
from moetplan.runtime.format.format import dequantize_2bit, dequantize_fp4, quantize_2bit, quantize_fp4
from moetplan.runtime.reserve.gate import GateController
from moetplan.runtime.reserve.reserve import FP4Reserve

FLOOR = float(hwdb.guards()["fp4_gate"]["floor_factor"])  # the planner's gate floor
SMALL = Q.TinyMoeSpec(hidden=64, moe_inter=64, experts=8, top_k=2, layers=2, heads=2, kv_heads=1, vocab=320,
                      train_steps=2, seq_len=32, batch=2)


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = SMALL.hf_config()
    cfg.initializer_range = 0.2  # peaked enough that 2-bit visibly differs
    return Qwen3MoeForCausalLM(cfg).eval()


def test_compare_metrics():
    a = torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    same = Q.compare(a, a.clone())
    assert same["agreement"] == 1.0 and abs(same["kl"]) < 1e-12
    b = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    d = Q.compare(a, b)
    p = torch.softmax(a[1].double(), -1)
    want = float((p * (torch.log_softmax(a[1].double(), -1) - torch.log_softmax(b[1].double(), -1))).sum()) / 2
    assert d["agreement"] == 0.5 and math.isclose(d["kl"], want, rel_tol=1e-9)


def _replaced(ref, fmt):
    """The float model with every expert replaced by its dequantized `fmt` weights (the HF path computes)."""
    import copy

    m = copy.deepcopy(ref)
    q, dq = (quantize_2bit, dequantize_2bit) if fmt == "2bit" else (quantize_fp4, dequantize_fp4)
    with torch.no_grad():
        for dec in m.model.layers:
            ex = dec.mlp.experts
            for e in range(ex.gate_up_proj.shape[0]):
                ex.gate_up_proj[e] = dq(*q(ex.gate_up_proj[e]))
                ex.down_proj[e] = dq(*q(ex.down_proj[e]))
    return m


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_quantized_experts_compute_what_the_format_says(model):
    ids = torch.randint(3, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    state = Q.VariantState()
    qm = Q.quantize_model(model, state)
    with torch.no_grad():
        got2 = qm(input_ids=ids).logits
        want2 = _replaced(model, "2bit")(input_ids=ids).logits
        ref = model(input_ids=ids).logits
    # moe_forward runs the CPU kernels here: within their tolerance (docs/CPU_KERNELS.md, int8 activations, ~1e-2
    # per layer), far inside the 2-bit format's own distance from the float experts
    # (measured 0.087 through this random 2-layer model, whose 2-bit format error is 0.63)
    assert _rel(got2, want2) < 0.12, "2-bit rows + moe_forward must equal the dequantized HF experts"
    assert _rel(got2, ref) > 5 * _rel(got2, want2)
    # every expert in the reserve: the FP4 computation
    src = Q.fp4_source(model)
    r = FP4Reserve(src, SMALL.layers * SMALL.experts, layout=src.layout, background=False)
    r.promote_now([(l, e) for l in range(SMALL.layers) for e in range(SMALL.experts)])
    state.reserve = r
    with torch.no_grad():
        got4 = qm(input_ids=ids).logits
        want4 = _replaced(model, "fp4")(input_ids=ids).logits
    assert _rel(got4, want4) < 0.12
    assert r.stats()["fp4_routing_share"] == 1.0


def test_decode_logits_matches_full_forward(model):
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(1))
    inc = Q.decode_logits(model, ids, prompt=5)
    with torch.no_grad():
        full = model(input_ids=ids.reshape(1, -1)).logits[0, 4:19].float()
    assert inc.shape == full.shape == (15, SMALL.vocab)
    assert torch.allclose(inc, full, atol=1e-4)


def test_gate_off_decode_is_bit_identical(model):
    ids = torch.randint(3, 300, (16,), generator=torch.Generator().manual_seed(2))
    outs = []
    for mode in ("reserve", "gate-off"):
        state = Q.VariantState()
        qm = Q.quantize_model(model, state)
        src = Q.fp4_source(model)
        r = FP4Reserve(src, 6, layout=src.layout, background=False)
        r.promote_now([(0, 1), (1, 2), (1, 5)])
        state.reserve = r
        gate = GateController(r, enabled=False, tau=0.9) if mode == "gate-off" else None
        state.gate = gate
        outs.append(Q.decode_logits(qm, ids, 4, gate=gate, reserve=r, maintain=True))
    assert torch.equal(outs[0], outs[1])


def test_checkpoint_cache_trains_once(tmp_path, monkeypatch):
    spec = replace(SMALL, train_steps=3)
    monkeypatch.setattr(Q, "TRAIN_MODULES", ("colorsys", "bisect"))
    m1, tok, info = Q.load_or_train(spec, tmp_path)
    assert info["steps"] == 3 and tok.get_vocab_size() <= spec.vocab
    dirs = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert len(dirs) == 1 and (dirs[0] / "info.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")], "temp dir left behind"

    def boom(*a, **k):
        raise AssertionError("trained again instead of reading the cache")

    monkeypatch.setattr(Q, "train_tiny_moe", boom)
    m2, _, info2 = Q.load_or_train(spec, tmp_path)
    assert info2 == info
    p1, p2 = m1.model.layers[0].mlp.experts.down_proj, m2.model.layers[0].mlp.experts.down_proj
    assert torch.equal(p1, p2)


def test_run_quality_end_to_end_small(model, monkeypatch):
    from moetplan.runtime.offline.quality import build_tokenizer, module_text

    monkeypatch.setattr(Q, "TRAIN_MODULES", ("colorsys",))
    tok = build_tokenizer(module_text(("colorsys", "bisect")), SMALL.vocab)
    res = Q.run_quality(model, tok, Q.QualityConfig(tau=0.9, eval_tokens=40, prompt=8, warmup_tokens=64,
                                                     gate_floor_factor=FLOOR))
    for k in ("two_bit", "reserve", "reserve_gate"):
        assert 0.0 <= res[k]["agreement"] <= 1.0 and res[k]["kl"] >= 0 and res[k]["positions"] == 33
    g = res["reserve_gate"]["gate"]
    assert g["steps"] == 32 and g["fires"] >= 1 and g["promotions"] <= g["fires"] * res["setup"]["max_promotions_per_step"]
    assert isinstance(res["monotonic"], bool)


def test_reserve_slots_follow_the_gate_floor():
    cfg = SMALL.hf_config()
    slots, step_set = Q.reserve_slots(cfg, Q.QualityConfig(reserve_share=0.25, gate_floor_factor=FLOOR))
    assert FLOOR == 1.7 and step_set == 2 * 2 and slots == 4 + math.ceil(1.7 * 4)
    with pytest.raises(UsageError, match="gate_floor_factor"):
        Q.reserve_slots(cfg, Q.QualityConfig())


def test_bench_result_file_is_well_formed():
    p = Path(__file__).resolve().parents[1] / "bench" / "results" / "quality_tiny.json"
    if not p.exists():
        pytest.skip("bench/results/quality_tiny.json not generated yet (python bench/quality.py)")
    d = json.loads(p.read_text())
    assert {"machine", "results", "model", "command"} <= d.keys()
    a = [d["results"][k]["agreement"] for k in ("two_bit", "reserve", "reserve_gate")]
    assert d["results"]["monotonic"] == (a[0] < a[1] < a[2])


def test_tokenizer_vocab_floor_is_explained():
    from moetplan.contract.errors import UsageError

    with pytest.raises(UsageError, match="byte-level floor"):
        Q.build_tokenizer("abc", 128)
