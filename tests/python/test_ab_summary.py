"""scripts/ab_summary.py: medians over rounds and the change against base (CPU only)."""

import importlib.util
import json
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "ab_summary.py")
_spec = importlib.util.spec_from_file_location("ab_summary", _PATH)
ab_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_summary)


def _round_file(tmp_path, variant, rnd, doc):
    """One bench JSON of an A/B round, named as ab_bench.sh names them (ab_<variant>_r<round>.json)."""
    p = tmp_path / f"ab_{variant}_r{rnd}.json"
    p.write_text(json.dumps(doc))
    return str(p)


def _write(tmp_path, variant, rnd, call_us, prep_us, prep_graph_us=None):
    row = {"case": "8x2048, H16", "ours_us": call_us,
           "ours_kernels_us": {"void flashkda::sm90::chunk_prepare_kernel": prep_us}}
    if prep_graph_us is not None:
        row["ours_kernels_graph_us"] = {"void flashkda::sm90::chunk_prepare_kernel": prep_graph_us}
    return _round_file(tmp_path, variant, rnd, {"prefill": [row]})


def test_medians_and_delta_against_base(tmp_path):
    paths = [_write(tmp_path, "base", 1, 100.0, 70.0), _write(tmp_path, "base", 2, 104.0, 72.0),
             _write(tmp_path, "base", 3, 102.0, 71.0), _write(tmp_path, "new_walk", 1, 97.0, 69.0),
             _write(tmp_path, "new_walk", 2, 95.0, 68.0), _write(tmp_path, "new_walk", 3, 99.0, 70.0)]
    table = ab_summary.summarise(ab_summary.load(paths))
    lines = table.splitlines()
    base = next(l for l in lines if "| base |" in l)
    new = next(l for l in lines if "| new_walk |" in l)
    assert "| 3 | 102.0 | - |" in base and "chunk_prepare_kernel 71.0" in base
    assert "| 3 | 97.0 | -4.90% |" in new and "chunk_prepare_kernel 69.0" in new
    assert lines.index(base) < lines.index(new)  # base first


def test_per_kernel_times_from_graph_replays_when_present(tmp_path):
    paths = [_write(tmp_path, "base", 1, 100.0, 70.0, 66.0), _write(tmp_path, "base", 2, 104.0, 72.0, 68.0),
             _write(tmp_path, "old", 1, 101.0, 73.0)]  # an older JSON: the eager split
    lines = ab_summary.summarise(ab_summary.load(paths)).splitlines()
    assert "chunk_prepare_kernel 67.0" in next(l for l in lines if "| base |" in l)
    assert "chunk_prepare_kernel 73.0" in next(l for l in lines if "| old |" in l)


def test_rejects_unnamed_files(tmp_path):
    p = tmp_path / "bench.json"
    p.write_text(json.dumps({"prefill": []}))
    with pytest.raises(SystemExit):
        ab_summary.load([str(p)])


def test_rows_without_context_parallelism_get_their_own_case(tmp_path):
    def write(variant, rnd, call_us, no_cp_us):
        row = {"case": "1x16384, H16", "ours_us": call_us, "ours_kernels_us": {"walk": 1.0},
               "ours_no_cp_us": no_cp_us, "ours_no_cp_kernels_us": {"void flashkda::sm90::state_recurrence": no_cp_us - 10}}
        return _round_file(tmp_path, variant, rnd, {"prefill": [row]})

    paths = [write("base", 1, 550.0, 860.0), write("base", 2, 548.0, 864.0), write("lean", 1, 549.0, 830.0),
             write("lean", 2, 547.0, 840.0)]
    lines = ab_summary.summarise(ab_summary.load(paths)).splitlines()
    no_cp = [l for l in lines if "1x16384, H16, no CP" in l]
    assert len(no_cp) == 2
    assert "| 2 | 862.0 | - |" in no_cp[0] and "state_recurrence 852.0" in no_cp[0]
    assert "| 2 | 835.0 | -3.13% |" in no_cp[1]
    assert any("| 1x16384, H16 | lean | 2 | 548.0 |" in l for l in lines)


def test_serving_variants_get_one_case_each(tmp_path):
    """bench_prefill's prefill_variants rows (ab_bench.sh PREFILL_VARIANTS=1): one case per variant column,
    medians over rounds and the change against base, like the main rows."""
    def write(variant, rnd, pool_us, bf16_us):
        d = {"prefill": [], "prefill_variants": [{"case": "8x2048, H16", "pool_us": pool_us, "bf16_state_us": bf16_us,
                                                  "checkpoints_us": None}]}
        return _round_file(tmp_path, variant, rnd, d)

    paths = [write("base", 1, 100.0, 90.0), write("base", 2, 102.0, 92.0), write("late", 1, 98.0, 91.0),
             write("late", 2, 96.0, 93.0)]
    lines = ab_summary.summarise(ab_summary.load(paths)).splitlines()
    pool_late = next(l for l in lines if l.startswith("| 8x2048, H16, pool | late |"))
    assert "| 2 | 97.0 | -3.96% |" in pool_late
    assert any(l.startswith("| 8x2048, H16, bf16_state | base | 2 | 91.0 |") for l in lines)
    assert not any("checkpoints" in l for l in lines)  # a variant the run did not time has no row


