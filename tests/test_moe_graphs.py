"""MoE inside CUDA graphs, on the CPU: the resident op under a stand-in for graph capture (no host sync, replays
compute from the new inputs, counters on the device read at step end), the split decision from the plan, and the
launch's compilation config (no MoE split for resident plans, kept for tiered ones)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from graph_standin import CaptureGraph, HostSyncError, NoHostSync, StandinKernels
from moetplan import contract as schema
from moetplan import vllm_compat
from moetplan.contract.errors import ConfigError
from moetplan.contract.model import Attention, ModelSpec
from moetplan.contract.layout import RowLayout
from moetplan.runtime.op import cuda_paths, kernels, ops
from moetplan.runtime.vllm import moe_op
from moetplan.runtime.vllm import worker as worker_mod
from moetplan.runtime.format.format import pack_expert_row
from moetplan.runtime.vllm.graph_counters import CallPaths, GraphCounters
from moetplan.runtime.vllm.layer import LayerState
from moetplan.runtime.op.reference import moe_forward_reference
from moetplan.runtime.vllm.worker import WorkerRuntime

E, H, INTER, K, T = 8, 256, 256, 2, 4  # the decode kernels read K in 256-weight chunks


def _plan(**placement) -> schema.Plan:
    spec = ModelSpec(id="local:t", name="t", num_layers=2, moe_layers=2, hidden_size=H, moe_intermediate_size=INTER,
                     n_routed_experts=E, top_k=K, vocab_size=64, max_position_embeddings=256,
                     attention=Attention(kind="gqa", num_heads=2, num_kv_heads=1, head_dim=32),
                     kv_bytes_per_token={"bf16": 256.0}, non_routed_params_b=1e-5)
    return schema.Plan(model=spec, hardware=schema.HardwareProfile(host=schema.HostInfo(ram_gib=8)),
                       placement=schema.Placement(**placement), memory=schema.MemoryLedger(),
                       prediction=schema.Prediction(decode_tok_s=0))


LAYOUT = RowLayout.for_expert(H, INTER, 1, "2bit")


@pytest.fixture(scope="module")
def expert_rows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(2):
        w13, w2 = torch.randn(E, 2 * INTER, H, generator=g) * 0.05, torch.randn(E, H, INTER, generator=g) * 0.05
        out.append(torch.stack([pack_expert_row(w13[e], w2[e], LAYOUT) for e in range(E)]))
    return out


def _resident_worker(expert_rows, in_graphs: bool = True) -> WorkerRuntime:
    w = WorkerRuntime(_plan(max_num_seqs=T).runtime, rank=0, in_graphs=in_graphs)  # a decode batch of T tokens
    for li, rows in enumerate(expert_rows):
        st = w.layer_state(key=li, moe_index=li, name=f"l{li}", fmt="2bit", tier="resident", num_experts=E,
                           hidden=H, inter=INTER, first=li == 0, layout=LAYOUT, source="test")
        st.rows, st.slot_of = rows, torch.arange(E, dtype=torch.int32)
        w.layer_loaded(st, "cpu", 0.0)
    return w


def _inputs(seed: int, tokens: int = T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).to(torch.int32)
    wt = torch.rand(tokens, K, generator=g)
    return x, wt / wt.sum(1, keepdim=True), ids


@pytest.fixture
def device(monkeypatch):
    """The stand-in device: the op's CUDA path runs on StandinKernels (x counts as on the GPU), launches are
    recorded by a CaptureGraph, and steps are traffic (not vLLM warm-up runs)."""
    graph = CaptureGraph()
    mod = StandinKernels(LAYOUT, graph)
    monkeypatch.setattr(kernels, "get_module", lambda: mod)
    monkeypatch.setattr(ops, "PATHS", (ops.KernelPath("cuda", lambda s: None, ops._run_cuda),))
    monkeypatch.setattr(worker_mod, "is_warmup", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: graph.capturing)
    monkeypatch.setattr(cuda_paths, "_FLAGS", {})  # the kernels' sticky residency flag: this test's own
    return graph


def _op(w: WorkerRuntime, key: int, x, wt, ids) -> torch.Tensor:
    return torch.ops.moetplan.routed_experts(x, wt, ids, moe_op.op_id(w), key)


def _ref(rows, x, wt, ids) -> torch.Tensor:
    return moe_forward_reference(x, ids, wt, rows, torch.arange(E, dtype=torch.int32), LAYOUT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: one x plane, as served
def test_resident_op_replays_from_a_capture_with_no_host_sync_and_counts_on_the_device(expert_rows, device,
                                                                                      monkeypatch, dtype):
    w = _resident_worker(expert_rows)
    x, wt, ids = _inputs(1)
    x = x.to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    with NoHostSync():  # an eager (uncaptured) call: no sync either (Model Runner V2 assumes none in a step)
        eager = [_op(w, li, x, wt, ids) for li in range(2)]
    for li in range(2):
        assert eager[li].dtype == dtype
        assert torch.allclose(eager[li].float(), _ref(expert_rows[li], x, wt, ids).float(), atol=tol)

    version = w.record_version()  # the record writer's cue: it must see device-counted steps
    with NoHostSync(), device.capture(monkeypatch):
        outs = [_op(w, li, x, wt, ids) for li in range(2)]
    assert w.record_version() != version
    kernels_recorded = [n[1].__name__ for n in device.nodes if n[0] == "kernel"]
    assert kernels_recorded == ["_xprep", "_gemv", "_gemv", "_combine"] * 2

    replays = 3
    for seed in range(10, 10 + replays):  # new routing and activations in the graph's input buffers, no Python
        nx, nwt, nids = _inputs(seed)
        x.copy_(nx), wt.copy_(nwt), ids.copy_(nids)
        device.replay()
        for li in range(2):
            ref = _ref(expert_rows[li], nx.to(dtype), nwt, nids)
            assert torch.allclose(outs[li].float(), ref.float(), atol=tol)

    steps = 1 + 1 + replays  # the eager call, the capture (which runs once here), the replays
    got = w.graph_summary()
    assert (got["steps"], got["decode_steps"], got["prefill_steps"]) == (steps, steps, 0)
    assert got["tokens"] == got["decode_tokens"] == steps * T
    assert got["moe_calls"] == steps * 2 and got["routings"] == steps * T * K * 2
    assert got["kernel_paths"] == {"cuda:decode-gemv": steps * 2} and got["kernel_fallbacks"] == 0
    # nothing was counted in Python: a replay would not have run it
    assert w.stats.moe_calls == 0 and w.stats.steps == 0 and w.paths.as_dict()["kernel_paths"] == {}
    rec = w.make_record()
    assert rec.runtime["steps"] == steps and rec.runtime["kernel_paths"] == {"cuda:decode-gemv": steps * 2}
    assert rec.runtime["moe_calls"] == steps * 2 and "device" in rec.runtime["moe_counting"]
    w.close()


def test_a_host_sync_added_to_the_resident_path_fails_the_stand_in(expert_rows, device, monkeypatch):
    w = _resident_worker(expert_rows)
    x, wt, ids = _inputs(2)
    plain = LayerState._op

    def with_a_sync(self, x, ids, *a, **kw):  # type: ignore[no-untyped-def]
        if int(ids.max().item()) >= self.num_experts:  # the kind of guard someone might add
            raise ValueError("bad expert id")
        return plain(self, x, ids, *a, **kw)

    monkeypatch.setattr(LayerState, "_op", with_a_sync)
    with pytest.raises(HostSyncError, match="item"):
        with NoHostSync():
            _op(w, 0, x, wt, ids)
    with pytest.raises(HostSyncError):
        with NoHostSync(), device.capture(monkeypatch):
            _op(w, 0, x, wt, ids)
    w.close()


def test_the_stand_in_sees_the_tiered_paths_host_work(expert_rows, device):
    """The split path's store reads each step's routed ids on the host: the stand-in catches it (the reason the
    launch splits the graph at MoE for moe_graphs=split plans)."""
    w = WorkerRuntime(_plan(expert_tier="host", gpu_expert_cache_slots=6, moe_graphs="split").runtime, rank=0,
                      in_graphs=False)
    st = w.layer_state(key=0, moe_index=0, name="l0", fmt="2bit", tier="host", num_experts=E, hidden=H,
                       inter=INTER, first=True, layout=LAYOUT)
    st.store = w.attach_store(st, expert_rows[0].clone())
    w.layers[0] = st
    x, wt, ids = _inputs(3)
    counting = NoHostSync(raise_on_sync=False)
    with counting:
        got = st.forward(x, wt, ids)
    assert torch.allclose(got, _ref(expert_rows[0], x, wt, ids), atol=1e-4)
    # the store's lookup of the routed ids, and the kernels' residency flag read after the call
    assert counting.seen["cpu"] + counting.seen["numpy"] + counting.seen["tolist"] > 0, counting.seen
    assert counting.seen["item"] >= 1, counting.seen
    w.close()


def test_counters_accumulate_on_the_device_and_are_read_at_step_end():
    c = GraphCounters("cpu", decode_batch_tokens=8)
    decode, prefill = CallPaths(), CallPaths()
    decode.ran("cuda:decode-gemv")
    prefill.ran("cuda:prefill-tiled")
    before = c.values.data_ptr()
    for n in (1, 3, 8):
        c.step(n, 2, decode)
    c.step(100, 2, prefill)
    assert c.values.data_ptr() == before  # graphs captured earlier keep adding to the same memory
    s = c.summary(moe_layers=4)
    assert (s["decode_steps"], s["decode_tokens"], s["prefill_steps"], s["prefill_tokens"]) == (3, 12, 1, 100)
    assert s["kernel_paths"] == {"cuda:decode-gemv": 12, "cuda:prefill-tiled": 4}
    assert s["routings"] == 112 * 2 * 4 and s["moe_calls"] == 16
    assert c.version() == 4
    fell = CallPaths()
    fell.ran("reference")
    fell.fell_back("cuda: shape")
    c.step(2, 2, fell)
    s = c.summary(moe_layers=4)
    assert s["kernel_fallbacks"] == 4 and s["kernel_fallback_reasons"] == {"cuda: shape": 4}
    assert "residency_flag" not in s


def test_the_kernels_residency_flag_is_read_with_the_counters_not_per_call():
    flag = torch.zeros(1, dtype=torch.int32)
    c = GraphCounters("cpu", decode_batch_tokens=1, flag=flag)
    assert "residency_flag" not in c.summary(moe_layers=1)
    flag.fill_(-1)  # what the kernels write for an expert id outside [0, E)
    assert c.summary(moe_layers=1)["residency_flag"] == -1


def test_counter_keys_beyond_capacity_share_the_last_row():
    c = GraphCounters("cpu", decode_batch_tokens=1, capacity=3)
    for i in range(5):
        p = CallPaths()
        p.ran(f"path{i}")
        c.step(1, 1, p)
    s = c.summary(moe_layers=1)
    assert s["steps"] == 5 and s["kernel_paths"]["path0"] == 1 and s["kernel_paths"]["path1"] == 1
    assert sum(s["kernel_paths"].values()) == 2  # the "other" row names no path
    assert int(c.values[:, 0].sum()) == 5


# --------------------------------------------------------------------------- tiered: misses found on the device


def _tiered_worker(expert_rows, slots: int, seqs: int = 2, in_graphs: bool = True) -> WorkerRuntime:
    """A replay-mode worker over a host store of `slots` rows; decode steps of up to `seqs` tokens."""
    w = WorkerRuntime(_plan(expert_tier="host", gpu_expert_cache_slots=slots, max_num_seqs=seqs).runtime, rank=0,
                      in_graphs=in_graphs)
    assert w.section.replays
    for li, rows in enumerate(expert_rows):
        st = w.layer_state(key=li, moe_index=li, name=f"l{li}", fmt="2bit", tier="host", num_experts=E, hidden=H,
                           inter=INTER, first=li == 0, layout=LAYOUT, source="test")
        st.store = w.attach_store(st, rows.clone())
        w.layer_loaded(st, "cpu", 0.0)
    w.main_layers = len(expert_rows)
    return w


def test_a_tiered_step_in_a_graph_replays_after_one_batch_fetch(expert_rows, device, monkeypatch):
    """The tiered layer through the op, as vLLM's graph holds it: capture-safe (no host sync), computing from the
    cache as it stands; the driver around the replay reads the record once per step, fetches a missed step's rows
    in one batch and replays: every step ends with the reference's output."""
    w = _tiered_worker(expert_rows, slots=10)  # a step's <= 8 experts (2 tokens x top-2 x 2 layers) fit
    x, wt, ids = _inputs(20, tokens=2)
    _op(w, 0, x, wt, ids)  # vLLM's eager warm-up: the store is built at the first forward
    outs: list[torch.Tensor] = []
    with NoHostSync(), device.capture(monkeypatch):  # no host read anywhere in the tiered layer's capture
        outs += [_op(w, li, x, wt, ids) for li in range(2)]
    store = w.tiered.store
    routings = [_inputs(s, tokens=2) for s in (21, 22, 21, 23, 23, 24)]
    missed_steps = 0
    for nx, nwt, nids in routings:
        x.copy_(nx), wt.copy_(nwt), ids.copy_(nids)
        will_miss = any(bool((store.pool.res[li][nids.reshape(-1).long().numpy()] < 0).any()) for li in range(2))
        missed_steps += will_miss
        counting = NoHostSync(raise_on_sync=False)
        with counting:
            w.forward_step(device.replay, tokens=2)
        if not will_miss:  # a zero-miss step: one read of the record, nothing else
            assert sum(counting.seen.values()) == 1, counting.seen
        for li in range(2):
            assert torch.allclose(outs[li], _ref(expert_rows[li], nx, nwt, nids), atol=1e-4)
    c = w.replay.counts.as_dict()
    assert c["steps"] == 6 and c["replayed_steps"] == missed_steps >= 2  # step 1 misses; a repeat does not
    assert c["fetch_batches"] == c["replay_passes"] == missed_steps  # independent layers: one pass each
    assert c["fetched_rows"] >= len(set(routings[0][2].reshape(-1).tolist()))
    kpis = w.store_kpis()
    assert kpis["replay"]["replayed_steps"] == missed_steps and kpis["replay_rate"] == round(missed_steps / 6, 6)
    d = store.stats()["decode"]  # the store's counters, fed from the device record
    assert d["steps"] == 6 and store.decode.steps - store.decode.zero_miss_steps == missed_steps
    assert store.heat().sum() > 0  # the record heats the cache: no host read per layer
    w.close()


