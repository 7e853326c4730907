"""bench/scale_spread.py on the CPU: how it counts the int8 w13 stage's two-pass rounds."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def scale_spread(load_bench):
    return load_bench("scale_spread")


def test_one_far_block_makes_its_warp_round_two_pass(scale_spread):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 1024, generator=g)  # 2 warp rounds of 16 rows x 2 rounds of 512 weights
    r0 = scale_spread.spread(w)  # Gaussian rows: every round within 4 binades
    assert r0["row_rounds_over_4"] == r0["warp_rounds_over_4"] == 0.0 and r0["largest_span"] <= 4
    w[3, 600:632] *= 2.0 ** 7  # one block of row 3, second round: 7 binades above its neighbours
    r = scale_spread.spread(w)
    assert r["largest_span"] >= 6
    assert r["row_rounds_over_4"] == pytest.approx(1 / 64)  # 1 of 32 rows x 2 rounds
    assert r["warp_rounds_over_4"] == pytest.approx(1 / 4)  # 1 of 2 warp groups x 2 rounds
