"""`hubtools.sm90_compile.loop_opcodes` on SASS text: a loop is a conditional backward branch over more than a
wait; an mbarrier spin and its out-of-line retry are not loops (the moe gate/up count that took the retry's span
for the loop, docs/design/moe-dispatch.md session 40)."""

from hubtools.sm90_compile import loop_opcodes

SASS = """
        /*0100*/                   MOV R1, c[0x0][0x28] ;
        /*0110*/                   LOP3.LUT R2, R3, 0xf, RZ, 0xc0, !PT ;
        /*0120*/                   HFMA2 R4, R2, R5, R6 ;
        /*0130*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R7 ;
        /*0140*/              @!P0 BRA 0x0300 ;
        /*0150*/                   HFMA2 R4, R4, R5, R6 ;
        /*0160*/                   ISETP.GE.AND P1, PT, R8, R9, PT ;
        /*0170*/              @!P1 BRA 0x0110 ;
        /*0180*/                   EXIT ;
        /*0300*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R7 ;
        /*0310*/              @!P0 BRA 0x0300 ;
        /*0320*/                   BRA 0x0150 ;
"""


def test_loop_opcodes_counts_the_loop_and_not_the_waits():
    loops = loop_opcodes(SASS)
    assert len(loops) == 1
    assert loops[0] == {"LOP3.LUT": 1, "HFMA2": 2, "SYNCS.PHASECHK.TRANS64.TRYWAIT": 1, "BRA": 2, "ISETP.GE.AND": 1}
