"""The context-parallel prefill (segment maps, their scan, the segment walks) on the H200.

It runs by itself for few sequences x heads and long sequences (test_gpu's [8192] H4 case takes it);
here the dev switch FLASHKDA_PREFILL_SEGMENT_CHUNKS forces it with segments of 1 or 3 chunks on the
small inputs of test_gpu, so segment boundaries fall inside and between sequences, on empty,
padded and in-place-pool sequences, for both head dims and both state dtypes.  The same float64
reference and tolerances as test_gpu.
"""

import pytest
import torch

import flashkda
import test_gpu as base
import test_gpu_checkpoints as ckpt_tests
from kda_helpers import make_inputs

pytestmark = base.pytestmark
DEV = base.DEV
gen = base.gen


@pytest.fixture(params=[1, 3], ids=["seg1", "seg3"])
def segments(request, monkeypatch):
    monkeypatch.setenv("FLASHKDA_PREFILL_SEGMENT_CHUNKS", str(request.param))
    return request.param


def test_workspace_grows_with_forced_segments(segments, monkeypatch):
    forced = flashkda.get_workspace_size(4096, 4, 2)
    monkeypatch.delenv("FLASHKDA_PREFILL_SEGMENT_CHUNKS")
    assert forced > flashkda.get_workspace_size(4096, 4, 2)


def test_spec_case(gen, segments):
    base.test_spec_case(gen)


@pytest.mark.parametrize("H", [1, 4])
def test_lengths_and_heads(gen, segments, H):
    base.test_lengths_and_heads(gen, H)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_modes(gen, segments, state_dtype, D):
    base.test_modes(gen, "bounded", True, True, state_dtype, D)


@pytest.mark.parametrize("with_state", [True, False])
def test_fixed_length_batch(gen, segments, with_state):
    base.test_fixed_length_batch(gen, with_state)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_in_place_state(gen, segments, state_dtype):
    base.test_in_place_state(gen, state_dtype)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_pool(gen, segments, state_dtype):
    base.test_state_pool(gen, state_dtype, H=4)


def test_deterministic(gen, segments):
    base.test_deterministic(gen)


def test_cuda_graph_replay(gen, segments):
    base.test_cuda_graph_replay(gen, H=4)


def test_row_strided_inputs(gen, segments):
    base.test_row_strided_inputs(gen)


def test_unaligned_rows(gen, segments):
    base.test_unaligned_rows_take_the_unstaged_path(gen, "all")


def test_tiny_beta_and_keys_stay_finite(gen, segments):
    base.test_tiny_beta_and_keys_stay_finite(gen)


@pytest.mark.parametrize("with_state", [True, False], ids=["h0", "zero"])
@pytest.mark.parametrize("v_scale", [1e-6, 1e5])
def test_value_scale_keeps_precision(gen, segments, v_scale, with_state):
    base.test_value_scale_keeps_precision(gen, v_scale, with_state)


def test_out_in_place_over_v(gen, segments):
    base.test_out_in_place_over_v(gen)


@pytest.mark.parametrize("D", [64, 128])
def test_automatic_choice_on_a_long_sequence(gen, D):
    """[16384] H2: the automatic choice cuts it into segments (N H <= 32); against the reference."""
    inp = make_inputs([16384], H=2, D=D, device=DEV, generator=gen)
    out, fs = base.poisoned_outputs(inp)
    base.run(inp, out, fs)
    base.judge(gen, inp, out, fs, base.SPEC_OUT, base.SPEC_STATE)


@pytest.mark.parametrize("lens", [[16384], [3000, 70, 2500, 0, 640], [300, 300, 300, 300]],
                         ids=["automatic", "varlen-seg5", "one-segment-each"])
def test_maps_beside_head_walk_match_plain_launches(gen, monkeypatch, lens):
    """The segment maps launch programmatically after the head walk (segment 0, walked at once) and
    run beside it, and one idle map block waits for it so that segment_scan, which reads S_1, follows
    both; segment_scan and the segment walks launch programmatically too, each waiting for the grid
    before it.  FLASHKDA_PREFILL_PDL=0 launches them all plainly.  Both give the same bits, in place on
    a pool (a padded sequence among them), within the reference's tolerances.  one-segment-each: four
    segments planned from T, none used (every sequence fits in segment 0): every map, scan and
    segment-walk block is idle, and the call still ends after the head walk."""
    if len(lens) > 1:
        monkeypatch.setenv("FLASHKDA_PREFILL_SEGMENT_CHUNKS", "5")
    H, N, P = 2, len(lens), len(lens) + 3
    inp = make_inputs(lens, H=H, D=128, device=DEV, generator=gen)
    pool = (0.1 * torch.randn(P, H, 128, 128, generator=gen)).to(DEV)
    idx = torch.randperm(P, generator=gen)[:N].to(torch.int32)
    if N > 1:
        idx[1] = -1  # padding: zero output, no state touched
    idx = idx.to(DEV)
    results = []
    for pdl in (False, True):
        base.set_programmatic_launch(monkeypatch, pdl)
        state = pool.clone()
        out = torch.full(inp["v"].shape, float("nan"), dtype=torch.bfloat16, device=DEV)
        base.run(dict(inp, initial_state=state), out, state, state_indices=idx)  # in place, like serving
        torch.cuda.synchronize()
        results.append((out, state))
    (o0, s0), (o1, s1) = results
    assert torch.equal(o0, o1) and torch.equal(s0, s1), "programmatic and plain launches differ"
    ref_out, ref_final = base.R.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                        **dict(base.op_kwargs(inp), initial_state=pool), state_indices=idx)
    ref_pool = base.R.update_state_pool(pool, ref_final, idx)
    assert torch.isfinite(o1.float()).all() and torch.isfinite(s1).all()
    assert base.rel_err(o1, ref_out) <= base.SPEC_OUT
    used = [int(r) for r in idx.tolist() if r >= 0]
    assert base.rel_err(s1[used], ref_pool[used]) <= base.SPEC_STATE
    untouched = [r for r in range(P) if r not in used]
    assert torch.equal(s1[untouched], pool[untouched])


def test_long_sequences_with_segments_of_many_chunks(gen, monkeypatch):
    """Segments of 5 chunks over two long sequences and a short one."""
    monkeypatch.setenv("FLASHKDA_PREFILL_SEGMENT_CHUNKS", "5")
    inp = make_inputs([3000, 70, 2500], H=2, D=128, device=DEV, generator=gen)
    out, fs = base.poisoned_outputs(inp)
    base.run(inp, out, fs)
    base.judge(gen, inp, out, fs, base.SPEC_OUT, base.SPEC_STATE)


@pytest.mark.parametrize("D", [64, 128])
def test_checkpoints_equal_the_prefix_alone(gen, segments, D):
    """Checkpoints under context parallelism: the segment walks write the chunk-boundary states of the
    offsets in their chunks, the last segment those at the sequence's end.  With segments of 1 or 3
    chunks the offsets (0, mid-chunk, chunk-aligned, the length) fall inside segments and on their
    edges."""
    ckpt_tests.test_checkpoints_equal_the_prefix_alone(gen, D, torch.int32)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_checkpoints_with_state_pool(gen, segments, state_dtype):
    ckpt_tests.test_checkpoints_with_state_pool(gen, state_dtype)


def test_checkpoints_graph_replay(gen, segments):
    ckpt_tests.test_checkpoints_graph_replay(gen)