def test_a_replay_runs_until_the_routing_settles_and_matches_the_resident_result(expert_rows, device, monkeypatch):
    """Layer 1 routes from layer 0's output (as a model does): a first pass that missed in layer 0 routes layer
    1 from a wrong input, so the replay may miss again there. The driver replays until no layer misses (each pass
    moves the first missed layer later); the result equals the all-resident computation."""
    w = _tiered_worker(expert_rows, slots=8)
    g = torch.Generator().manual_seed(7)
    router = torch.randn(H, E, generator=g)
    x, wt, ids = _inputs(30, tokens=2)

    def model(x, wt, ids, op):  # two MoE layers, the second routed by the first's output
        h = x + op(0, x, wt, ids)
        w1, i1 = torch.topk(torch.softmax(h @ router, -1), K)
        return h + op(1, h, w1 / w1.sum(1, keepdim=True), i1.to(torch.int32))

    def tiered(li, a, b, c):
        return _op(w, li, a, b, c)

    model(x, wt, ids, tiered)  # warm-up
    with NoHostSync(), device.capture(monkeypatch):
        out = model(x, wt, ids, tiered)
    passes = []
    for seed in (31, 32, 33):
        nx, nwt, nids = _inputs(seed, tokens=2)
        x.copy_(nx), wt.copy_(nwt), ids.copy_(nids)
        before = w.replay.counts.replay_passes if w.replay else 0
        w.forward_step(device.replay, tokens=2)
        passes.append(w.replay.counts.replay_passes - before)
        ref = model(nx, nwt, nids, lambda li, a, b, c: _ref(expert_rows[li], a, b, c))
        assert torch.allclose(out, ref, atol=1e-3)
    assert passes[0] >= 1 and max(passes) <= 2  # bounded by the layer count
    w.close()


