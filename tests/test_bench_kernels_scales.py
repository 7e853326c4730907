"""bench/moe_kernels.py's scale-byte models on the CPU (the decode benchmark's expert rows)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def kernels_bench(load_bench):
    return load_bench("moe_kernels")


def test_gauss_scale_bytes_have_no_far_outliers(kernels_bench, monkeypatch):
    # The largest |N(0, 1)| of 32 draws sits between 2^-1 and 2^3: bytes 119..122. The float32 form of the model
    # rounded u^(1/32) to 1 for u near 1 and gave byte 140 (ndtri(1) = inf) to ~2e-6 of the blocks: 20 of
    # these 8M, each 19 binades above its row.
    monkeypatch.setattr(kernels_bench, "SCALES", "gauss")
    b = kernels_bench.random_scales(2048, 4096, torch.Generator().manual_seed(0))
    assert b.dtype == torch.uint8 and b.shape == (2048, 4096)
    assert 119 <= int(b.min()) and int(b.max()) <= 122
    assert float(((b == 120) | (b == 121)).float().mean()) > 0.9


def test_uniform_scale_bytes_span_eight_binades(kernels_bench, monkeypatch):
    monkeypatch.setattr(kernels_bench, "SCALES", "uniform")
    b = kernels_bench.random_scales(64, 4096, torch.Generator().manual_seed(0))
    assert torch.equal(torch.unique(b), torch.arange(116, 124, dtype=torch.uint8))


def test_i8w2_precision_asks_for_the_int8_stages(load_bench, monkeypatch, tmp_path):
    # Without a GPU (or below sm_90) there is no int8 stage to measure: a clear exit, no result file.
    import sys
    prec = load_bench("i8w2_precision")
    monkeypatch.setattr(sys, "argv", ["i8w2_precision.py", "--out", str(tmp_path / "p.json")])
    with pytest.raises(SystemExit, match="sm_90"):
        prec.main()
    assert not (tmp_path / "p.json").exists()
