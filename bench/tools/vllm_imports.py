"""Which third-party packages a vLLM source tree imports to serve a text model: a static import closure.

    python bench/tools/vllm_imports.py /path/to/unpacked/wheel [--json]

From the modules a `vllm serve` of a MoE text model on CUDA goes through (CLI and OpenAI server, engine core,
executor, GPU worker and model runners, the CUDA platform, the target models, their attention backends, fused
MoE and the checkpoint quantizations), it follows every import that runs when its module is imported: module
level and class bodies (`eager`); under a module-level `if` (platform, environment, `has_x()` checks:
`conditional`, decided by reading the condition); guarded by `try/except ImportError` or `contextlib.suppress`
(`optional`); inside functions (`lazy`: it runs only if that code runs). A package seen only in the weaker kinds
travels when the serving path is known to need it (bench/tools/device_wheels.sh lists those by name).

Relative imports, `from pkg import submodule` and parent packages (`a.b.c` imports `a` and `a.b`) are
resolved against the tree. Output: for each third-party top-level module, how it is imported and by whom.

    PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD python3 bench/tools/vllm_imports.py --check

On the GPU machine (bench/tools/device_install.sh runs it): import what serving needs, then what DeepSeek-V4's
CUDA path imports inside functions (the KV compressor's and the indexer's CuTe-DSL kernels, TileLang, DeepGEMM),
found by reading the installed modules; run one kernel of each pruned extension. Exit 1 on any failure, each named.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

# What `vllm serve <moe model>` imports on CUDA before the first request (and what the plugin imports).
ENTRY_MODULES = (
    "vllm",
    "vllm.entrypoints.cli.main",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.openai.completion.serving",
    "vllm.entrypoints.openai.chat_completion.serving",
    "vllm.v1.engine.core",
    "vllm.v1.engine.async_llm",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.platforms.cuda",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.model_loader.default_loader",
    "vllm.model_executor.model_loader.dummy_loader",
    "vllm.model_executor.models.deepseek_v2",
    "vllm.model_executor.models.deepseek_mtp",
    "vllm.model_executor.models.qwen3_moe",
    "vllm.models.deepseek_v4",
    "vllm.models.deepseek_v4.nvidia.model",
    "vllm.models.deepseek_v32",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.attention.backends.mla.flashmla",
    "vllm.v1.attention.backends.mla.flashmla_sparse",
    "vllm.v1.attention.backends.mla.flashattn_mla",
    "vllm.v1.attention.backends.mla.flashattn_mla_sparse",
    "vllm.v1.attention.backends.mla.triton_mla",
    "vllm.v1.attention.backends.mla.indexer",
    "vllm.model_executor.layers.fused_moe",
    "vllm.model_executor.layers.fused_moe.runner.moe_runner",
    "vllm.model_executor.layers.quantization.fp8",
    "vllm.model_executor.layers.quantization.modelopt",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
    "vllm.v1.sample.sampler",
    "vllm.v1.structured_output",
    "vllm.tokenizers",
    "vllm.reasoning",
    "vllm.tool_parsers",
)

OPTIONAL_EXCEPTIONS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException", "OSError", "RuntimeError",
                       "AttributeError"}


@dataclass
class Imports:
    eager: set[str] = field(default_factory=set)  # absolute module names imported at import time
    conditional: set[str] = field(default_factory=set)  # ... under a module-level `if` (platform, env, has_x())
    optional: set[str] = field(default_factory=set)  # ... inside try/except ImportError
    lazy: set[str] = field(default_factory=set)  # ... inside functions


def _resolve(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    parts = module.split(".")
    base = parts if is_pkg else parts[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _guarded(handlers: list[ast.ExceptHandler]) -> bool:
    for h in handlers:
        if h.type is None:
            return True
        names = [h.type] if not isinstance(h.type, ast.Tuple) else list(h.type.elts)
        for n in names:
            if isinstance(n, ast.Name) and n.id in OPTIONAL_EXCEPTIONS:
                return True
            if isinstance(n, ast.Attribute) and n.attr in OPTIONAL_EXCEPTIONS:
                return True
    return False


def _suppress_guard(item: ast.withitem) -> bool:
    call = item.context_expr
    if not isinstance(call, ast.Call):
        return False
    fn = call.func
    name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
    return name == "suppress"


def scan_module(tree: ast.AST, module: str, is_pkg: bool) -> Imports:
    out = Imports()

    def add(kind: set[str], node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                kind.add(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_pkg, node.level, node.module)
            kind.add(base)
            for a in node.names:  # `from pkg import submodule` (resolved later if it is a module)
                if a.name != "*":
                    kind.add(f"{base}.{a.name}")

    def walk(nodes: list[ast.stmt], kind: set[str]) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                add(kind, node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        add(out.lazy, sub)
            elif isinstance(node, ast.ClassDef):
                walk(node.body, kind)
            elif isinstance(node, ast.Try):
                inner = out.optional if _guarded(node.handlers) else kind
                walk(node.body, inner)
                for h in node.handlers:
                    walk(h.body, out.optional)
                walk(node.orelse, kind)
                walk(node.finalbody, kind)
            elif isinstance(node, ast.If):
                test = node.test
                if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
                        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING":
                    walk(node.orelse, kind)
                    continue
                inner = out.conditional if kind is out.eager else kind
                walk(node.body, inner)
                walk(node.orelse, inner)
            elif isinstance(node, ast.With):
                inner = out.optional if any(_suppress_guard(i) for i in node.items) else kind
                walk(node.body, inner)
            elif isinstance(node, (ast.For, ast.While)):
                walk(node.body, kind)
                walk(node.orelse, kind)

    walk(getattr(tree, "body", []), out.eager)
    return out


class Tree:
    def __init__(self, root: Path):
        self.root = root

    def path_of(self, module: str) -> tuple[Path, bool] | None:
        rel = Path(*module.split("."))
        pkg = self.root / rel / "__init__.py"
        if pkg.is_file():
            return pkg, True
        mod = self.root / rel.with_suffix(".py")
        if mod.is_file():
            return mod, False
        return None

    def is_local(self, module: str) -> bool:
        top = module.split(".")[0]
        return (self.root / top).is_dir() or (self.root / f"{top}.py").is_file()


KINDS = ("eager", "conditional", "optional", "lazy")

# The install check: what `vllm serve` and the plugin import, and the modules of DeepSeek-V4's CUDA path.
CHECK_MODULES = (
    "vllm", "vllm.entrypoints.openai.api_server", "vllm.v1.engine.core", "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner", "vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch",
    "vllm.vllm_flash_attn.flash_attn_interface", "vllm.model_executor.models.deepseek_v2",
    "vllm.models.deepseek_v32", "moetplan.runtime.plugin",
    "vllm.models.deepseek_v4", "vllm.models.deepseek_v4.compressor", "vllm.models.deepseek_v4.attention",
    "vllm.models.deepseek_v4.nvidia.model", "vllm.models.deepseek_v4.nvidia.mtp",
    "vllm.models.deepseek_v4.nvidia.flashmla", "vllm.model_executor.layers.sparse_attn_indexer",
    "vllm.v1.attention.backends.mla.indexer", "vllm.v1.attention.backends.mla.sparse_swa",
    "vllm.third_party.deep_gemm", "cutlass", "cutlass.cute", "quack", "quack.compile_utils", "tilelang",
    # the serving flags hwdb/serving.yaml gives DeepSeek-V4 (tool / reasoning parser, tokenizer mode)
    "vllm.tool_parsers.deepseekv4_engine_tool_parser", "vllm.reasoning.deepseek_v4_engine_reasoning_parser",
    "vllm.tokenizers.deepseek_v4",
)
# Packages whose function-level imports the check follows (one level: what those modules import when they load
# runs anyway), and the folders of other platforms' code, never reached on CUDA.
LAZY_FOLLOW = ("vllm.models.deepseek_v4", "vllm.v1.attention.backends.mla.sparse_swa",
               "vllm.v1.attention.backends.mla.indexer", "vllm.model_executor.layers.sparse_attn_indexer")
OTHER_PLATFORMS = (".amd", ".xpu", ".rocm", ".tpu", ".cpu")
# Packages serving on sm_90 does not use (docs/VLLM_VERSIONS.md "The GPU machine": left behind on purpose).
NOT_CARRIED = ("aiter", "vllm_xpu_kernels", "flashinfer", "deep_ep", "mori", "nixl_ep", "tokenspeed_mla",
               "humming")


def function_imports(tree: Tree, package: str) -> dict[str, str]:
    """Module -> the module that imports it inside a function, for every module under `package` (a module or a
    package folder), other platforms' folders excluded."""
    found = tree.path_of(package)
    if found is None:
        return {}
    path, is_pkg = found
    files = sorted(path.parent.rglob("*.py")) if is_pkg else [path]
    out: dict[str, str] = {}
    for f in files:
        rel = f.relative_to(tree.root).with_suffix("")
        parts = list(rel.parts)
        f_is_pkg = parts[-1] == "__init__"
        if f_is_pkg:
            parts = parts[:-1]
        module = ".".join(parts)
        if any(f".{p}" in OTHER_PLATFORMS for p in parts):
            continue
        try:
            parsed = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for fn in ast.walk(parsed):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [_resolve(module, f_is_pkg, node.level, node.module)]
                else:
                    continue
                for name in names:
                    if name and not any(p in name for p in OTHER_PLATFORMS) \
                            and name.split(".")[0] not in NOT_CARRIED:
                        out.setdefault(name, module)
    return out


