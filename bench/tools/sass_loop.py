"""Instruction mix of a kernel's main loop, from `cuobjdump -sass` output (docs/KERNELS.md, "SASS without a device").

The main loop is the innermost backward branch whose range holds the kernel's first MMA instruction (the rule
bench/tools/ncu_stalls.py uses on Nsight Compute's SASS page). Printed: the loop's instruction count and opcode mix,
and its round body up to the first refill instruction in it — a cp.async copy (LDGSTS), or for a TMA / bulk-copy
ring the mbarrier arrive that announces the copies' bytes (SYNCS.ARRIVE.TRANS64) or the copy itself (UTMALDG,
UBLKCP) — which is where the decode stages refill their ring: instructions there per MMA give the per-weight cost
of a round (a decode-stage MMA is 8 weights per lane).

    moetplan build-kernels --arch 9.0 && cuobjdump -sass $MOETPLAN_KERNEL_CACHE/moetplan_moe-*/moetplan_moe*.so > k.sass
    python3 bench/tools/sass_loop.py k.sass gemv_stage_kernelILb1ELb0ELi1ELb0E
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def function_body(sass: str, name: str) -> list[tuple[int, str]]:
    """(address, instruction text) of the first function whose mangled name contains `name`."""
    start = next((m.end() for m in re.finditer(r"Function : (\S+)", sass) if name in m.group(1)), None)
    if start is None:
        raise SystemExit(f"sass_loop: no function matching '{name}' in the SASS")
    end = sass.find("Function : ", start)
    body = sass[start:end if end > 0 else None]
    return [(int(m.group(1), 16), m.group(2).strip()) for m in map(_INSN.match, body.splitlines()) if m]


def opcode(insn: str) -> str:
    """Opcode without predicate and modifiers: '@!P0 IMAD.SHL.U32 R1, ...' -> 'IMAD'."""
    return re.sub(r"^@!?U?P\w+\s+", "", insn).split(" ")[0].split(".")[0]


def main_loop(insns: list[tuple[int, str]]) -> list[tuple[int, str]]:
    mma = next((a for a, s in insns if "MMA" in opcode(s)), None)
    if mma is None:
        raise SystemExit("sass_loop: the function has no MMA instruction")
    loops = [(int(m.group(1), 16), a) for a, s in insns
             if opcode(s) == "BRA" and (m := re.search(r"(0x[0-9a-f]+)", s)) and int(m.group(1), 16) <= mma <= a]
    if not loops:
        raise SystemExit("sass_loop: no backward branch around the first MMA")
    lo, hi = min(loops, key=lambda r: r[1] - r[0])
    return [(a, s) for a, s in insns if lo <= a <= hi]


REFILL = ("LDGSTS", "UTMALDG", "UBLKCP")


def refill_marker(insn: str) -> str | None:
    """The refill kind an instruction starts, if any: a copy opcode, or SYNCS.ARRIVE.TRANS64 (expect_tx)."""
    op = opcode(insn)
    if op in REFILL:
        return op
    if re.sub(r"^@!?U?P\w+\s+", "", insn).startswith("SYNCS.ARRIVE.TRANS64"):
        return "SYNCS.ARRIVE.TRANS64"
    return None


def report(insns: list[tuple[int, str]]) -> dict:
    loop = main_loop(insns)
    first = next(((i, m) for i, (_, s) in enumerate(loop) if (m := refill_marker(s))), (len(loop), None))
    body = loop[:first[0]]
    mmas = sum("MMA" in opcode(s) for _, s in body)
    return {"loop_instructions": len(loop), "loop_mix": collections.Counter(opcode(s) for _, s in loop),
            "round_body_instructions": len(body), "round_body_mma": mmas, "round_body_end": first[1],
            "round_body_per_mma": len(body) / mmas if mmas else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sass", help="cuobjdump -sass output")
    ap.add_argument("function", help="a substring of the kernel's mangled name")
    a = ap.parse_args(argv)
    r = report(function_body(Path(a.sass).read_text(), a.function))
    print(f"main loop: {r['loop_instructions']} instructions; " +
          ", ".join(f"{k} {v}" for k, v in r["loop_mix"].most_common(16)))
    if r["round_body_mma"]:
        print(f"round body (up to the first {r['round_body_end'] or 'end of the loop'}): "
              f"{r['round_body_instructions']} instructions, {r['round_body_mma']} MMA, "
              f"{r['round_body_per_mma']:.1f} per MMA")
    return 0


if __name__ == "__main__":
    sys.exit(main())
