"""The confidence gate: off is bit-identical, fires promote exactly the firing step's experts, bounded, counted."""
from __future__ import annotations

import pytest
import torch

from moetplan.contract.errors import ConfigError, UsageError
from moetplan.runtime.format.format import RowLayout, pack_expert_row
from moetplan.runtime.reserve.gate import GateController, run_record_kpis
from moetplan.runtime.op.ops import moe_forward
from moetplan.runtime.reserve.reserve import FP4Reserve
from moetplan.runtime.reserve.reserve_sources import QuantizingRowSource

L, E, H, I, V = 2, 8, 64, 64, 16
LAY2 = RowLayout.for_expert(H, I, 1, "2bit")
LAY4 = RowLayout.for_expert(H, I, 1, "fp4")
_g = torch.Generator().manual_seed(1)
W13 = torch.randn(L, E, 2 * I, H, generator=_g) * 0.05
W2 = torch.randn(L, E, H, I, generator=_g) * 0.05
WOUT = torch.randn(H, V, generator=_g)
POOLS = []
for _l in range(L):
    _p = torch.empty((E, LAY2.stride), dtype=torch.uint8)
    for _e in range(E):
        pack_expert_row(W13[_l, _e], W2[_l, _e], LAY2, out=_p[_e])
    POOLS.append(_p)


def make_reserve(slots=8):
    return FP4Reserve(QuantizingRowSource(lambda l, e: (W13[l, e], W2[l, e]), LAY4, L, E), slots, layout=LAY4,
                      background=False)


class ToyModel:
    """Two MoE layers with fixed routing per token; logits = h @ WOUT * scale."""

    def __init__(self, reserve, gate, ids, x, scale=1.0):
        self.reserve, self.gate, self.ids, self.x, self.scale = reserve, gate, ids, x, scale
        self.calls = 0

    def forward(self) -> torch.Tensor:
        self.calls += 1
        h = self.x
        w = torch.full(self.ids[0].shape, 0.5)
        for l in range(L):
            ids = self.ids[l]
            if self.gate is not None:
                self.gate.record(l, ids)
            extra = {}
            if self.reserve is not None:
                self.reserve.observe(l, ids)
                extra = self.reserve.op_args(l)
            h = h + moe_forward(h, ids, w, POOLS[l], torch.arange(E, dtype=torch.int32), LAY2, **extra)
        return (h @ WOUT) * self.scale


def toy(t=2, scale=1.0, reserve=None, gate=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(t)]).to(torch.int32) for _ in range(L)]
    return ToyModel(reserve, gate, ids, torch.randn(t, H, generator=g), scale)


def test_fire_mask_is_top_probability_at_or_below_tau():
    g = GateController(make_reserve(), enabled=True, tau=0.5)
    logits = torch.tensor([[10.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, -20.0]])  # p_top ~1, 1/3, 1/2
    assert g.fire_mask(logits).tolist() == [False, True, True]
    with pytest.raises(UsageError, match="rows, vocab"):
        g.fire_mask(torch.zeros(3))


def test_gate_off_is_bit_identical_to_no_gate():
    outs = []
    for gate_kind in ("none", "off", "never"):
        r = make_reserve(4)
        r.promote_now([(0, 1), (1, 2)])
        g = None if gate_kind == "none" else GateController(r, enabled=gate_kind == "never", tau=0.0)
        m = toy(t=3, scale=0.01, reserve=r, gate=g)
        outs.append(m.forward() if g is None else g.run_step(m.forward))
        if g is not None:
            assert g.c.fires == 0 and g.c.recomputes == 0 and r.stats()["gate_promotions"] == 2
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_fire_promotes_the_steps_experts_and_recomputes_with_them():
    r = make_reserve(8)
    g = GateController(r, enabled=True, tau=0.9)
    m = toy(t=1, scale=0.01, reserve=r, gate=g)  # flat logits: fires
    first = m.forward()
    g.c.steps = 0
    out = g.run_step(m.forward)
    assert m.calls == 3 and g.c.fires == 1 and g.c.recomputes == 1
    step_keys = {(l, int(e)) for l in range(L) for e in m.ids[l][0]}
    assert r.resident() == step_keys and g.c.promotions == len(step_keys)
    assert not torch.equal(out, first)
    assert torch.equal(out, m.forward()), "the recompute must read the promoted FP4 rows"
    d = g.counters()
    assert d["fires"] == 1 and d["steps"] == 1 and d["promotions"] == 4 and d["fire_share"] == 1.0
    g.run_step(m.forward)  # fires again, nothing new to promote: not re-run
    k = run_record_kpis(g, r)
    assert k["gate_fire_share"] == 0.5 and k["gate"]["fires"] == 2
    assert k["fp4_reserve"]["gate_promotions"] == 4
    assert run_record_kpis(None) == {}