def test_a_replay_that_misses_again_says_the_cache_is_too_small():
    from moetplan.runtime.store.miss_replay import ReplayDriver, ReplayError, StepMisses

    misses = StepMisses(1, E)
    slot_of = torch.full((E,), -1, dtype=torch.int32)
    ids = torch.tensor([[1, 2]], dtype=torch.int32)
    driver = ReplayDriver(misses, lambda need: 0, gpu_expert_cache_slots=3)  # a fetch that brings nothing in
    with pytest.raises(ReplayError, match="3 slots") as e:
        driver.step(lambda: misses.record(0, slot_of, ids))
    assert "gpu_expert_cache_gib" in str(e.value) and "moe_graphs=split" in str(e.value)
    slot_of[:] = 0
    assert driver.step(lambda: misses.record(0, slot_of, ids)) is None and driver.counts.replayed == 1


def test_a_batch_the_cache_cannot_hold_is_a_replay_error_not_wrong_tokens(expert_rows):
    from moetplan.runtime.store.miss_replay import ReplayError

    w = _tiered_worker(expert_rows, slots=3, in_graphs=False)  # a step of 2 tokens x top-2 needs up to 4
    x, wt, ids = _inputs(40, tokens=2)
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    w.layers[0].forward(x, wt, ids)  # builds the store
    w.step_rec.clear()
    with pytest.raises(ReplayError, match="3 slots"):
        w.forward_step(lambda: w.layers[0].forward(x, wt, ids), tokens=2)
    w.close()


