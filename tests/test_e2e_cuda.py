"""The three target architectures served by `moetplan run` on CUDA vLLM with CUDA graphs (markers `gpu`, `vllm`).

GlmMoeDsaForCausalLM (sparse MLA + indexer, FLASHMLA_SPARSE on sm_90), DeepseekV4ForCausalLM (compressed sparse
attention, hyper-connections) and DeepseekV3ForCausalLM as Kimi (dense MLA), as tiny random models
(moetplan.models.tiny_arch: each real model's attention geometry, fewer layers / experts, a small residual
stream), 2-bit experts resident, served with random weights of trained-model magnitude (tests/gpu_scaled_loader.py:
with vLLM's own +-1e-3 dummy weights the MoE would not reach the logits and the reference check below would
be empty). Per architecture three servers start side by side (their KV pools fixed with --kv-cache-memory-bytes,
so no memory profile sees another): the plan as planned (CUDA kernels, CUDA graphs), the same plan eager
(`--enforce-eager`: CUDA kernels, no torch.compile, no graphs) and the same plan with the kernel policy asking for
the torch reference (eager: it is the oracle, not a speed). Kernels-eager against reference-eager is the kernels'
error alone; kernels-graphs against kernels-eager is what compilation changes (fusions, their precision), recorded
beside it: the first graphs-vs-reference comparison (rel. L2 0.088) mixed the two.

Checked: it answers (HTTP 200, the tokens asked for); the same greedy request twice gives the same tokens
(prefix caching off, so both requests run the same shapes); the 2-bit kernels' logits are within the documented
prefill tolerance of the reference's, per MoE layer (teacher-forced prompt logprobs, moetplan.measure.logprobs);
CUDA graphs were captured and the resident tier's launch does not split the graph at the MoE op; the run record's
kernel paths are CUDA paths with no fallback; each run stops with no process left.

Runtime on an H200: the slowest start (DeepSeek-V4's JIT kernels) decides, about 3-6 minutes for all six servers.
MOETPLAN_E2E_ARCHS=glm-moe-dsa,kimi-mla picks architectures; MOETPLAN_E2E_OUT names a folder for a summary JSON
(the device driver passes $OUT).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

from gpu_scaled_loader import LOAD_FORMAT, dist_info  # noqa: E402

from moetplan.models import tiny_arch  # noqa: E402

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SELECTED = [a for a in os.environ.get("MOETPLAN_E2E_ARCHS", ",".join(tiny_arch.ARCHS)).split(",") if a]
PROMPT = "hello world, the model serves every expert"
MAX_TOKENS = 16
CONTEXT = 512
STARTUP_S = float(os.environ.get("MOETPLAN_E2E_STARTUP_S", "540"))
KV_BYTES = 1 << 30
# docs/KERNELS.md, Tolerance: the routed (prefill) path's relative L2 error vs the float32 reference is <= 1e-2
# per call; to first order each MoE layer adds its share, so the logits may drift by up to that much per layer.
PREFILL_TOL = 1e-2
TOP_LOGPROBS = 20  # vLLM's default max_logprobs
# nats; weights of trained magnitude spread a random model's top logits by ~1, vLLM's +-1e-3 dummy ones by ~1e-6.
MIN_LOGIT_SPREAD = 0.05
# The servers per architecture: CUDA kernels with graphs (as planned), the same eager, the torch reference eager.
KINDS = ("kernels", "eager", "reference")


@dataclass
class Served:
    arch: str
    folder: Path
    moe_layers: int
    runs: dict[str, Any] = field(default_factory=dict)  # "kernels" / "eager" / "reference" -> RunProcess
    plans: dict[str, Path] = field(default_factory=dict)
    ready: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


def _profile():
    import psutil

    from moetplan.contract import HardwareProfile, HostInfo
    from moetplan.hw.gpus import query_gpus

    gpus = query_gpus().gpus
    if not gpus:
        pytest.skip("the NVIDIA driver reports no GPU")
    return HardwareProfile(source="probe", description="GPU 0 of this machine (driver query)", gpus=gpus[:1],
                           host=HostInfo(ram_gib=psutil.virtual_memory().total / 2**30))


def _plans(arch: str, folder: Path, hw: Any) -> dict[str, Path]:
    """The kernel plan as the planner makes it for this GPU, and its twin whose kernel policy is the reference."""
    from moetplan.contract import Goals, Plan, load_json, save_json
    from moetplan.plan.solver import solve

    cfg = json.loads((folder / "config.json").read_text())
    spec = tiny_arch.tiny_spec(arch, cfg, folder)
    pins = {"expert_tier": "resident", "mtp": 0, "context": CONTEXT, "max_num_seqs": 4, "fp4_reserve_gib": 0.0,
            "gpu_memory_utilization": 0.15}
    plan = solve(spec, hw, Goals(context=CONTEXT, pinned=pins))
    plan.launch.model_path, plan.launch.served_model_name = str(folder), f"tiny-{arch}"
    kernels = folder / "plan.json"
    save_json(plan, kernels)
    doc = json.loads(kernels.read_text())
    ref_env = force_reference(doc)
    reference = folder / "plan.reference.json"
    reference.write_text(json.dumps(doc, indent=2))
    load_json(Plan, reference)  # the schema takes the policy as written
    eager = folder / "plan.eager.json"  # the kernels' plan again: its own run record, its own server
    eager.write_text(kernels.read_text())
    return {"kernels": kernels, "eager": eager, "reference": reference,  # type: ignore[dict-item]
            "reference_env": ref_env}


def force_reference(plan_doc: dict[str, Any]) -> dict[str, str]:
    """Make a plan document ask for the torch reference: through the plan's kernel policy where the contract has
    one (contract/runtime.py), else the environment switch older runtimes read. Returns env additions."""
    from moetplan.contract import Plan

    if "runtime_knobs" in Plan.model_fields:
        knobs = plan_doc.setdefault("runtime_knobs", {})
        knobs.setdefault("kernels", {})["cuda"] = False
        return {}
    return {"MOETPLAN_KERNELS": "off"}


def _env(tmp: Path) -> dict[str, str]:
    plug = dist_info(tmp / "plugins")
    path = [str(plug), str(TESTS), str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    return {**os.environ, "PYTHONPATH": ":".join(path), "VLLM_USE_FLASHINFER_SAMPLER": "0",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def _build_kernels(env: dict[str, str]) -> None:
    # One build before six servers start (they would otherwise queue on the extension's build lock).
    res = subprocess.run([sys.executable, "-m", "moetplan.cli", "build-kernels"], env=env, capture_output=True,
                         text=True, timeout=900)
    if res.returncode != 0:
        pytest.fail(f"moetplan build-kernels failed: {res.stdout[-2000:]}{res.stderr[-2000:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict[str, Served]:
    from moetplan.launch.harness import RunFailed, RunProcess
    from served import free_port

    tmp = tmp_path_factory.mktemp("e2e_cuda")
    env = _env(tmp)
    _build_kernels(env)
    hw = _profile()
    out: dict[str, Served] = {}
    for arch in SELECTED:
        cfg = tiny_arch.config(arch, "cuda")
        folder = tiny_arch.write_model_folder(tmp / arch, cfg)
        s = out[arch] = Served(arch, folder, int(cfg["num_hidden_layers"]) - int(cfg.get("first_k_dense_replace", 0)))
        try:
            plans = _plans(arch, folder, hw)
        except Exception as e:  # noqa: BLE001 - a plan that cannot be made fails this architecture only
            s.failures = {k: f"planning failed: {type(e).__name__}: {e}" for k in KINDS}
            continue
        common = ["--load-format", LOAD_FORMAT, "--no-enable-prefix-caching", "--kv-cache-memory-bytes",
                  str(KV_BYTES), "--seed", "0"]
        for kind in KINDS:
            s.plans[kind] = plans[kind]
            extra = common + (["--enforce-eager"] if kind != "kernels" else [])
            run_env = {**env, **(plans["reference_env"] if kind == "reference" else {})}
            s.runs[kind] = RunProcess([str(plans[kind]), "--port", str(free_port()), "--timeout", str(STARTUP_S),
                                       "--", *extra], env=run_env, log_path=folder / f"{kind}.events.log").start()
    for s in out.values():
        for kind, run in s.runs.items():
            try:
                s.ready[kind] = run.wait_ready(STARTUP_S + 60)
            except RunFailed as e:
                s.failures[kind] = str(e)
    yield out
    for s in out.values():
        for run in s.runs.values():
            run.stop()
    _write_summary(out)


def _write_summary(out: dict[str, Served]) -> None:
    folder = os.environ.get("MOETPLAN_E2E_OUT")
    if not folder:
        return
    doc = {a: {"failures": s.failures, "startup_s": {k: r.get("startup_s") for k, r in s.ready.items()},
               **s.summary} for a, s in out.items()}
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "e2e_cuda_summary.json").write_text(json.dumps(doc, indent=2, default=str))


def _need(served: dict[str, Served], arch: str, *kinds: str) -> Served:
    s = served[arch]
    for kind in kinds:
        if kind in s.failures:
            pytest.fail(f"{arch} {kind} server: {s.failures[kind]}")
    return s


def _argv(s: Served) -> list[str]:
    starting = s.runs["kernels"].event("starting") or {}
    return list(starting.get("argv") or [])


def _flag(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _record(plan: Path, min_calls: int, timeout: float = 30.0) -> dict[str, Any]:
    from moetplan.contract import RunRecord, load_json, run_record_path

    path = run_record_path(plan)
    end, rec = time.monotonic() + timeout, None
    while time.monotonic() < end:  # the worker's flusher writes the record about once a second
        if path.exists():
            try:
                rec = load_json(RunRecord, path)
            except Exception:  # noqa: BLE001 - caught mid-write; the next poll reads it whole
                rec = None
            if rec is not None and rec.runtime.get("moe_calls", 0) >= min_calls:
                break
        time.sleep(0.5)
    assert rec is not None, f"no run record at {path}"
    return rec.runtime


@pytest.mark.parametrize("arch", SELECTED)
def test_answers_with_cuda_graphs_captured(served, arch):
    from moetplan.measure.logprobs import completion, token_ids

    s = _need(served, arch, "kernels")
    doc = completion(s.runs["kernels"].url, s.ready["kernels"]["model"], PROMPT, MAX_TOKENS)
    _, out = token_ids(doc)
    assert len(out) == MAX_TOKENS and doc["usage"]["completion_tokens"] == MAX_TOKENS
    argv = _argv(s)
    assert "--enforce-eager" not in argv
    comp = json.loads(_flag(argv, "--compilation-config") or "{}")
    assert comp.get("cudagraph_mode", "PIECEWISE") not in ("NONE", 0)
    progress = [e.get("message", "") for e in s.runs["kernels"].events if e.get("event") == "progress"]
    assert any("capturing CUDA graphs" in m for m in progress), progress[-10:]
    s.summary["tokens"] = out


@pytest.mark.parametrize("arch", SELECTED)
def test_resident_tier_does_not_split_the_graph_at_moe(served, arch):
    s = _need(served, arch, "kernels")
    comp = json.loads(_flag(_argv(s), "--compilation-config") or "{}")
    split = [op for op in comp.get("splitting_ops") or [] if "moe" in op.lower()]
    assert split == [], f"the resident tier's launch splits the CUDA graph at {split}"


@pytest.mark.parametrize("arch", SELECTED)
def test_greedy_tokens_are_the_same_run_to_run(served, arch):
    from moetplan.measure.logprobs import completion, token_ids

    s = _need(served, arch, "kernels")
    url, model = s.runs["kernels"].url, s.ready["kernels"]["model"]
    a = token_ids(completion(url, model, PROMPT, MAX_TOKENS))[1]
    b = token_ids(completion(url, model, PROMPT, MAX_TOKENS))[1]
    assert a == b


@pytest.mark.parametrize("arch", SELECTED)
def test_2bit_kernels_match_the_torch_reference(served, arch):
    from moetplan.measure.logprobs import centered_error, completion, prompt_table, token_ids, top1_agreement

    s = _need(served, arch, *KINDS)

    def url_model(kind: str) -> tuple[str, str]:
        return s.runs[kind].url, s.ready[kind]["model"]

    prompt, gen = token_ids(completion(*url_model("eager"), PROMPT, MAX_TOKENS))
    ids = prompt + gen  # one sequence, scored by every server
    table = {k: prompt_table(completion(*url_model(k), ids, 1, prompt_logprobs=TOP_LOGPROBS)) for k in KINDS}
    greedy = {k: token_ids(completion(*url_model(k), PROMPT, MAX_TOKENS))[1] for k in KINDS}
    tol = PREFILL_TOL * s.moe_layers

    def compare(a: str, b: str) -> dict[str, Any]:
        err = centered_error(table[a], table[b])
        return {**err, "top1_agreement": top1_agreement(table[a], table[b]), "greedy_equal": greedy[a] == greedy[b]}

    kernel = s.summary["reference"] = {**compare("eager", "reference"), "tolerance": tol}  # the kernels alone
    s.summary["graphs_vs_eager"] = compare("kernels", "eager")  # compilation alone
    s.summary["graphs_vs_reference"] = compare("kernels", "reference")  # both (the first check's figure)
    assert kernel["positions"] >= len(ids) - 2 and kernel["rel_l2"] is not None
    # Not vacuous: the logits must spread (a model whose every token is equally likely matches anything).
    assert kernel["reference_rms"] >= MIN_LOGIT_SPREAD, kernel
    assert kernel["rel_l2"] <= tol, s.summary


@pytest.mark.parametrize("arch", SELECTED)
def test_run_record_names_cuda_kernel_paths_only(served, arch):
    s = _need(served, arch, *KINDS)
    rt = _record(s.plans["kernels"], min_calls=s.moe_layers * MAX_TOKENS)
    assert "kernel_paths" in rt, ("the run record names no kernel path: the runtime's PathLog "
                                  "(contract.runtime / ops.PathLog) is not in this tree")
    paths = rt["kernel_paths"]
    s.summary["kernel_paths"] = paths
    assert paths and all(name.startswith("cuda:") for name in paths), paths
    assert rt.get("kernel_fallbacks", 0) == 0, rt.get("kernel_fallback_reasons")
    ref = _record(s.plans["reference"], min_calls=s.moe_layers)
    assert set(ref.get("kernel_paths") or {}) == {"reference"}, ref.get("kernel_paths")


@pytest.mark.parametrize("arch", SELECTED)
def test_runs_stop_with_no_process_left(served, arch):
    s = served[arch]
    for kind, run in s.runs.items():
        stopped = run.stop()
        assert stopped.get("leftover") == [] and not stopped.get("leftover_killed"), (kind, stopped)