def test_promotions_are_bounded_router_rank_first_and_counted_capped():
    r = make_reserve(8)
    g = GateController(r, enabled=True, tau=1.0, max_promotions_per_step=2)
    m = toy(t=1, reserve=r, gate=g)
    g.run_step(m.forward)
    # rank 0 of each layer first
    assert r.resident() == {(0, int(m.ids[0][0, 0])), (1, int(m.ids[1][0, 0]))}
    assert g.c.promotions == 2 and g.c.capped == 1


def test_decision_is_per_sequence():
    r = make_reserve(8)
    g = GateController(r, enabled=True, tau=0.5)
    m = toy(t=2, reserve=r, gate=g)

    def forward():
        out = m.forward()
        return torch.stack([torch.tensor([50.0] + [0.0] * (V - 1)), out[1] * 0.0])  # row 0 sure, row 1 flat

    g.run_step(forward)
    assert g.c.fired_rows == 1
    assert r.resident() == {(l, int(e)) for l in range(L) for e in m.ids[l][1]}  # only sequence 1's experts
    g.run_step(forward, row_tokens=[1, 0])  # row 1 is token 0 now
    assert {(l, int(e)) for l in range(L) for e in m.ids[l][0]} <= r.resident()


def test_no_recompute_when_everything_is_fp4_already():
    r = make_reserve(8)
    g = GateController(r, enabled=True, tau=1.0)
    m = toy(t=1, reserve=r, gate=g)
    g.run_step(m.forward)
    calls = m.calls
    g.run_step(m.forward)
    assert m.calls == calls + 1 and g.c.fires == 2 and g.c.recomputes == 1


def test_fire_share_counts_judged_steps_and_recompute_is_flagged():
    r = make_reserve(8)
    g = GateController(r, enabled=True, tau=0.9)
    m = toy(t=1, scale=0.01, reserve=r, gate=g)
    seen = []

    def forward():
        seen.append(g.recomputing)
        return m.forward()

    g.run_step(forward)
    assert seen == [False, True] and not g.recomputing
    g.skip_step()  # a prefill step: not a decode step of the share
    k = run_record_kpis(g, r)
    assert k["gate"]["steps"] == 2 and k["gate"]["skipped"] == 1
    assert k["gate_fire_share"] == 1.0 and k["gate"]["fire_share"] == 1.0


def test_bad_configuration_is_refused():
    with pytest.raises(ConfigError, match="no FP4 reserve"):
        GateController(None, enabled=True)
    with pytest.raises(UsageError, match="tau"):
        GateController(make_reserve(), tau=1.5)
    with pytest.raises(UsageError, match="max_promotions"):
        GateController(make_reserve(), max_promotions_per_step=-1)


def test_from_the_runtime_section():
    from moetplan.contract import Gate, RuntimeSection

    section = RuntimeSection(gate=Gate(enabled=True, tau=0.3, max_promotions_per_step=12), mtp=1)
    g = GateController.from_section(section, make_reserve())
    assert (g.enabled, g.tau, g.max_promotions_per_step, g.spec_tokens) == (True, 0.3, 12, 1)


# --------------------------------------------------------------------------- vLLM wrapper (imports vLLM)