def test_drafter_layers_misses_are_fetched_without_a_replay(expert_rows):
    """A speculative drafter's MoE layers (after the target's) that miss only weaken drafts the target verifies:
    their rows come with the next batch, the step is not run again."""
    w = _tiered_worker(expert_rows, slots=10, in_graphs=False)
    w.main_layers = 1  # layer 1 stands for the drafter's MoE layer
    x, wt, ids = _inputs(41, tokens=2)
    w.layers[0].forward(x, wt, ids)
    runs = []
    w.forward_step(lambda: runs.append(w.layers[1].forward(x, wt, ids)), tokens=2)
    c = w.replay.counts
    assert len(runs) == 1 and c.replayed == 0 and c.drafter_rows > 0
    assert (w.tiered.store.pool.res[1][ids.reshape(-1).long().numpy()] >= 0).all()
    w.close()


def test_a_large_step_that_missed_reruns_through_the_per_layer_store(expert_rows):
    """A step above the decode working set (a prefill chunk) that missed inside a graph re-runs eagerly; the
    layers then take the per-layer store path, which computes any size in chunks."""
    w = _tiered_worker(expert_rows, slots=4, in_graphs=False)
    x, wt, ids = _inputs(42, tokens=6)  # up to 8 experts: more than the 4 slots
    w.layers[0].forward(x[:2], wt[:2], ids[:2])  # builds the store
    misses = w.step_rec
    out: list[torch.Tensor] = []

    def graph_pass() -> torch.Tensor:  # what a piecewise graph of 6 tokens records: the replay path
        st, store = w.layers[0], w.tiered.store
        return st._replay_forward(x, wt, ids, {}, store, misses)

    def eager() -> torch.Tensor:
        out.append(w.layers[0].forward(x, wt, ids))
        return out[-1]

    got = w.forward_step(graph_pass, tokens=6, eager=eager)
    assert w.replay.counts.eager_reruns == 1 and len(out) == 1
    ref = _ref(expert_rows[0], x, wt, ids)  # the eager rerun ran on the CPU kernels (int8 activations: ~1e-2)
    assert float((got - ref).norm() / ref.norm()) < 2e-2
    w.close()