def check(root: Path) -> int:
    """The install check on the GPU machine (see the module doc)."""
    import importlib
    import importlib.metadata as md

    bad: list[str] = []

    def try_import(m: str, why: str = "") -> None:
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001 - report every failure, not the first
            bad.append(f"import {m}{why}: {type(e).__name__}: {e}")

    for m in CHECK_MODULES:
        try_import(m)
    lazy: dict[str, str] = {}
    for pkg in LAZY_FOLLOW:
        lazy.update(function_imports(Tree(root), pkg))
    for m, by in sorted(lazy.items()):
        if m.split(".")[0] in sys.stdlib_module_names:
            continue
        try_import(m, f" (inside a function of {by})")
    print(f"imported {len(CHECK_MODULES)} serving modules and {len(lazy)} function-level imports of "
          f"{', '.join(LAZY_FOLLOW)}")
    eps = [e.name for e in md.entry_points(group="vllm.general_plugins")]
    versions = {}
    for dist in ("vllm", "nvidia-cutlass-dsl", "quack-kernels", "tilelang", "openai", "torch"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
            bad.append(f"no {dist} metadata (dist-info) installed")
    print("versions:", versions, "| vllm plugins:", eps)
    if "moetplan" not in eps:
        bad.append("moetplan's vllm.general_plugins entry point is missing")
    try:
        _kernel_check(bad)
    except Exception as e:  # noqa: BLE001
        bad.append(f"kernel check: {type(e).__name__}: {e}")
    for line in bad:
        print("FAILED", line)
    return 1 if bad else 0


def _kernel_check(bad: list[str]) -> None:
    import torch

    if bad or not torch.cuda.is_available():
        return
    from vllm.vllm_flash_attn import flash_attn_interface as fa

    print("FA3 available:", fa.FA3_AVAILABLE, "| FA2 available:", fa.FA2_AVAILABLE)
    # one kernel from each pruned extension: the sm_90 code kept by bench/tools/fatbin_prune.py loads and runs
    from vllm import _custom_ops as ops

    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    out, w = torch.empty_like(x), torch.ones(256, device="cuda", dtype=torch.bfloat16)
    ops.rms_norm(out, x, w, 1e-6)
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    logits = torch.randn(4, 16, device="cuda")
    tw = torch.empty(4, 2, device="cuda")
    ti = torch.empty(4, 2, device="cuda", dtype=torch.int32)
    ops.topk_softmax(tw, ti, torch.empty_like(ti), logits, False)
    torch.cuda.synchronize()
    ok_norm = torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2)
    ok_topk = torch.equal(ti.sort(-1).values.long(), logits.topk(2, -1).indices.sort(-1).values)
    print("sm_90 kernels: rms_norm", "ok" if ok_norm else "WRONG", "| topk_softmax", "ok" if ok_topk else "WRONG")
    if not (ok_norm and ok_topk):
        bad.append("a pruned extension computed a wrong result")


