"""The CUDA fixes the plugin carries (runtime/vllm/cuda_fixes.py), checked without a GPU.

The Triton MLA one is checked on the installed vLLM's own kernel: its launch parameters for a 576-wide MLA head
with an fp8 KV cache are recorded from vLLM's launcher (with the kernel swapped for a recorder), then the kernel
is compiled for sm_120 by Triton (it compiles for a target without the device) and its shared memory compared
with the 99 KiB an sm_12x block may use: over it as vLLM launches it, within it with the fix.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from moetplan.runtime.vllm import cuda_fixes as cf

# --------------------------------------------------------------------------- Triton MLA decode stages


def test_cap_stages_only_touches_576_wide_mla_tiles():
    mla = {"IS_MLA": True, "BLOCK_DMODEL": 512, "BLOCK_DPE": 64, "num_stages": 2, "num_warps": 4}
    assert cf.cap_stages(mla)["num_stages"] == 1
    assert cf.cap_stages({k: v for k, v in mla.items() if k != "num_stages"})["num_stages"] == 1  # Triton's 3
    for other in ({**mla, "BLOCK_DMODEL": 256, "BLOCK_DPE": 32}, {**mla, "IS_MLA": False}, {**mla, "num_stages": 1}):
        assert cf.cap_stages(other) == other


def test_stage_capped_kernel_passes_other_launches_and_attributes_through():
    calls = []

    class Kernel:
        arg_names = ["Q"]

        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    mod = types.SimpleNamespace(_fwd_grouped_kernel_stage1=Kernel())
    assert cf.cap_triton_mla_stages(mod) and cf.cap_triton_mla_stages(mod)  # idempotent
    k = mod._fwd_grouped_kernel_stage1
    assert isinstance(k, cf.StageCappedKernel) and not isinstance(k.kernel, cf.StageCappedKernel)
    assert k.arg_names == ["Q"]
    k[(1, 2)](7, BLOCK_DMODEL=128, num_stages=2)
    k[(1, 2)](7, IS_MLA=True, BLOCK_DMODEL=512, BLOCK_DPE=64, num_stages=2)
    assert [c[2]["num_stages"] for c in calls] == [2, 1] and calls[0][:2] == ((1, 2), (7,))


_TL_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "int32": "i32", "int64": "i64",
              "float8_e4m3fn": "fp8e4nv"}


def _real_triton_decode_module(triton):
    """The installed vLLM's triton_decode_attention with real Triton (vLLM's CPU build hands its modules a
    placeholder Triton through vllm.triton_utils)."""
    top = importlib.util.find_spec("vllm")
    path = Path(top.origin).parent / "v1" / "attention" / "ops" / "triton_decode_attention.py"
    shim = types.ModuleType("vllm.triton_utils")
    shim.triton, shim.tl = triton, triton.language
    saved = sys.modules.get("vllm.triton_utils")
    sys.modules["vllm.triton_utils"] = shim
    try:
        spec = importlib.util.spec_from_file_location("moetplan_test_triton_decode_attention", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # Triton's JIT reads the kernel source through its module
        spec.loader.exec_module(mod)
    finally:
        if saved is not None:
            sys.modules["vllm.triton_utils"] = saved
        else:
            del sys.modules["vllm.triton_utils"]
    return mod


class _Recorder:
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def _record_mla_576_launch(mod, torch, fix: bool):
    """vLLM's launch parameters for one decode step of a 576-wide MLA head (DeepSeek-V3 / Kimi, fp8 KV cache)."""
    kernel = mod._fwd_grouped_kernel_stage1
    rec = _Recorder()
    mod._fwd_grouped_kernel_stage1 = rec
    try:
        if fix:
            cf.cap_triton_mla_stages(mod)
        B, H, pages, page, splits = 2, 16, 8, 16, 4
        q = torch.zeros(B, H, 576, dtype=torch.bfloat16)
        kv = torch.zeros(pages, page, 1, 576, dtype=torch.float8_e4m3fn)
        mod._decode_grouped_att_m_fwd(
            q, kv, kv[..., :512], torch.zeros(B, H, splits, 513), torch.zeros(B, pages, dtype=torch.int32),
            torch.full((B,), 64, dtype=torch.int32), splits, 0.04, page, 0.0, torch.ones(1), torch.ones(1),
            is_mla=True)
    finally:
        mod._fwd_grouped_kernel_stage1 = kernel
    assert len(rec.launches) == 1
    return kernel, rec.launches[0]