# --------------------------------------------------------------------------- the split decision


@pytest.mark.parametrize("placement,split", [
    ({}, False),
    ({"expert_tier": "host", "gpu_expert_cache_slots": 4}, False),  # replayed inside the graphs
    ({"expert_tier": "nvme", "gpu_expert_cache_slots": 4}, False),
    ({"expert_tier": "host", "gpu_expert_cache_slots": 4, "moe_graphs": "split"}, True),
    ({"expert_tier": "nvme", "gpu_expert_cache_slots": 4, "moe_graphs": "split"}, True),
    ({"fp4_reserve_slots": 4}, False),  # heated from the step record, tables synced at step ends
    ({"fp4_reserve_slots": 4, "moe_graphs": "split"}, True),
    ({"gate": {"enabled": True}}, True),
    ({"expert_format": "unquantized"}, True),
])
def test_the_plan_decides_the_split_in_one_place(placement, split):
    assert (_plan(**placement).runtime.moe_split_reason is not None) == split


def test_the_worker_counts_on_the_device_exactly_when_vllm_captures_its_moe(monkeypatch):
    monkeypatch.setattr(vllm_compat, "moe_in_cuda_graphs", lambda *a, **k: True)
    w = WorkerRuntime(_plan().runtime, rank=0)
    w.new_moe_index()
    assert w.in_graphs is True and w.layer_state(key=0, moe_index=0, name="l", fmt="2bit", tier="resident",
                                                 num_experts=E, hidden=H, inter=INTER).policy.check_residency is False
    replay = WorkerRuntime(_plan(expert_tier="host", gpu_expert_cache_slots=4).runtime, rank=0)
    replay.new_moe_index()
    assert replay.in_graphs is True
    tiered = WorkerRuntime(_plan(expert_tier="host", gpu_expert_cache_slots=4, moe_graphs="split").runtime, rank=0)
    with pytest.raises(ConfigError, match="moetplan run") as e:
        tiered.new_moe_index()
    assert "expert_tier host" in str(e.value) and "vllm::moe_forward" in str(e.value)
    monkeypatch.setattr(vllm_compat, "moe_in_cuda_graphs", lambda *a, **k: False)
    eager = WorkerRuntime(_plan(expert_tier="host", gpu_expert_cache_slots=4).runtime, rank=0)
    eager.new_moe_index()
    assert eager.in_graphs is False and eager.graph is None


