"""The CPU kernels (csrc/cpu/moe_cpu.cpp) against the torch reference, on every ISA path this CPU runs.

Tolerance (docs/CPU_KERNELS.md, "Tolerance"): activations are one int8 plane per block of 32 (q8_0, the default),
each value within amax/254 of its block, so a row dot is within sum_i |w_i| * amax_block(i) / 254 of the exact dot
(checked per element below) and the op's relative L2 error is ~1e-2 (measured 1.0e-2 .. 1.2e-2 on these shapes;
<= 7e-2 with a tight SwiGLU clamp). Two planes (planes=(2, 2)) are float32-class: <= 2e-4.
"""
from __future__ import annotations

import pytest
import torch

from moetplan.contract.errors import UsageError
from moetplan.contract.layout import RowLayout
from moetplan.contract.runtime import KernelPolicy
from moetplan.runtime.op import cpu_kernels, ops
from moetplan.runtime.op.reference import ResidencyError, dequantize_rows, moe_forward_reference

TOL = 2e-2


def _rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pool(lay: RowLayout, n: int, seed: int) -> torch.Tensor:
    """Random code bytes with realistic scale bytes (2^-9 .. 2^5) in every row."""
    g = _rng(seed)
    pool = torch.randint(0, 256, (n, lay.stride), dtype=torch.uint8, generator=g)
    for off, size in ((lay.w13_s_off, lay.w13_s_size), (lay.w2_s_off, lay.w2_s_size)):
        pool[:, off:off + size] = torch.randint(118, 133, (n, size), dtype=torch.uint8, generator=g)
    return pool


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _isas(m) -> list[str]:
    return list(m.isas_available())


def test_isa_choice_and_names(cpu_mod):
    avail = _isas(cpu_mod)
    assert avail[0] == "scalar" and cpu_kernels.best_isa(cpu_mod) == avail[-1]
    assert set(avail) <= set(cpu_kernels.ISAS)
    with pytest.raises(UsageError, match="not one of"):
        cpu_kernels.isa_code(cpu_mod, "neon")


