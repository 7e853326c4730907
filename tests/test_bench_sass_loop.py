"""bench/tools/sass_loop.py: the main loop of a kernel in cuobjdump -sass text, its mix and round body."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.tools.sass_loop import function_body, main, report  # noqa: E402

SASS = """
        Function : _ZN4moet5otherEv
        /*0000*/                   MOV R1, c[0x0][0x28] ;                       /* 0x00000a0000017a02 */
        Function : _ZN4moet17gemv_stage_kernelILi1EEEvv
        /*0000*/                   LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64] ;  /* 0x0 */
        /*0010*/                   LDS.128 R4, [R1] ;                            /* 0x0 */
        /*0020*/                   PRMT R8, R4, R5, R6 ;                         /* 0x0 */
        /*0030*/              @!P0 HMMA.16816.F32.BF16 R12, R8, R4, R12 ;        /* 0x0 */
        /*0040*/                   HMUL2 R9, R8.H1_H1, 1, 1 ;                    /* 0x0 */
        /*0050*/                   HMMA.16816.F32.BF16 R12, R9, R4, R12 ;        /* 0x0 */
        /*0060*/                   LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64] ;  /* 0x0 */
        /*0070*/                   IMAD.SHL.U32 R2, R2, 0x10, RZ ;               /* 0x0 */
        /*0080*/               @P1 BRA 0x10 ;                                    /* 0x0 */
        /*0090*/                   BRA 0x0 ;                                     /* 0x0 */
        /*00a0*/                   EXIT ;                                        /* 0x0 */
"""


def test_innermost_loop_around_the_first_mma_and_its_round_body(tmp_path, capsys):
    insns = function_body(SASS, "gemv_stage_kernelILi1")
    assert len(insns) == 11 and insns[0] == (0, "LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]")
    r = report(insns)
    # loop 0x10-0x80 (the branch at 0x90 encloses it: not the innermost); body up to its LDGSTS at 0x60
    assert r["loop_instructions"] == 8
    assert r["loop_mix"]["HMMA"] == 2 and r["loop_mix"]["LDGSTS"] == 1 and r["loop_mix"]["IMAD"] == 1
    assert (r["round_body_instructions"], r["round_body_mma"], r["round_body_per_mma"]) == (5, 2, 2.5)
    p = tmp_path / "k.sass"
    p.write_text(SASS)
    assert main([str(p), "gemv_stage"]) == 0
    assert "round body (up to the first LDGSTS): 5 instructions, 2 MMA, 2.5 per MMA" in capsys.readouterr().out


TMA_SASS = """
        Function : _ZN4moet17gemv_stage_kernelILb1ELb0ELi1ELb0ELb1EEEvNS_8GemvArgsE
        /*0000*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R11+URZ], R3 ;  /* 0x0 */
        /*0010*/                   LDS.128 R4, [R9] ;                                  /* 0x0 */
        /*0020*/                   HMMA.16816.F32.BF16 R12, R8, R4, R12 ;              /* 0x0 */
        /*0030*/                   HMMA.16816.F32.BF16 R12, R9, R4, R12 ;              /* 0x0 */
        /*0040*/                   FENCE.VIEW.ASYNC.S ;                                /* 0x0 */
        /*0050*/               @P2 SYNCS.ARRIVE.TRANS64 RZ, [R11+URZ+0x8], R6 ;        /* 0x0 */
        /*0060*/               @P3 R2UR UR8, R7 ;                                      /* 0x0 */
        /*0070*/                   UTMALDG.4D [UR8], [UR16] ;                          /* 0x0 */
        /*0080*/               @P1 BRA 0x0 ;                                           /* 0x0 */
"""


def test_tma_ring_round_body_ends_at_the_expect_tx():
    r = report(function_body(TMA_SASS, "gemv_stage"))
    assert r["loop_instructions"] == 9 and r["loop_mix"]["UTMALDG"] == 1
    assert (r["round_body_instructions"], r["round_body_mma"], r["round_body_end"]) == (5, 2, "SYNCS.ARRIVE.TRANS64")


def test_clear_errors():
    with pytest.raises(SystemExit, match="no function matching 'nope'"):
        function_body(SASS, "nope")
    with pytest.raises(SystemExit, match="no MMA"):
        report(function_body(SASS, "otherEv"))
