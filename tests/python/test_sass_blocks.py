"""scripts/sass_blocks.py on a small hand-written disassembly (CPU only)."""

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "sass_blocks.py")
_spec = importlib.util.spec_from_file_location("sass_blocks", _PATH)
sass_blocks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_blocks)

# Two functions; the second has a prologue, a two-block loop (head .L_x_2, back edge in .L_x_3), an
# EXIT, and out-of-line code after it that branches back into the body (not a loop).
_DIS = """
//--------------------- .text._Z5otheri --------------------------
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   EXIT ;
//--------------------- .text._Z6kernelPf --------------------------
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_2:
        /*0020*/                   LDS.64 R2, [R0+0x10] ;
        /*0030*/                   MUFU.EX2 R4, R2 ;
        /*0040*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0050*/               @P0 BRA `(.L_x_3) ;
        /*0060*/                   FADD R4, R4, R3 ;
.L_x_3:
        /*0070*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0080*/                   ISETP.NE.AND P1, PT, R0, 0x10, PT ;
        /*0090*/               @P1 BRA `(.L_x_2) ;
        /*00a0*/                   WARPSYNC 0xffffffff ;
.L_x_5:
        /*00b0*/                   STS [R0], R8 ;
        /*00c0*/                   EXIT ;
.L_x_4:
        /*00d0*/                   SHFL.BFLY P0, R3, R2, 0x1, 0x1f ;
        /*00e0*/                   BRA `(.L_x_5) ;
"""


def test_blocks_of_the_named_function_only():
    blocks = sass_blocks.blocks_of(_DIS, "kernelPf")
    assert [lab for lab, _ in blocks] == ["entry", ".L_x_2", ".L_x_3", ".L_x_5", ".L_x_4"]
    assert [len(ins) for _, ins in blocks] == [2, 5, 4, 2, 2]
    assert blocks[1][1][0] == ("LDS.64", " R2, [R0+0x10] ")  # the predicate is not the opcode


def test_loops_and_out_of_line_code():
    blocks = sass_blocks.blocks_of(_DIS, "kernelPf")
    assert sass_blocks.first_cold(blocks) == 4  # .L_x_4 comes after the last EXIT
    assert sass_blocks.loops(blocks) == [(1, 2)]  # .L_x_3 branches back to .L_x_2; .L_x_4's branch is not a loop
    text = sass_blocks.report(blocks)
    assert text.splitlines()[0] == "15 instructions in 5 blocks, 1 loops"
    assert ".L_x_2: 5  [loop head: 2 blocks, 9 instructions an iteration]" in text
    assert ".L_x_3: 4  [in the loop of .L_x_2]" in text
    assert "out of line after the last EXIT: 1 blocks, 2 instructions" in text
    assert ".L_x_4: 2  [out of line]" in text


def test_filters():
    blocks = sass_blocks.blocks_of(_DIS, "kernelPf")
    body = sass_blocks.report(blocks, ops=["HMMA"]).splitlines()[3:]
    assert [l.split(":")[0] for l in body] == [".L_x_2", ".L_x_3"]
    body = sass_blocks.report(blocks, min_size=5).splitlines()[3:]
    assert [l.split(":")[0] for l in body] == [".L_x_2"]
