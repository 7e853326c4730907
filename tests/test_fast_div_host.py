"""The decode stages' division by a runtime tile or top-k count (FastDiv / fast_div in csrc/moe_decode.cuh) on the
CPU: the two functions are plain C++ on the host side of the #ifdef, so they are compiled here from the source text
with the system C++ compiler and checked against integer division for every divisor the stages can see (tile
counts up to H / 16 and top-k values) and dividends over the whole range they are used on (< 2^31)."""
from __future__ import annotations

import random
import re
import subprocess

import pytest
from csrc_source import CSRC, compile_host

SRC = CSRC / "moe_decode.cuh"


def _source_text() -> str:
    src = SRC.read_text()
    parts = [re.search(p, src, re.S) for p in (r"struct FastDiv \{.*?\n\};", r"inline FastDiv fast_div_of\(.*?\n\}",
                                               r"__host__ __device__ __forceinline__ int fast_div\(.*?\n\}")]
    assert all(parts), "FastDiv / fast_div_of / fast_div not found in csrc/moe_decode.cuh"
    return "\n".join(m.group(0) for m in parts)


PRELUDE = "#include <cstdint>\n#define __host__\n#define __device__\n#define __forceinline__ inline\n"
MAIN = r"""
#include <cstdio>
#include <cstdlib>
// argv: d_lo d_hi n_dense, then extra dividends; prints the first mismatch or "ok <checks>"
int main(int argc, char** argv) {
  const long d_lo = atol(argv[1]), d_hi = atol(argv[2]), n_dense = atol(argv[3]);
  long checks = 0;
  for (long d = d_lo; d <= d_hi; ++d) {
    const FastDiv f = fast_div_of(uint32_t(d));
    for (long n = 0; n < n_dense; ++n, ++checks)
      if (fast_div(int(n), f) != int(n / d)) { std::printf("bad %ld %ld\n", n, d); return 1; }
    for (int i = 4; i < argc; ++i, ++checks) {
      const long n = atol(argv[i]);
      if (fast_div(int(n), f) != int(n / d)) { std::printf("bad %ld %ld\n", n, d); return 1; }
    }
  }
  std::printf("ok %ld\n", checks);
}
"""


@pytest.fixture(scope="module")
def exe(tmp_path_factory):
    return compile_host(PRELUDE + _source_text() + MAIN, tmp_path_factory.mktemp("fast_div") / "fd")


def _run(exe, d_lo: int, d_hi: int, n_dense: int, extra: list[int]) -> str:
    return subprocess.run([str(exe), str(d_lo), str(d_hi), str(n_dense), *map(str, extra)], capture_output=True,
                          text=True).stdout.strip()


def test_every_small_divisor_and_dividend(exe):
    # tile counts (Ir / 8, H / 16: up to 896 for the target models) and top-k, every dividend a step can have
    assert _run(exe, 1, 1100, 70_000, []).startswith("ok")


def test_large_dividends_and_divisors(exe):
    rng = random.Random(7)
    edges = [2**31 - 1, 2**31 - 2, 2**30, 2**30 - 1, 2**16, 2**16 - 1] + [rng.randrange(2**31) for _ in range(300)]
    assert _run(exe, 1, 300, 0, edges).startswith("ok")
    for d in (2**15 - 1, 2**15, 2**15 + 1, 2**20 + 3, 2**30 - 1, 2**30, 2**31 - 1):
        assert _run(exe, d, d, 2000, edges).startswith("ok"), d


def test_a_wrong_formula_is_caught(tmp_path):
    # The check can fail: the same harness with the add dropped from fast_div reports a mismatch.
    src = _source_text().replace("(hi + uint32_t(n)) >> f.shift", "hi >> f.shift")
    assert src != _source_text()
    bad = compile_host(PRELUDE + src + MAIN, tmp_path / "bad")
    assert _run(bad, 1, 50, 1000, []).startswith("bad")