def closure(tree: Tree, entries: tuple[str, ...]) -> dict[str, dict[str, set[str]]]:
    """Third-party top-level module -> {kind: importing vLLM modules}. A vLLM module reached only through
    conditional imports passes that on: its own eager imports count as conditional."""
    strength: dict[str, str] = {}  # vLLM module -> "eager" | "conditional" (how it is reached)
    todo = [(m, "eager") for m in entries]
    third: dict[str, dict[str, set[str]]] = {}

    def note(name: str, how: str, by: str) -> None:
        third.setdefault(name.split(".")[0], {k: set() for k in KINDS})[how].add(by)

    while todo:
        module, reach = todo.pop()
        if strength.get(module) == "eager" or strength.get(module) == reach:
            continue
        strength[module] = reach
        found = tree.path_of(module)
        if found is None:
            continue
        path, is_pkg = found
        try:
            parsed = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        imps = scan_module(parsed, module, is_pkg)
        parts = module.split(".")
        todo.extend((".".join(parts[:i]), reach) for i in range(1, len(parts)))  # parent packages run first
        for how, names in (("eager", imps.eager), ("conditional", imps.conditional), ("optional", imps.optional),
                           ("lazy", imps.lazy)):
            kind = "conditional" if how == "eager" and reach == "conditional" else how
            for name in names:
                if not name:
                    continue
                if tree.is_local(name):
                    if kind in ("eager", "conditional") and tree.path_of(name) is not None:
                        todo.append((name, kind))
                    continue
                if name.split(".")[0] in sys.stdlib_module_names:
                    continue
                note(name, kind, module)
    return third


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", type=Path, nargs="?", help="an unpacked vLLM wheel (the folder holding vllm/)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--check", action="store_true", help="import-check the installed vLLM (the GPU machine)")
    args = ap.parse_args(argv)
    if args.check:
        if args.root is None:
            import importlib.util

            spec = importlib.util.find_spec("vllm")
            if spec is None or spec.origin is None:
                raise SystemExit("vllm is not importable: set PYTHONPATH to the install (/tmp/site)")
            args.root = Path(spec.origin).parents[1]
        raise SystemExit(check(args.root))
    if args.root is None:
        ap.error("give the unpacked wheel's folder (or --check)")
    found = closure(Tree(args.root), ENTRY_MODULES)
    rows = {name: {k: sorted(v) for k, v in kinds.items()} for name, kinds in sorted(found.items())}
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for i, kind in enumerate(KINDS):
        stronger = KINDS[:i]
        names = [n for n, r in rows.items() if r[kind] and not any(r[k] for k in stronger)]
        print(f"{kind} ({len(names)}): {' '.join(names)}")


if __name__ == "__main__":
    main()