def test_moe_in_cuda_graphs_reads_the_compilation_config():
    pytest.importorskip("vllm")
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    def cfg(mode, ops):
        return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=mode, splitting_ops=ops))

    attn = ["vllm::unified_attention_with_output"]
    moe = list(vllm_compat.MOE_FORWARD_OPS)
    assert vllm_compat.moe_in_cuda_graphs(cfg(CUDAGraphMode.PIECEWISE, attn), cuda=True)
    assert not vllm_compat.moe_in_cuda_graphs(cfg(CUDAGraphMode.PIECEWISE, attn + moe), cuda=True)
    assert vllm_compat.moe_in_cuda_graphs(cfg(CUDAGraphMode.FULL_AND_PIECEWISE, attn + moe), cuda=True)
    assert not vllm_compat.moe_in_cuda_graphs(cfg(CUDAGraphMode.NONE, attn), cuda=True)
    assert not vllm_compat.moe_in_cuda_graphs(cfg(CUDAGraphMode.PIECEWISE, attn), cuda=False)
    # vLLM's own defaults (what a resident plan's launch leaves in place) record the MoE op
    default = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, mode=3)
    default.set_splitting_ops_for_v1("naive")
    assert vllm_compat.moe_in_cuda_graphs(SimpleNamespace(compilation_config=default), cuda=True)


# --------------------------------------------------------------------------- the launch


@pytest.fixture(scope="module")
def gpu_plan():
    from moetplan import hwdb
    from moetplan.contract import Goals
    from moetplan.plan.solver import parse_set, solve

    return solve(hwdb.model_spec("qwen3-30b-a3b"), hwdb.box_profile("rtx-pro-6000x1"),
                 Goals(pinned=parse_set(["mtp=0"])))


def _with(plan: schema.Plan, **placement) -> schema.Plan:
    return plan.model_copy(update={"placement": plan.placement.model_copy(update=placement)})


def _compilation(plan: schema.Plan) -> dict | None:
    from moetplan.launch.command import build_launch

    argv = build_launch(plan).argv
    assert "--enforce-eager" not in argv
    return json.loads(argv[argv.index("--compilation-config") + 1]) if "--compilation-config" in argv else None


