"""bench/tools/decode_timeline.py's bookkeeping, on the CPU: the union of kernel intervals and the kernel short
names."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def timeline(load_bench):
    return load_bench("decode_timeline")


def test_union_counts_overlapping_kernels_once(timeline):
    # PDL lets the next kernel start before the previous one ends: the overlap counts once, gaps not at all.
    assert timeline.union_us([(0.0, 10.0), (8.0, 15.0), (20.0, 22.0)]) == pytest.approx(17.0)
    assert timeline.union_us([(5.0, 6.0), (0.0, 10.0)]) == pytest.approx(10.0)
    assert timeline.union_us([]) == 0.0


def test_kernel_short_names(timeline):
    assert timeline.short_name("void moet::gemv_stage_kernel<true, false, 4, false>(moet::GemvArgs)") == "gemv w13"
    assert timeline.short_name("void moet::gemv_stage_kernel<false, true, 4, false>(moet::GemvArgs)") == "gemv w2"
    assert timeline.short_name("void moet::xprep8_kernel(__nv_bfloat16 const*, ...)") == "xprep8"
    assert timeline.short_name("void moet::xprep_kernel<__nv_bfloat16>(...)") == "xprep"
    assert timeline.short_name("void moet::combine_kernel<float>(...)") == "combine"
    assert timeline.short_name("x" * 100) == "x" * 60
