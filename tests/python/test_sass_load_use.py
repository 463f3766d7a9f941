"""scripts/sass_load_use.py on a small hand-written `cuobjdump -sass` listing (CPU only)."""

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "sass_load_use.py")
_spec = importlib.util.spec_from_file_location("sass_load_use", _PATH)
sass_load_use = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_load_use)

# Two functions.  In the second: an int32 index load widened at once (the stall pattern), a 64-bit
# load used four instructions later by a compare, a load whose value is only stored (a store reads
# its data operand), an LDGSTS (not a register load: ignored) and a load never used.
_SASS = """
	code for sm_90a
		Function : _Z5otheri
        /*0000*/                   MOV R1, c[0x0][0x28] ;                    /* 0x00000a0000017a02 */
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;              /* 0x0000000404027981 */
        /*0020*/                   EXIT ;
		Function : _Z6kernelPf
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @!P0 LDG.E R13, desc[UR10][R10.64] ;
        /*0020*/              @!P0 SHF.R.S32.HI R7, RZ, 0x1f, R13 ;
        /*0030*/                   LDG.E.64 R8, desc[UR10][R12.64] ;
        /*0040*/                   IADD3 R20, R21, 0x1, RZ ;
        /*0050*/                   MOV R22, RZ ;
        /*0060*/                   IADD3 R23, R21, 0x2, RZ ;
        /*0070*/                   ISETP.GE.AND P1, PT, R9, RZ, PT ;
        /*0080*/                   LDGSTS.E.BYPASS.128 [R30], desc[UR10][R32.64] ;
        /*0090*/                   LDG.E.U16 R40, desc[UR10][R34.64] ;
        /*00a0*/                   MOV R41, RZ ;
        /*00b0*/                   STS.U16 [R42+0x100], R40 ;
        /*00c0*/                   LDG.E R50, desc[UR10][R36.64] ;
        /*00d0*/                   EXIT ;
"""


def test_kernel_lines_pick_the_named_function():
    lines = sass_load_use.kernel_lines(_SASS, "_Z6kernel")
    assert lines[0].startswith("MOV R1") and lines[-1] == "EXIT ;"
    assert not any("0x0000000404027981" in x for x in lines)
    assert len(lines) == 14


def test_load_use_distances():
    lines = sass_load_use.kernel_lines(_SASS, "_Z6kernel")
    uses = {reg: dist for _, _, reg, dist in sass_load_use.load_uses(lines)}
    assert uses == {"R13": 1, "R8": 4, "R40": 2, "R50": None}  # the LDGSTS is not listed


def test_main_filters_by_distance(capsys, tmp_path):
    path = tmp_path / "k.sass"
    path.write_text(_SASS)
    assert sass_load_use.main([str(path), "_Z6kernel", "--max", "2"]) == 0
    out = capsys.readouterr().out
    assert "R13" in out and "R40" in out and "R8 " not in out and "R50" not in out
