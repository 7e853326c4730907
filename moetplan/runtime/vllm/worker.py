"""One `WorkerRuntime` per vLLM worker process (one TP rank): the Plan's runtime section, and what the MoE layers
of that process share: their states, the tiered store, the FP4 reserve and gate, the kernel path log and the run
record. The quantization config and every MoE method hold it; nothing else keeps per-process state.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
from typing import Any

import torch

from moetplan.contract import envs
from moetplan.contract.errors import ConfigError
from moetplan.contract.runtime import RuntimeSection
from moetplan import vllm_compat
from moetplan.runtime.vllm import records
from moetplan.runtime.op.cuda_paths import error_flag
from moetplan.runtime.vllm.graph_counters import CallPaths, GraphCounters, capturing
from moetplan.runtime.vllm.layer import LayerState
from moetplan.runtime.store.miss_replay import ReplayDriver, StepMisses
from moetplan.runtime.op.ops import PathLog
from moetplan.runtime.vllm.pack_resolve import PackResolver
from moetplan.runtime.vllm.reserve_build import ReserveState
from moetplan.runtime.vllm.routers import LocalityRouter, router_for
from moetplan.runtime.vllm.tiers import TieredExperts

log = logging.getLogger("vllm.moetplan")

def tp_rank() -> int:
    r = _vllm_tp_rank()
    return 0 if r is None else r


def _vllm_tp_rank() -> int | None:
    """This process's TP rank, or None while vLLM has no TP group (before it is built, after it is torn down)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return None


def tp_any(flag: bool) -> bool:
    """True when `flag` is True on any tensor-parallel rank (one 1-element all-reduce in vLLM's TP group)."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    # float32: vLLM's CPU shared-memory all-reduce has no integer kernel ("shm_allreduce_sum" not implemented for
    # 'Int'), and every backend reduces float32; 0/1 sums are exact.
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float32, device=group.device)
    return bool(group.all_reduce(t).item() > 0.5)


def is_warmup() -> bool:
    """True inside vLLM's profile/dummy runs (no attention metadata): not user traffic, not counted."""
    try:
        from vllm.forward_context import (
            get_forward_context,
            is_forward_context_available,
        )

        if not is_forward_context_available():
            return True
        return get_forward_context().attn_metadata is None
    except Exception:
        return False