def test_serving_variants_carry_their_kernel_times(tmp_path):
    """A variant's per-kernel times (<variant>_kernels_us) go to its row's last column and are not read
    as a variant of their own."""
    def write(variant, rnd, us, adv_us):
        d = {"prefill": [], "prefill_variants": [{"case": "8x2048, H16", "checkpoints_us": us,
                                                  "checkpoints_kernels_us": {"checkpoint_advance_kernel": adv_us}}]}
        return _round_file(tmp_path, variant, rnd, d)

    paths = [write("base", 1, 440.0, 30.0), write("base", 2, 442.0, 32.0), write("bits", 1, 420.0, 10.0),
             write("bits", 2, 422.0, 12.0)]
    lines = ab_summary.summarise(ab_summary.load(paths)).splitlines()
    bits = next(l for l in lines if l.startswith("| 8x2048, H16, checkpoints | bits |"))
    assert "| 2 | 421.0 |" in bits and "checkpoint_advance_kernel 11.0" in bits
    assert not any("checkpoints_kernels" in l for l in lines)


def test_named_base_and_copy_bandwidth_of_decode_rows(tmp_path):
    """ab_decode_kernels.sh compares kernels by name (--base: the first of its KERNELS) and its decode
    rows carry % of copy bandwidth, reported beside the per-kernel times."""
    def write(variant, rnd, us, pct):
        row = {"case": "plain N=64 fp32", "ours_us": us, "ours_kernels_us": {"k": us}, "pct_copy_bw": pct}
        return _round_file(tmp_path, variant, rnd, {"decode": [row]})

    paths = [write("stream", 1, 37.0, 88.0), write("stream", 2, 37.4, 87.0), write("auto", 1, 39.0, 83.0),
             write("auto", 2, 39.4, 82.0)]
    lines = ab_summary.summarise(ab_summary.load(paths), "stream").splitlines()
    assert lines[2].startswith("| plain N=64 fp32 | stream | 2 | 37.2 | - |") and "87.5% of copy BW" in lines[2]
    assert lines[3].startswith("| plain N=64 fp32 | auto | 2 | 39.2 | +5.38% |") and "82.5% of copy BW" in lines[3]


def test_kernel_ratio_compares_renamed_kernels(tmp_path):
    """--ratio chunk_prepare: a variant whose prepare kernel has another name (the persistent one) is
    still compared with base's chunk_prepare_kernel, by the medians of the matching kernels' sums."""
    def write(variant, rnd, kernels):
        row = {"case": "8x2048, H16", "ours_us": 300.0, "ours_kernels_us": kernels}
        return _round_file(tmp_path, variant, rnd, {"prefill": [row]})

    paths = [write("base", 1, {"void flashkda::sm90::chunk_prepare_kernel<128>": 200.0,
                               "void flashkda::sm90::state_recurrence_kernel": 100.0}),
             write("base", 2, {"void flashkda::sm90::chunk_prepare_kernel<128>": 210.0}),
             write("persistent", 1, {"void flashkda::sm90::chunk_prepare_persistent_kernel<128>": 231.0}),
             write("persistent", 2, {"void flashkda::sm90::chunk_prepare_persistent_kernel<128>": 241.5}),
             write("walk_only", 1, {"void flashkda::sm90::state_recurrence_kernel": 90.0})]
    table = ab_summary.kernel_ratio(ab_summary.load(paths), "chunk_prepare")
    lines = table.splitlines()
    assert "| 8x2048, H16 | base | 2 | 205.0 | - |" in lines
    assert "| 8x2048, H16 | persistent | 2 | 236.2 | 1.152 |" in lines
    assert not any("walk_only" in l for l in lines)  # no matching kernel: left out
    assert lines.index("| 8x2048, H16 | base | 2 | 205.0 | - |") < lines.index(
        "| 8x2048, H16 | persistent | 2 | 236.2 | 1.152 |")


def test_main_prints_the_ratio_table(tmp_path, capsys):
    p = tmp_path / "ab_base_r1.json"
    p.write_text(json.dumps({"prefill": [{"case": "c", "ours_us": 10.0,
                                          "ours_kernels_us": {"chunk_prepare_kernel": 6.0}}]}))
    assert ab_summary.main(["--ratio", "chunk_prepare", str(p)]) == 0
    out = capsys.readouterr().out
    assert "| c | base | 1 | 10.0 | - |" in out and "| c | base | 1 | 6.0 | - |" in out