def _shared_bytes_on_sm120(triton, torch, kernel, args, kwargs) -> int:
    """Compile `kernel` as launched with (args, kwargs) for sm_120; its static shared memory in bytes. Arguments
    get the 16-divisibility hints Triton's launcher gives aligned pointers and multiples of 16 (they decide
    whether loads become async copies, which is what the extra stages buffer)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    sig, attrs, constexprs = {}, {}, {}
    options = {k: v for k, v in kwargs.items() if k not in names}
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    for i, n in enumerate(names):
        v = values[n]
        if n in kwargs and not isinstance(v, torch.Tensor):
            sig[n], constexprs[(i,)] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[n], attrs[(i,)] = "*" + _TL_DTYPES[str(v.dtype).replace("torch.", "")], [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if int(v) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 120, 32), options=options)
    return int(compiled.metadata.shared)


def test_triton_mla_576_decode_fits_sm120_shared_memory_with_the_fix():
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    triton = pytest.importorskip("triton")
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this Triton has no NVIDIA backend")
    mod = _real_triton_decode_module(triton)

    kernel, (args, kwargs) = _record_mla_576_launch(mod, torch, fix=False)
    assert kwargs["BLOCK_DMODEL"] == 512 and kwargs["BLOCK_DPE"] == 64 and kwargs["num_stages"] == 2
    as_vllm_launches = _shared_bytes_on_sm120(triton, torch, kernel, args, kwargs)
    # vLLM's own launch does not fit: the bug the fix exists for (if this starts to fit, upstream fixed it:
    # set fixed_in for "triton_mla_576_stages" in vllm_compat.FIXES)
    assert as_vllm_launches > cf.SM12X_SHARED_MEMORY

    kernel, (args, kwargs) = _record_mla_576_launch(mod, torch, fix=True)
    assert kwargs["num_stages"] == 1
    with_fix = _shared_bytes_on_sm120(triton, torch, kernel, args, kwargs)
    assert with_fix <= cf.SM12X_SHARED_MEMORY < as_vllm_launches


# --------------------------------------------------------------------------- DeepSeek-V4 o_proj recipe


def test_sm90_recipe_replaces_only_the_sm100_recipe():
    sm100 = cf.sm90_recipe(lambda block_size=128: ((1, 1, block_size), True))
    sm90 = cf.sm90_recipe(lambda: ((1, 128, 128), False))
    assert sm100() == cf.SM90_RECIPE and sm100(block_size=32) == cf.SM90_RECIPE
    assert sm90() == ((1, 128, 128), False)
    assert cf.sm90_recipe(sm100) is sm100


def test_sm90_o_proj_recipe_patches_the_module_and_its_importers():
    def original():
        return (1, 1, 128), True

    o_proj = SimpleNamespace(compute_fp8_einsum_recipe=original)
    user = SimpleNamespace(compute_fp8_einsum_recipe=original)  # `from ...o_proj import compute_fp8_einsum_recipe`
    assert cf.sm90_o_proj_recipe({"o_proj": o_proj, "flashmla": user})
    assert o_proj.compute_fp8_einsum_recipe() == user.compute_fp8_einsum_recipe() == cf.SM90_RECIPE


def test_deep_gemm_sm120_kernels_are_found_by_their_header(tmp_path):
    assert not cf.deep_gemm_has_sm120_fp8(None)
    assert not cf.deep_gemm_has_sm120_fp8(tmp_path)
    header = tmp_path / "include" / "deep_gemm" / "impls" / "sm120_fp8_fp4_gemm_1d1d.cuh"
    header.parent.mkdir(parents=True)
    header.write_text("")
    assert cf.deep_gemm_has_sm120_fp8(tmp_path)


# --------------------------------------------------------------------------- capture mode


def test_thread_local_capture_is_the_default_a_caller_can_still_override():
    seen = []

    class Graph:
        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            seen.append(capture_error_mode)

    assert cf.thread_local_capture(Graph) and cf.thread_local_capture(Graph)
    Graph("g", pool=1)
    Graph("g", 1, 2, "relaxed")
    Graph("g", capture_error_mode="global")
    assert seen == ["thread_local", "relaxed", "global"]


def test_torch_cuda_graph_takes_a_capture_mode():
    torch = pytest.importorskip("torch")

    class Graph(torch.cuda.graph):  # the real signature; the patch lands on the subclass only
        pass

    assert cf.thread_local_capture(Graph)
    assert Graph.__init__ is not torch.cuda.graph.__init__


# --------------------------------------------------------------------------- which fixes a process gets


@pytest.mark.parametrize("version, capability, deep_gemm_sm120, want", [
    ((0, 26, 0), (12, 0), True, ["triton_mla_576_stages", "thread_local_capture"]),
    ((0, 33, 0), (12, 0), False, ["triton_mla_576_stages", "ds4_o_proj_sm90_scales", "thread_local_capture"]),
    ((0, 26, 0), (9, 0), False, ["thread_local_capture"]),
    ((0, 26, 0), None, False, []),
])
def test_apply_fixes_installs_what_the_release_and_gpu_need(monkeypatch, version, capability, deep_gemm_sm120,
                                                              want):
    monkeypatch.setattr(cf, "cap_triton_mla_stages", lambda: True)
    monkeypatch.setattr(cf, "sm90_o_proj_recipe", lambda: True)
    monkeypatch.setattr(cf, "thread_local_capture", lambda: True)
    monkeypatch.setattr(cf, "deep_gemm_has_sm120_fp8", lambda pkg: deep_gemm_sm120)
    monkeypatch.setattr(cf, "_capability", lambda: capability)
    assert cf.apply_fixes(version) == want


def test_the_fixes_find_their_targets_in_the_installed_vllm(monkeypatch):
    """The names the fixes patch exist in this release (a rename upstream would make a fix a silent no-op)."""
    pytest.importorskip("vllm")
    import importlib

    decode = importlib.import_module(cf.TRITON_DECODE_MODULE)
    monkeypatch.setattr(decode, cf.STAGE1_KERNEL, getattr(decode, cf.STAGE1_KERNEL))  # restored after the test
    assert cf.cap_triton_mla_stages(decode)
    assert isinstance(getattr(decode, cf.STAGE1_KERNEL), cf.StageCappedKernel)
    assert "_decode_grouped_att_m_fwd" in vars(decode)  # the launcher that looks the kernel up by that name

    modules = {cf.O_PROJ_MODULE: importlib.import_module(cf.O_PROJ_MODULE)}
    for name in cf.O_PROJ_USERS:
        try:
            modules[name] = importlib.import_module(name)
        except ModuleNotFoundError:  # DeepSeek-V4.1 arrived after 0.27
            continue
    for mod in modules.values():
        monkeypatch.setattr(mod, cf.RECIPE_FN, getattr(mod, cf.RECIPE_FN))
    assert cf.sm90_o_proj_recipe(modules)
    assert all(getattr(m, cf.RECIPE_FN)._moetplan_sm90 for m in modules.values())