def test_the_launch_splits_at_moe_for_split_plans_only(gpu_plan):
    from moetplan.launch.command import build_launch

    resident = _with(gpu_plan, expert_tier="resident", fp4_reserve_slots=0, gpu_expert_cache_slots=0)
    assert _compilation(resident) is None  # vLLM's defaults: FULL_AND_PIECEWISE, split at attention only
    for tier in ("host", "nvme"):
        replay = _with(gpu_plan, expert_tier=tier, gpu_expert_cache_slots=64, fp4_reserve_slots=0)
        assert _compilation(replay) is None  # tiered layers inside the graphs: no MoE splitting op
        assert build_launch(replay).env["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # the runner the driver wraps
        comp = _compilation(_with(gpu_plan, expert_tier=tier, gpu_expert_cache_slots=64, moe_graphs="split"))
        assert comp is not None and comp["cudagraph_mode"] == "PIECEWISE"
        assert set(vllm_compat.MOE_FORWARD_OPS) <= set(comp["splitting_ops"])
        assert set(vllm_compat.attention_split_ops()) <= set(comp["splitting_ops"])
        assert not any(op.startswith("moetplan::") for op in comp["splitting_ops"])
    assert _compilation(_with(resident, fp4_reserve_slots=16)) is None  # the reserve inside the graphs too
    reserve = _compilation(_with(resident, fp4_reserve_slots=16, moe_graphs="split"))
    assert reserve is not None and "vllm::moe_forward" in reserve["splitting_ops"]


def test_vllm_resolves_the_tiered_launch_to_moe_outside_graphs(gpu_plan):
    pytest.importorskip("vllm")
    from vllm.config import CompilationConfig

    comp = _compilation(_with(gpu_plan, expert_tier="host", gpu_expert_cache_slots=64, moe_graphs="split"))
    cc = CompilationConfig(**comp, mode=3)
    cc.set_splitting_ops_for_v1("naive")
    assert not vllm_compat.moe_in_cuda_graphs(SimpleNamespace(compilation_config=cc), cuda=True)


def test_the_overhead_bench_writes_host_times_and_restores_the_op(load_bench, tmp_path, capsys):
    bench = load_bench("graph_overhead")
    paths, get_module = ops.PATHS, kernels.get_module
    out = tmp_path / "go.json"
    assert bench.main(["--model", "qwen3-30b-a3b", "--tokens", "1", "--iters", "5", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    r = doc["results"][0]
    assert doc["model"] == "qwen3-30b-a3b" and doc["machine"]["cpu"] and len(doc["load_average"]) == 3
    assert r["resident_host_us_split_mode"]["other_layer"]["median_us"] > 0 and r["tiered_lookup_us"]["min_us"] > 0
    assert r["per_step_ms"]["moe_layers"] == 48
    assert ops.PATHS is paths and kernels.get_module is get_module  # nothing left patched for other tests


def test_a_capture_the_kernels_refuse_is_a_clear_error_not_a_reference_run(expert_rows, monkeypatch):
    class OnGpu(torch.Tensor):  # only its is_cuda answer differs: the kernels are asked and refuse
        @property
        def is_cuda(self) -> bool:  # type: ignore[override]
            return True

    monkeypatch.setattr(kernels, "get_module", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x, wt, ids = _inputs(4)
    with pytest.raises(ops.UsageError, match="enforce-eager"):
        ops.moe_forward(x.as_subclass(OnGpu), ids, wt, expert_rows[0], torch.arange(E, dtype=torch.int32), LAYOUT)


@pytest.mark.parametrize("graphs,split", [("replay", False), ("split", True)])
def test_a_tiered_plans_dry_run_launch_keeps_vllms_graphs_unless_split(tmp_path, graphs, split):
    """`moetplan run --dry-run` of the 32 GB-card case (DeepSeek-V4-Flash, host tier, no FP4 reserve: a reserve
    still splits): replay keeps vLLM's default compilation config (no MoE splitting op, no --compilation-config);
    --set moe_graphs=split is the fallback."""
    from typer.testing import CliRunner

    from moetplan.cli import app

    res = CliRunner().invoke(app, ["run", "--model", "deepseek-v4-flash", "--box", "rtx-5090x1", "--dry-run",
                                   "--json", "--run-dir", str(tmp_path), "--set", "expert_tier=host",
                                   "--set", "fp4_reserve_gib=0", "--set", f"moe_graphs={graphs}"])
    assert res.exit_code == 0, res.output
    argv = json.loads(res.output)["argv"]
    assert ("--compilation-config" in argv) == split
    assert not any(op in " ".join(argv) for op in vllm_compat.MOE_FORWARD_OPS) or split
    plan = schema.Plan.model_validate_json((tmp_path / "plan.json").read_text())
    assert plan.placement.moe_graphs == graphs and plan.runtime.replays == (not split)
    assert (plan.prediction.replay_rate is not None) == (not split)


def test_moe_graphs_takes_only_its_values():
    from moetplan.contract.errors import UsageError
    from moetplan.plan.solver import parse_set

    assert parse_set(["moe_graphs=split"]) == {"moe_graphs": "split"}
    with pytest.raises(UsageError, match="replay, split"):
        parse_set(["moe_graphs=eager"])


def test_tensor_parallel_ranks_replay_together():
    """Another rank missed (the agreed flag says so): this rank runs the forward again with it, fetching nothing,
    so every rank's all-reduces pair up."""
    from moetplan.runtime.store.miss_replay import ReplayDriver, StepMisses

    misses = StepMisses(1, E)
    slot_of = torch.zeros(E, dtype=torch.int32)  # everything resident here
    ids = torch.tensor([[1, 2]], dtype=torch.int32)
    votes = iter([True, False])  # the first pass missed on another rank, the replay on none
    fetched = []
    driver = ReplayDriver(misses, lambda need: fetched.append(need) or 0, agree=lambda local: next(votes) or local)
    runs = []
    driver.step(lambda: runs.append(misses.record(0, slot_of, ids)))
    assert len(runs) == 2 and driver.counts.replayed == 1 and not fetched


def test_a_pack_backed_store_keeps_its_heat_and_restarts_warm(expert_rows, tmp_path):
    """runtime/store/heat.py in serving: the NVMe tier's store saves its heat beside the pack (the record-fed heat of
    replayed steps) and the next worker preloads the hot rows."""
    def worker() -> WorkerRuntime:
        w = WorkerRuntime(_plan(expert_tier="nvme", gpu_expert_cache_slots=10, max_num_seqs=2, pack_dir=str(tmp_path)).runtime,
                          rank=0, in_graphs=False)
        for li, rows in enumerate(expert_rows):
            st = w.layer_state(key=li, moe_index=li, name=f"l{li}", fmt="2bit", tier="nvme", num_experts=E, hidden=H,
                               inter=INTER, first=li == 0, layout=LAYOUT, source="test")
            st.store = w.attach_store(st, rows.clone())
            w.layer_loaded(st, "cpu", 0.0)
        w.main_layers = 2
        return w

    w = worker()
    x, wt, ids = _inputs(50, tokens=2)
    w.layers[0].forward(x, wt, ids)  # the first forward builds the store (and writes the pack)
    for _ in range(3):
        w.forward_step(lambda: [w.layers[li].forward(x, wt, ids) for li in range(2)], tokens=2)
    keeper = w.tiered.heat_keeper
    assert keeper is not None and keeper.save().exists()
    w.close()
    again = worker()
    again.layers[0].forward(x, wt, ids)
    hot = set(ids.reshape(-1).tolist())
    assert {e for e in hot if again.tiered.store.pool.res[1][e] >= 0} == hot  # layer 1 preloaded, never routed yet
    again.close()


def test_the_forward_hook_wraps_model_runner_v1_once_and_reports_the_step_tokens():
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert callable(getattr(GPUModelRunner, vllm_compat.FORWARD_HOOK[2]))  # the method vLLM calls per step

    class Runner:
        def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                           **kw):
            return ("out", int(positions.shape[-1]))

    seen = []

    def around(call, tokens, eager):
        seen.append(tokens)
        return call()

    assert vllm_compat.install_forward_hook(around, Runner)
    assert vllm_compat.install_forward_hook(around, Runner)  # idempotent: wrapped once
    out = Runner()._model_forward(input_ids=torch.zeros(5, dtype=torch.long), positions=torch.arange(5))
    assert out == ("out", 5) and seen == [5]
    Runner()._model_forward(input_ids=None, positions=torch.arange(3), inputs_embeds=torch.zeros(3, 8))
    assert seen == [5, 3]