class WorkerRuntime:
    """Everything one worker process serves its MoE layers with, read from one Plan's runtime section
    (`Plan.runtime`; `plan_path`: the file it came from, beside which the run record goes)."""

    def __init__(self, section: RuntimeSection, plan_path: str | None = None, *, rank: int | None = None,
                 in_graphs: bool | None = None):
        if not isinstance(section, RuntimeSection):
            raise TypeError(f"WorkerRuntime takes a plan's runtime section (Plan.runtime), not {type(section)}")
        fmt = section.expert_format
        self.plan_path = str(plan_path) if plan_path else None
        self.section = section
        if self.section.knobs.weights == "dummy" and (fmt != "2bit" or self.section.reserve_wanted):
            raise ConfigError(f"{plan_path or 'plan'}: dummy weights are random 2-bit rows with no FP4 reserve; "
                              "re-run `moetplan run --dummy-weights` without --experts unquantized (it plans no "
                              "reserve)")
        self._rank = rank  # None: asked of vLLM when needed (its TP group may not exist yet at construction)
        self.layers: dict[int, LayerState] = {}
        self.moe_layers_created = 0  # MoE layers numbered in construction order: the pack's layer order
        self.stats = records.RuntimeStats(decode_batch_tokens=self.section.decode_batch_tokens)
        self.paths = PathLog()
        self.packs = PackResolver(self.section.pack_dir, lambda: self.rank,
                                  dummy_seed=self.section.knobs.seed if self.section.knobs.weights == "dummy" else None)
        self.fp4 = ReserveState()
        self.tiered: TieredExperts | None = None
        self.router: LocalityRouter | None = None
        self._writer: records.RecordWriter | None = None
        # Whether vLLM records the MoE layers inside CUDA graphs (None: asked of vLLM's config at the first MoE
        # layer). Then the op runs capture-safe and counts on the device (`graph`).
        self.in_graphs = in_graphs
        self.graph: GraphCounters | None = None
        # Replay mode (section.replays): the driver around vLLM's forward call, built at the first step that
        # has a store; the target model's MoE layer count (later ones are a drafter's), known once it loaded.
        self.replay: ReplayDriver | None = None
        self.main_layers: int | None = None
        self.step_rec: StepMisses | None = None  # the step's device record (section.records_steps)

    @classmethod
    def from_plan_file(cls, path: str | os.PathLike[str]) -> "WorkerRuntime":
        from moetplan.contract import Plan, SchemaError, load_json

        try:
            plan = load_json(Plan, path)
        except SchemaError as e:
            raise ConfigError(f"{envs.PLAN.name}: {e}") from None
        return cls(plan.runtime, str(path))

    @classmethod
    def from_env(cls) -> "WorkerRuntime":
        """A worker for the plan MOETPLAN_PLAN names (the only variable at the vLLM boundary)."""
        path = envs.get(envs.PLAN)
        if not path:
            raise ConfigError(
                f"The moetplan quantization method needs a plan: {envs.PLAN.name} is not set. Start the server "
                "with `moetplan run plan.json` (or export MOETPLAN_PLAN=/path/plan.json before `vllm serve`)")
        return cls.from_plan_file(path)

    @classmethod
    def for_process(cls) -> "WorkerRuntime":
        """This process's worker, built from MOETPLAN_PLAN on first use."""
        global _PROCESS
        with _PROCESS_LOCK:
            if _PROCESS is None:
                _PROCESS = cls.from_env()
            return _PROCESS

    @property
    def rank(self) -> int:
        # Kept once vLLM knows it: the run record's last write (atexit) comes after vLLM has torn its TP group
        # down, and rank 1 would then name itself rank 0.
        if self._rank is None:
            r = _vllm_tp_rank()
            if r is None:
                return 0
            self._rank = r
        return self._rank

    # One per process: a copy of a config (or a pickle sent to another process) means that process's worker.
    def __deepcopy__(self, memo: dict) -> "WorkerRuntime":
        return self

    def __reduce__(self) -> tuple:
        return (process_worker, ())  # a module-level function: pickled by reference (cloudpickle too)

    # ------------------------------------------------------------------ layers

    def new_moe_index(self) -> int:
        """The next MoE layer's index (called while vLLM builds the model, with its config current)."""
        if self.in_graphs is None:
            self.in_graphs = self._moe_in_graphs()
        self.moe_layers_created += 1
        return self.moe_layers_created - 1

    def _moe_in_graphs(self) -> bool:
        try:
            captured = vllm_compat.moe_in_cuda_graphs()
        except ImportError:  # no vLLM: nothing captures
            return False
        except Exception as e:  # a vLLM whose config reads differently: count in Python, say so
            log.warning("moetplan: could not tell whether vLLM records the MoE layers in CUDA graphs (%r); counting "
                        "on the host (the run record's MoE counts are wrong if it does)", e)
            return False
        why = self.section.moe_split_reason
        if captured and why is not None:
            ops = ",".join(f'"{op}"' for op in vllm_compat.MOE_FORWARD_OPS)
            raise ConfigError(
                f"vLLM would record the MoE layers inside CUDA graphs, but this plan's MoE layers must run on every "
                f"step ({why}). Start the server with `moetplan run {self.plan_path or 'plan.json'}` (its "
                "compilation config splits the graph at MoE), or add --compilation-config "
                f"'{{\"cudagraph_mode\":\"PIECEWISE\",\"splitting_ops\":[<vLLM's attention ops>,{ops}]}}', "
                "or --enforce-eager")
        return captured

    def layer_state(self, **fields: Any) -> LayerState:
        """A layer's state wired to this worker's reserve, kernel policy and path log. Inside CUDA graphs the
        residency flag is read at step end rather than after each call (a host sync), and the kernel paths are
        counted on the device (`run_layer`)."""
        # In replay mode a pair without a row is expected (zeros, the step re-runs): the flag is no error there.
        policy = self.section.knobs.kernels
        if self.in_graphs or self.section.replays:
            policy = dataclasses.replace(policy, check_residency=False)
        if self.section.records_steps:
            experts = int(fields["num_experts"])
            fields["record"] = lambda device: self.step_record(device, experts)
        if self.section.expert_tier == "host" and not self.section.replays:  # the split path (issue 39)
            fields.setdefault("cpu_miss_ratio", self.section.cpu_miss_ratio)
        if self.in_graphs:
            return LayerState(**fields, fp4=self.fp4, policy=policy, paths=None)
        return LayerState(**fields, fp4=self.fp4, policy=policy, paths=self.paths)

    def step_record(self, device: Any, num_experts: int) -> StepMisses:
        """The step's device record over every MoE layer, allocated at the first forward (vLLM's eager warm-up,
        before any capture, after every layer loaded): graphs keep its address."""
        if self.step_rec is None:
            self.step_rec = StepMisses(max(self.moe_layers_created, len(self.layers)), num_experts, device=device)
        return self.step_rec

    def attach_store(self, st: LayerState, rows: torch.Tensor | None) -> TieredExperts:
        """Hand a layer's rows to the worker's tiered store (built at the first forward; None: dummy weights, the
        store generates them into its backing)."""
        if self.tiered is None:
            self.tiered = TieredExperts(self.section, self.packs.write_and_open)
        self.tiered.add(st.moe_index, rows, st.layout, st.num_experts)
        return self.tiered

    def route(self, key: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts a layer computes: the model's choice, or the plan's router's (runtime/vllm/routers.py)."""
        if self.section.knobs.router == "model":
            return topk_ids
        if self.router is None:
            self.router = router_for(self.section.knobs, int(topk_ids.shape[1]))
        return self.router.route(key, topk_ids)

    def layer_loaded(self, st: LayerState, device: Any, load_s: float) -> None:
        self.layers[st.key] = st
        if self.in_graphs and self.graph is None:  # allocated before any capture: graphs keep its address
            dev = torch.device(device)
            flag = error_flag(dev) if dev.type == "cuda" else None  # read with the counters, not per call
            self.graph = GraphCounters(dev, self.section.decode_batch_tokens, flag=flag)
        s = self.section
        if st.fmt == "unquantized" and s.reserve_wanted and st.key == 0:
            log.info("moetplan: the plan's FP4 reserve (and gate) do not apply to unquantized experts: "
                     "every expert is computed at the checkpoint's precision already")
            self.fp4.note = "not applicable: experts unquantized"
        if (st.fmt == "2bit" and s.reserve_wanted and not self.fp4.built
                and len(self.layers) == self.moe_layers_created):
            # the last MoE layer of this worker: the reserve spans them all (built once: a speculative drafter's
            # MoE layers, loaded later, are not in it)
            self.fp4.build(s, self.packs, self.layers[0], len(self.layers), device, f"fp4_reserve.rank{self.rank}")
            if s.records_steps and self.fp4.reserve is not None:
                self.fp4.reserve.use_graph_tables()  # before any capture
        self.stats.layers = len(self.layers)
        self.stats.load_s += load_s

    def after_model_loaded(self, model: Any, vllm_config: Any = None) -> Any:
        """The plugin's model-loader hook: install the plan's confidence gate on the loaded model; in replay mode
        check that vLLM will call the forward through the hook the driver sits in."""
        if not self.layers:
            return model
        if self.main_layers is None:  # the target model loads first; a speculative drafter's layers come after
            self.main_layers = len(self.layers)
            if self.section.records_steps:
                self._check_replayable(vllm_config)
        return self.fp4.install_gate(self.section, model, vllm_config)

    def _check_replayable(self, vllm_config: Any) -> None:
        if vllm_config is None:
            return
        fix = (f"serve with --set moe_graphs=split (`moetplan run {self.plan_path or 'plan.json'} --set "
               "moe_graphs=split`)")
        if not FORWARD_HOOKED:
            raise ConfigError("this tiered plan re-runs a step that missed (moe_graphs=replay), but the moetplan "
                              "plugin could not wrap this vLLM's forward call (runtime/plugin.py: prepare_replay), "
                              "so a miss would go unanswered; " + fix)
        if getattr(vllm_config, "use_v2_model_runner", False):
            raise ConfigError("this tiered plan re-runs a step that missed (moe_graphs=replay) through Model Runner "
                              "V1's forward call, and vLLM chose Model Runner V2: start the server with "
                              f"VLLM_USE_V2_MODEL_RUNNER=0 (`moetplan run` sets it), or {fix}")
        mc = getattr(vllm_config, "model_config", None)
        if mc is not None and (getattr(mc, "is_hybrid", False) or getattr(mc, "is_attention_free", False)):
            raise ConfigError(f"{getattr(mc, 'model', 'this model')} keeps recurrent state (Mamba / linear "
                              "attention) that a step updates in place, so a step cannot be run twice; " + fix)

    # ------------------------------------------------------------------ the step (replay mode)

    def forward_step(self, call: Any, tokens: int, eager: Any = None) -> Any:
        """vLLM's forward call of one step (the plugin's runner hook), run through the replay driver when this
        plan records its steps (vLLM's first forwards, before the record and the store exist, run as they are)."""
        rec = self.step_rec
        if not self.section.records_steps or rec is None:
            return call()
        store = self.tiered.store if self.tiered is not None else None
        if self.section.replays and store is None:
            return call()
        reserve = self.fp4.reserve
        if self.replay is None:
            self.replay = self._driver(rec, store, reserve)
        router = self.router
        snap = router.snapshot() if router is not None else None
        restore = (lambda: router.restore(snap)) if router is not None else None
        if store is not None:
            store.close_open_step()
        if reserve is not None:
            reserve.begin_step()
        large = tokens > (store.prefill_tokens if store is not None else self.section.decode_batch_tokens)
        return self.replay.step(call, large=large, eager=eager, before_rerun=restore)

    def _driver(self, rec: StepMisses, store: Any, reserve: Any) -> ReplayDriver:
        def observe(routings: Any, missed: Any, large: bool) -> None:
            if store is not None:
                store.observe_step(routings, missed, large)
            if reserve is not None:
                reserve.observe_counts(routings)

        def end_step() -> None:
            if store is not None:
                store.begin_step()
            if reserve is not None:
                reserve.sync_graph_tables()
                reserve.end_step()

        def no_store(need: Any) -> int:  # resident rows never miss
            return 0

        return ReplayDriver(rec, store.fetch_step if store is not None else no_store, main_layers=self.main_layers,
                            gpu_expert_cache_slots=self.section.gpu_expert_cache_slots, observe=observe,
                            end_step=end_step, agree=tp_any if self.section.tp > 1 else None)

    # ------------------------------------------------------------------ the op

    def run_layer(self, key: int, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.graph is not None:
            return self._run_layer_in_graph(key, x, topk_weights, topk_ids)
        st = self.layers[key]
        t0 = time.perf_counter()
        warmup = is_warmup()
        ctrl = self.fp4.controller
        out = st.forward(x, topk_weights, topk_ids, warmup)
        self.stats.on_call(st.first, int(x.shape[0]), int(topk_ids.numel()), warmup, time.perf_counter() - t0,
                           recompute=ctrl is not None and ctrl.recomputing)
        w = self.writer()
        if w is not None:
            w.maybe_write()
        return out

    def _run_layer_in_graph(self, key: int, x: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor) -> torch.Tensor:
        """The capture-safe call: kernel launches and, at the first MoE layer, the step's two counter adds. A
        graph replays what this records, so nothing here may read the device or keep Python state per call.
        vLLM's warmup runs are eager and not counted; a capture records the adds whatever its forward context."""
        st = self.layers[key]
        if not st.first:
            return st.forward(x, topk_weights, topk_ids)
        call = CallPaths()
        out = st.forward(x, topk_weights, topk_ids, paths=call)
        if capturing() or not is_warmup():
            assert self.graph is not None
            self.graph.step(int(x.shape[0]), int(topk_ids.shape[1]), call)
        return out

    # ------------------------------------------------------------------ run record

    def store_kpis(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        layers = list(self.layers.values())
        tiers = {st.tier for st in layers}
        out["expert_tier"] = ",".join(sorted(tiers)) if tiers else None
        out["expert_format"] = next((st.fmt for st in layers), None)
        out["expert_sources"] = sorted({st.source for st in layers})
        if self.graph is None:
            out.update(self.paths.as_dict())
        else:
            try:
                out.update({k: v for k, v in self.graph_summary().items() if k.startswith("kernel_")})
            except Exception as e:
                out["graph_counters_error"] = repr(e)
        if self.tiered is not None and self.tiered.pack_path:
            out["pack"] = self.tiered.pack_path
        if self.replay is not None:
            counts = self.replay.counts.as_dict()
            out["replay"] = counts  # steps, replayed steps, passes, fetched rows, batches
            out["replay_rate"] = counts["replay_rate"]
        elif self.section.records_steps:
            out["replay"] = {"steps": 0, "note": "no step has run through the replay driver yet"}
        if layers and all(st.store is None for st in layers):
            # Every routed expert is in the device pool: every routing is a hit, no step waits on a fetch.
            out.update(token_hit_rate=1.0, misses_per_step=0.0, zero_miss_step_share=1.0)
            return out
        store = self.tiered.store if self.tiered is not None else None
        if store is not None:
            try:
                out.update(store.stats())  # hit rates, misses per step, bytes moved: already in the Plan's names
            except Exception as e:  # a broken KPI read must not take the worker down
                out["store_kpi_error"] = repr(e)
        return out

    def graph_summary(self) -> dict[str, Any]:
        """The device counters at this moment (one copy to the host), as the run record names them."""
        assert self.graph is not None
        return self.graph.summary(len(self.layers))

    def make_record(self) -> Any:
        s = self.section
        extra: dict[str, Any] = {"tp_rank": self.rank, "worker_pid": os.getpid(), "weights": s.knobs.weights,
                                 "router": s.knobs.router}
        if self.graph is not None:
            try:
                extra.update({k: v for k, v in self.graph_summary().items() if not k.startswith("kernel_")})
            except Exception as e:  # a failed device read (at exit, a lost context) must not take the worker down
                extra["graph_counters_error"] = repr(e)
        return records.build_run_record(s, self.plan_path, self.stats,
                                        store_kpis={**self.store_kpis(), **self.fp4.kpis()}, extra_runtime=extra)

    def record_version(self) -> tuple[Any, ...]:
        """Changes whenever the record would: MoE calls, and gate steps / reserve promotions (the gate judges a
        step after its MoE calls, and the background promoter works between steps)."""
        st = self.stats
        graph: Any = 0
        if self.graph is not None:
            try:
                graph = self.graph.version()
            except Exception as e:  # the flusher thread must outlive a failed read
                graph = repr(e)
        steps = self.replay.counts.steps if self.replay is not None else 0
        return (st.moe_calls, st.warmup_calls, st.recompute_calls, st.layers, graph, steps, *self.fp4.version())

    def record_path(self) -> str | None:
        if self.section.knobs.record_path:
            return self.section.knobs.record_path
        return str(records.run_record_path(self.plan_path, self.rank)) if self.plan_path else None

    def writer(self) -> records.RecordWriter | None:
        if self._writer is None:
            path = self.record_path()
            if path is None:
                return None
            self._writer = records.RecordWriter(path, self.make_record, self.section.knobs.record_interval_s,
                                                version=self.record_version)
            self._writer.start_flusher()
            atexit.register(self._writer.close)
        return self._writer

    def close(self) -> None:
        """Stop the reserve's promoter and the record's flusher (tests; a served worker exits instead)."""
        self.fp4.close()
        if self._writer is not None:
            self._writer.stop_flusher()


_PROCESS: WorkerRuntime | None = None
# Set by the plugin once vLLM's per-step forward call runs through `around_forward` in this process.
FORWARD_HOOKED = False
_PROCESS_LOCK = threading.Lock()


def process_worker() -> WorkerRuntime:
    """This process's WorkerRuntime (what a pickled one becomes in the process that unpickles it)."""
    return WorkerRuntime.for_process()


def around_forward(call: Any, tokens: int, eager: Any = None) -> Any:
    """The plugin's runner hook: one step's forward call, through this process's worker when it serves a
    moetplan model (a process without one, or another model, runs the call as it is)."""
    w = _PROCESS
    if w is None:
        return call()
    return w.forward_step(call, tokens, eager)


__all__ = ["WorkerRuntime", "around_forward", "is_warmup", "process_worker", "tp_rank"]
