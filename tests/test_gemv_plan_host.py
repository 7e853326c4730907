"""The gemv decode stages' launch plan (gemv_plan_for in csrc/moe_kernels.cu) on the CPU: the function is plain
host C++, so it is compiled here on its own from the source text with the system C++ compiler and its choices are
checked against the rule the docs state (balanced exactly when the units outnumber the warp slots; balanced never
has a longer warp than plain). The GPU test (test_gemv_plan_spreads_rounds_over_warps) checks the same through the
built extension with the device's real occupancy."""
from __future__ import annotations

import re
import subprocess

import pytest
from csrc_source import CSRC, compile_host, decode_constant

SRC = CSRC / "moe_kernels.cu"


def _function_text() -> str:
    src = SRC.read_text()
    struct = re.search(r"struct GemvPlan \{.*?\n\};", src, re.S)
    fn = re.search(r"GemvPlan gemv_plan_for\(.*?\n\}", src, re.S)
    assert struct and fn, "gemv_plan_for / GemvPlan not found in csrc/moe_kernels.cu"
    return f"constexpr int GEMV_WARPS = {decode_constant('GEMV_WARPS')};\n{struct.group(0)}\n{fn.group(0)}\n"


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemv_plan")
    main = r"""
#include <cstdio>
#include <cstdlib>
int main(int argc, char** argv) {
  for (int i = 1; i + 3 < argc; i += 4) {
    const GemvPlan p = gemv_plan_for(atoll(argv[i]), atoll(argv[i + 1]), atoll(argv[i + 2]), atoll(argv[i + 3]));
    std::printf("%d %d %d\n", p.balanced ? 1 : 0, p.blocks, p.rounds);
  }
}
"""
    exe = compile_host("#include <algorithm>\n#include <cstdint>\n" + _function_text() + main, d / "plan")

    def run(cases: list[tuple[int, int, int, int]]) -> list[tuple[bool, int, int]]:
        args = [str(v) for c in cases for v in c]
        out = subprocess.run([str(exe), *args], check=True, capture_output=True, text=True).stdout.split()
        vals = [int(v) for v in out]
        return [(bool(vals[i]), vals[i + 1], vals[i + 2]) for i in range(0, len(vals), 3)]

    return run


@pytest.mark.parametrize("max_blocks", [528, 512, 100, 1])
@pytest.mark.parametrize("rpu", [1, 2, 4, 7])
def test_balanced_exactly_when_units_outnumber_warp_slots(plan, max_blocks, rpu):
    slots = 4 * max_blocks
    for units in sorted({1, 3, slots - 1, slots, slots + 1, 3 * slots + 5, 50 * slots + 3} - {0}):
        auto, plain, bal = plan([(units, rpu, max_blocks, m) for m in (-1, 0, 1)])
        assert auto == (bal if units > slots else plain)
        assert not plain[0] and bal[0]
        # plain: whole units, as few per warp as the slots allow, on the fewest blocks that keep that count
        per = -(-units // slots)
        assert plain[2] == per * rpu and plain[1] == -(-(-(-units // per)) // 4)
        # balanced: one block per resident slot (or per unit), a block's units' rounds over its 4 warps
        assert bal[1] == min(max_blocks, units)
        assert bal[2] == -(-(-(-units // bal[1]) * rpu) // 4)
        assert bal[2] <= plain[2] and bal[1] >= plain[1]  # never a longer warp, never fewer blocks
        assert bal[2] * bal[1] * 4 >= units * rpu  # every round has a warp


def test_deepseek_v4_flash_at_one_token_stays_plain(plan):
    # H200 (132 SMs x 4 blocks): the w13 stage's 1536 units (K = 4096: 16 rounds of one piece, GEMV_MAX_NS = 1; 4 of
    # four pieces) fit the 2112 warp slots -> plain (balanced measured slower there); at 2 tokens 3072 units do
    # not -> balanced, 6 units' rounds over 4 warps instead of 2 whole units per warp.
    rpu = 4096 // (256 * min(decode_constant("GEMV_MAX_NS"), 4))
    (one,) = plan([(1536, rpu, 528, -1)])
    assert one == (False, 384, rpu)
    (two,) = plan([(3072, rpu, 528, -1)])
    assert two == (True, 528, -(-6 * rpu // 4))
