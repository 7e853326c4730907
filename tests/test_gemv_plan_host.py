"""The gemv decode stages' launch plan (gemv_plan_for in csrc/moe_kernels.cu) on the CPU: the function is plain
host C++, so it is compiled here on its own from the source text with the system C++ compiler and its choices are
checked against the rule the docs state (balanced exactly when the units outnumber the warp slots — for the int8
stages, 1.75x the slots; balanced never has a longer warp than plain). The GPU tests
(test_gemv_plan_spreads_rounds_over_warps, test_int8_stage_plan_stays_plain_to_seven_quarters_of_the_slots) check
the same through the built extension with the device's real occupancy."""
from __future__ import annotations

import re
import subprocess

import pytest
from csrc_source import CSRC, compile_host, decode_constant, kernels_constant

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
  for (int i = 1; i + 4 < argc; i += 5) {
    const GemvPlan p = atoll(argv[i + 4]) < 0
        ? gemv_plan_for(atoll(argv[i]), atoll(argv[i + 1]), atoll(argv[i + 2]), atoll(argv[i + 3]))
        : gemv_plan_for(atoll(argv[i]), atoll(argv[i + 1]), atoll(argv[i + 2]), atoll(argv[i + 3]),
                        atoll(argv[i + 4]));
    std::printf("%d %d %d\n", p.balanced ? 1 : 0, p.blocks, p.rounds);
  }
}
"""
    exe = compile_host("#include <algorithm>\n#include <cstdint>\n" + _function_text() + main, d / "plan")

    def run(cases: list[tuple[int, ...]]) -> list[tuple[bool, int, int]]:
        """(units, rpu, max_blocks, mode[, plain_eighths]) per case; without the fifth, the function's default."""
        args = [str(v) for c in cases for v in (*c, -1)[:5]]
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
        assert plain[2] == per * rpu and plain[1] == -((-units // per) // 4)  # ceil(ceil(units / per) / 4)
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


def test_int8_stages_stay_plain_up_to_one_and_three_quarters_of_the_slots(plan):
    # The int8 stages' default: plain up to 1.75x the warp slots, where two whole units per warp measured faster
    # than balanced on the H200 (GLM-5.2 w2 at 1 token: 3072 units, Kimi-K2.7-Code w2 at 1 token: 3584,
    # DeepSeek-V4-Flash at 2 tokens: 3072, for 2112 slots), balanced above (4096 units at 2 tokens on).
    e = kernels_constant("GEMV_I8_PLAIN_EIGHTHS")
    assert e == 14
    rpu = 4
    for units in (1536, 3072, 3584, 3696, 3697, 4096, 6144):
        auto, plain, bal = plan([(units, rpu, 528, m, e) for m in (-1, 0, 1)])
        assert auto == (bal if 8 * units > e * 2112 else plain)
    picks = {u: plan([(u, rpu, 528, -1, e)])[0][0] for u in (3072, 3584, 4096)}
    assert picks == {3072: False, 3584: False, 4096: True}
    # the other stages keep the slots as the bound
    assert plan([(3072, rpu, 528, -1)])[0][0] is True