@pytest.mark.parametrize("fmt", ["2bit", "fp4"])
@pytest.mark.parametrize("K", [2048, 768, 224, 32])  # full chunks, and every tail width
def test_row_dot_matches_dequantized_rows(cpu_mod, fmt, K):
    wpb = 4 if fmt == "2bit" else 2
    g = _rng(K)
    q = torch.randint(0, 256, (21, K // wpb), dtype=torch.uint8, generator=g)
    s = torch.randint(110, 140, (21, K // 32), dtype=torch.uint8, generator=g)
    x = torch.randn(7, K, generator=g) * 2
    x[1, 3] = 300.0  # an outlier: the planes are per block of 32, so only its block loses resolution
    wdq = dequantize_rows(q, s, fmt).double()
    ref = x.double() @ wdq.T
    # one plane (q8_0): each activation is off by at most half its block's step amax/127
    step = x.double().abs().view(7, K // 32, 32).amax(-1).repeat_interleave(32, -1) / 127
    bound = (step / 2) @ wdq.abs().T
    for planes in (1, 2):
        outs = {}
        for isa in _isas(cpu_mod):
            got = cpu_mod.rows_dot(q, s, x, 0 if fmt == "2bit" else 1, cpu_kernels.ISAS.index(isa), planes)
            if planes == 1:
                assert bool(((got - ref).abs() <= bound * 1.001 + 1e-5 * ref.abs().max()).all()), isa
                assert _rel(got, ref) < TOL, isa
            else:  # two planes: within 2^-16 of each block's largest activation, float32-class
                assert float((got - ref).abs().max() / ref.abs().max()) < 2e-4, isa
            outs[isa] = got
        # the ISA paths compute the same integer sums; only the float order of the block sums differs
        for isa, got in outs.items():
            assert torch.allclose(got, outs["scalar"], rtol=1e-5, atol=1e-5 * float(ref.abs().max())), isa


@pytest.mark.parametrize("T", [1, 4, 16, 37])
def test_op_matches_reference_with_fp4_reserve_and_clamp(cpu_mod, T):
    H, I, E, k = 256, 96, 12, 4
    lay2, lay4 = RowLayout.for_expert(H, I, fmt="2bit"), RowLayout.for_expert(H, I, fmt="fp4")
    pool, fpool = _pool(lay2, E + 2, 1), _pool(lay4, 3, 2)
    slot_of = torch.randperm(E + 2, generator=_rng(3))[:E].to(torch.int32)
    f4 = torch.full((E,), -1, dtype=torch.int32)
    f4[torch.tensor([1, 5, 8])] = torch.tensor([2, 0, 1], dtype=torch.int32)
    ids = torch.stack([torch.randperm(E, generator=_rng(10 + t))[:k] for t in range(T)])
    w = torch.rand(T, k, generator=_rng(4))
    x = torch.randn(T, H, generator=_rng(5)) * 0.05
    for limit in (None, 3e-4):
        ref = moe_forward_reference(x, ids, w, pool, slot_of, lay2, fpool, f4, lay4, swiglu_limit=limit)
        for isa in _isas(cpu_mod):
            got = cpu_kernels.moe_cpu(cpu_mod, x, ids, w, pool, slot_of, lay2, fpool, f4, lay4, limit, None, isa=isa)
            # a clamped gate leaves the act vectors spiky within a block (some ~limit, most ~0): the w2 plane
            # resolves amax/127 of each block, so the small values lose most of their digits there
            assert got.shape == (T, H) and _rel(got, ref) < (TOL if limit is None else 1e-1), (isa, limit)
            # two planes per stage: float32-class (measured 5e-5 .. 6e-5; 2e-4 .. 4e-4 clamped)
            got2 = cpu_kernels.moe_cpu(cpu_mod, x, ids, w, pool, slot_of, lay2, fpool, f4, lay4, limit, None, isa=isa,
                                       planes=(2, 2))
            assert _rel(got2, ref) < (2e-4 if limit is None else 1e-3), (isa, limit)
    # deterministic: the same bits run to run (no float atomics; fixed reduction order)
    a = cpu_kernels.moe_cpu(cpu_mod, x, ids, w, pool, slot_of, lay2, fpool, f4, lay4, None, None)
    assert torch.equal(a, cpu_kernels.moe_cpu(cpu_mod, x, ids, w, pool, slot_of, lay2, fpool, f4, lay4, None, None))


def test_dispatch_names_the_cpu_path_and_keeps_dtype_and_out(cpu_mod):
    lay = RowLayout.for_expert(128, 64)
    pool = _pool(lay, 6, 7)
    ids = torch.tensor([[0, 5], [3, 3], [2, 0]])  # an expert twice for one token counts twice
    w = torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.3, 0.7]])
    x = torch.randn(3, 128, generator=_rng(8)) * 0.1
    log = ops.PathLog()
    for dtype in (torch.float32, torch.bfloat16):
        got = ops.moe_forward(x.to(dtype), ids, w, pool, torch.arange(6), lay, paths=log)
        ref = ops.moe_forward(x.to(dtype), ids, w, pool, torch.arange(6), lay, policy=KernelPolicy(cpu=False))
        assert got.dtype == dtype and _rel(got.float(), ref.float()) < TOL + (0 if dtype == torch.float32 else 1e-2)
    assert log.as_dict()["kernel_paths"] == {f"cpu:{cpu_kernels.best_isa(cpu_mod)}": 2}
    out = torch.full((3, 128), float("nan"))
    assert ops.moe_forward(x, ids, w, pool, torch.arange(6), lay, out=out) is out and torch.isfinite(out).all()


def test_missing_and_bad_experts_are_named(cpu_mod):
    lay = RowLayout.for_expert(64, 32)
    pool = _pool(lay, 2, 9)
    x, w = torch.randn(1, 64), torch.ones(1, 2)
    with pytest.raises(ResidencyError, match=r"\[1\]"):
        ops.moe_forward(x, torch.tensor([[0, 1]]), w, pool, torch.tensor([0, -1]), lay)
    with pytest.raises(UsageError, match="outside"):
        ops.moe_forward(x, torch.tensor([[0, 7]]), w, pool, torch.tensor([0, 1]), lay)
    with pytest.raises(ResidencyError, match="outside the pool"):
        ops.moe_forward(x, torch.tensor([[0, 1]]), w, pool, torch.tensor([0, 5]), lay)


def test_build_key_follows_the_source():
    assert len(cpu_kernels.build_key()) == 16
    assert (cpu_kernels.source_dir() / cpu_kernels.SOURCE).is_file()


def test_tiny_moe_greedy_tokens_are_the_references(cpu_mod, monkeypatch):
    """tiny-moe (HF transformers, fp32) with its experts as 2-bit rows: the CPU kernels pick the same greedy tokens
    as the torch reference the CPU backend used before them."""
    import transformers

    from moetplan.models.tiny import ensure_tiny_checkpoint
    from moetplan.runtime.offline.quality import VariantState, quantize_model

    path = ensure_tiny_checkpoint("tiny-moe")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model = quantize_model(ref, VariantState())
    ids = torch.tensor([[5, 17, 42, 99, 7, 250, 3, 64]])
    ran: list[str] = []
    real = cpu_kernels.moe_cpu
    monkeypatch.setattr(cpu_kernels, "moe_cpu", lambda *a, **k: ran.append("cpu") or real(*a, **k))

    def greedy() -> list[int]:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        return out[0, ids.shape[1]:].tolist()

    kernel = greedy()
    assert ran, "the CPU kernels did not run"
    monkeypatch.setattr(ops, "PATHS", tuple(p for p in ops.PATHS if p.name != "cpu"))  # the reference, as before
    n = len(ran)
    assert greedy() == kernel and len(ran) == n


def test_build_kernels_builds_the_cpu_kernels(cpu_mod):
    import json

    from typer.testing import CliRunner

    from moetplan.cli import app

    res = CliRunner().invoke(app, ["build-kernels", "--target", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["cpu"]["ok"] and info["cpu"]["isa"] == cpu_kernels.best_isa(cpu_mod)
    assert info["cpu"]["key"] == cpu_kernels.build_key() and "archs" not in info  # no CUDA asked for
    bad = CliRunner().invoke(app, ["build-kernels", "--target", "gpu"])
    assert bad.exit_code != 0 and "--target" in bad.output


def test_miss_split_uses_both_links_and_prefers_the_faster():
    from moetplan.cost_model.cpu_compute import split_misses

    row = 7 << 20
    none = split_misses(12, row, None, 50.0)
    assert none.cpu == 0 and none.seconds == none.fetch_only_seconds
    even = split_misses(12, row, 50.0, 50.0)  # equal rates: half each, twice as fast as fetching all
    assert even.cpu == 6 and even.seconds == pytest.approx(none.seconds / 2)
    slow_cpu = split_misses(12, row, 5.0, 50.0)  # a laptop CPU next to PCIe 5: one miss of 12, or none
    assert slow_cpu.cpu <= 1 and slow_cpu.seconds <= none.seconds
    fast_cpu = split_misses(12, row, 200.0, 25.0)  # 8-channel server next to PCIe 4: most on the CPU
    assert fast_cpu.cpu >= 10 and 0.8 < fast_cpu.cpu_share < 1.0
    with pytest.raises(ValueError, match="misses"):
        split_misses(-1, row, 1.0, 1.0)


def test_measure_expert_throughput_reports_rates(cpu_mod):
    lay = RowLayout.for_expert(256, 128)
    r = cpu_kernels.measure_expert_throughput(lay, threads=1, min_seconds=0.05, pool_bytes=4 << 20)
    assert r["gbps"] > 0 and r["experts_per_s"] > 0 and r["threads"] == 1