@pytest.mark.vllm
def test_wrap_vllm_model_recomputes_inside_the_saved_forward_context():
    from vllm.forward_context import get_forward_context, is_forward_context_available, override_forward_context

    from moetplan.runtime.reserve.gate import wrap_vllm_model

    r = make_reserve(8)
    g = GateController(r, enabled=True, tau=0.9)
    tm = toy(t=2, scale=0.01, reserve=r, gate=None)

    class Router:
        capture_fn = None

        def set_capture_fn(self, fn):
            self.capture_fn = fn

    class Runner(torch.nn.Module):
        def __init__(self, layer_id):
            super().__init__()
            self.layer_id, self.router = layer_id, Router()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = torch.nn.ModuleList([Runner(3), Runner(5)])
            self.ctx_seen = []

        def forward(self, input_ids=None, positions=None, **kw):
            self.ctx_seen.append(get_forward_context() if is_forward_context_available() else None)
            for l, m in enumerate(self.moe):
                m.router.capture_fn(tm.ids[l])
            h = tm.x
            w = torch.full(tm.ids[0].shape, 0.5)
            for l in range(L):
                h = h + moe_forward(h, tm.ids[l], w, POOLS[l], torch.arange(E, dtype=torch.int32), LAY2,
                                    **r.op_args(l))
            return h

        def compute_logits(self, hidden):
            return (hidden @ WOUT) * 0.01

    model = wrap_vllm_model(Model(), g)
    ctx = object()
    with override_forward_context(ctx):
        hidden = model(input_ids=torch.zeros(2, dtype=torch.long))
    logits = model.compute_logits(hidden[torch.arange(2)])
    assert model.ctx_seen == [ctx, ctx], "the recompute must run inside the step's forward context"
    assert g.c.fires == 1 and g.c.recomputes == 1
    assert r.resident() == {(l, int(e)) for l in range(L) for e in tm.ids[l].reshape(-1)}
    assert torch.equal(logits, model.compute_logits(Model.forward(model, input_ids=None)))
    # a mixed batch (more tokens than sampled rows) is not judged
    with override_forward_context(ctx):
        hidden = model(input_ids=torch.zeros(2, dtype=torch.long))
    model.compute_logits(hidden[1:])
    assert g.c.skipped == 1
    # vLLM's profile / dummy runs have no attention metadata: not judged, not counted
    from types import SimpleNamespace

    with override_forward_context(SimpleNamespace(attn_metadata=None)):
        hidden = model(input_ids=torch.zeros(2, dtype=torch.long))
    before = g.counters()
    model.compute_logits(hidden[torch.arange(2)])
    assert g.counters() == before
    with pytest.raises(UsageError, match="already"):
        wrap_vllm_model(model, g)


VLLM_HOOKS = '''
import json, os


def install(model):
    import torch
    from moetplan.runtime.format.format import RowLayout
    from moetplan.runtime.reserve.gate import GateController, wrap_vllm_model
    from moetplan.runtime.reserve.reserve import FP4Reserve
    from moetplan.runtime.reserve.reserve_sources import QuantizingRowSource

    cfg = json.loads(os.environ["GATE_TEST_CFG"])
    h, i, layers, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_hidden_layers"], cfg["num_experts"]
    lay = RowLayout.for_expert(h, i, 1, "fp4")
    src = QuantizingRowSource(lambda l, x: (torch.zeros(2 * i, h), torch.zeros(h, i)), lay, layers, e)
    ctrl = GateController(FP4Reserve(src, layers * e, layout=lay, background=False), enabled=True, tau=1.0)
    wrap_vllm_model(model, ctrl)
    return True


def counters(model):
    return model._moetplan_gate.counters()
'''

VLLM_SCRIPT = '''
import json, sys

from gate_hooks import counters, install  # a module, so the worker process can unpickle the functions

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
              gpu_memory_utilization=0.5)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base = list(llm.generate(["hello world"], sp)[0].outputs[0].token_ids)
    assert llm.apply_model(install) == [True]
    gated = list(llm.generate(["hello world"], sp)[0].outputs[0].token_ids)
    print("RESULT " + json.dumps({"base": base, "gated": gated, "counters": llm.apply_model(counters)[0]}),
          flush=True)
    llm.llm_engine.engine_core.shutdown()
'''


@pytest.mark.vllm
def test_wrap_vllm_model_in_a_real_engine(tmp_path, e2e_env):
    """tau=1 fires on every decode step; the MoE here is vLLM's own (unquantized), so the recompute must give the
    same tokens: proves the forward re-entry (saved forward context, KV rewrite) and the router capture work."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("vllm")
    env = {**e2e_env, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    from moetplan.models.tiny import ensure_tiny_checkpoint

    ckpt = ensure_tiny_checkpoint("tiny-moe")
    env["GATE_TEST_CFG"] = (ckpt / "config.json").read_text()
    script = tmp_path / "gate_vllm.py"
    script.write_text(VLLM_SCRIPT)
    (tmp_path / "gate_hooks.py").write_text(VLLM_HOOKS)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    res = subprocess.run([sys.executable, str(script), str(ckpt)], env=env, capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    c = out["counters"]
    assert out["gated"] == out["base"]
    assert c["fires"] >= 7 and c["recomputes"] >= 1 and c["promotions"] >= 1 and c["skipped"] <= 1
