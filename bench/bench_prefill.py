"""FlashKDA prefill benchmark against fla's Triton chunk_kda (kda_spec.md section 7).

Times one call's GPU work: ours with CUDA events around CUDA-graph replays (median of --iters),
fla with the profiler's sum of kernel times per call (its varlen wrapper syncs the host, so it
cannot be graph-captured).  Config: D = 128 (--head-dim 64: the second supported head dim, no spec
targets), bounded gate at lower_bound -5, l2norm + gate + beta
sigmoid in kernel, fp32 initial and final state (V-first), varlen layout (cu_seqlens int32).
Also prints numerics (out / final_state rel err against the float64 reference) for ours and fla.

    python3 bench/bench_prefill.py --json docs/benchmarks.json --md docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

import torch

# The baseline is fla's own Triton path: fla 0.6 would otherwise hand chunk_kda to a registered backend
# (MoonshotAI's flash_kda when installed, or flashkda itself through flashkda.fla_backend).  fla reads
# this once, at its import.
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")

import flashkda  # noqa: E402
from flashkda import reference as ref  # noqa: E402
from flashkda.timing import (cuda_graph_kernel_times_us, cuda_graph_times_us, memory_floor_bytes,  # noqa: E402
                             profiled_kernel_times_us)

CASES = [
    ("8x2048, H16", [2048] * 8, 16),
    ("4x8192, H16", [8192] * 4, 16),
    ("1x16384, H16", [16384], 16),
    ("1x8192, H64", [8192], 64),
    ("1x8192, H96", [8192], 96),
    ("[1300,547,2048,963,271,3063], H96", [1300, 547, 2048, 963, 271, 3063], 96),
    ("8x1024, H64", [1024] * 8, 64),
    ("64x256, H16", [256] * 64, 16),
    ("1x65536, H16", [65536], 16),
    # Short serving calls (chunked-prefill continuations), where the fixed cost of a call shows.
    ("1x512, H16", [512], 16),
    ("16x64, H16", [64] * 16, 16),
]
FLA_US = {  # kda_spec.md section 7, fla 0.5.2 on H200 (for reference; we re-measure fla when importable)
    "8x2048, H16": 886, "4x8192, H16": 1824, "1x16384, H16": 1323, "1x8192, H64": 1753, "1x8192, H96": 2649,
    "[1300,547,2048,963,271,3063], H96": 2653, "8x1024, H64": 1791, "64x256, H16": 934,
}
D = 128
LOWER_BOUND = -5.0


def make_inputs(lens, H, seed=0, dev="cuda"):
    gen = torch.Generator(device=dev).manual_seed(seed)
    T = sum(lens)
    N = len(lens)

    def rn(*shape):
        return torch.randn(*shape, device=dev, generator=gen)

    x = dict(
        q=rn(1, T, H, D).bfloat16(), k=rn(1, T, H, D).bfloat16(), v=rn(1, T, H, D).bfloat16(),
        g=rn(1, T, H, D).bfloat16(), beta=rn(1, T, H).bfloat16(),
        A_log=torch.rand(H, device=dev, generator=gen), dt_bias=torch.rand(H, D, device=dev, generator=gen),
        h0=0.1 * rn(N, H, D, D),
    )
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    x["cu32"] = torch.tensor(cu, dtype=torch.int32, device=dev)
    x["cu64"] = x["cu32"].long()
    return x


def floor_us(lens, H, bw):
    return memory_floor_bytes(sum(lens), H, D, len(lens)) / bw * 1e6


def copy_bandwidth():
    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    del a, b
    return 2 * n / statistics.median(times)


class Ours:
    def __init__(self, x, H):
        T = x["q"].shape[1]
        N = x["cu32"].numel() - 1
        self.x = x
        self.out = torch.empty_like(x["v"])
        self.ht = torch.empty(N, H, D, D, device="cuda")
        self.ws = torch.empty(flashkda.get_workspace_size(T, H, N), dtype=torch.uint8, device="cuda")

    def __call__(self):
        x = self.x
        torch.ops.flashkda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], D ** -0.5, self.out, self.ws, x["A_log"],
                               x["dt_bias"], LOWER_BOUND, x["h0"], self.ht, x["cu32"])


class OursVariant:
    """The general prefill op with one serving feature switched on (issue 4's bf16-state rule, issue 6's
    pool addressing and checkpoints), to compare with the plain fp32-state call on the same inputs."""

    def __init__(self, x, H, variant, out=None, ws=None):
        T = x["q"].shape[1]
        N = x["cu32"].numel() - 1
        self.x, self.variant = x, variant
        # out / ws may be shared between variants, so that buffer placement is not part of an A/B
        self.out = torch.empty_like(x["v"]) if out is None else out
        self.ws = torch.empty(flashkda.get_workspace_size(T, H, N), dtype=torch.uint8, device="cuda") if ws is None else ws
        self.kw = dict(initial_state=x["h0"], final_state=torch.empty(N, H, D, D, device="cuda"))
        if variant == "bf16_state":
            h0 = x["h0"].bfloat16()
            self.kw = dict(initial_state=h0, final_state=torch.empty_like(h0))
        elif variant == "fp32_state_bf16_values":  # control: fp32 tensors holding the bf16 variant's values
            h0 = x["h0"].bfloat16().float()
            self.kw = dict(initial_state=h0, final_state=torch.empty_like(h0))
        elif variant in ("pool", "pool_hist"):  # a pool of 4N rows, rows picked by a permutation, in place
            gen = torch.Generator(device="cuda").manual_seed(1)
            pool = 0.1 * torch.randn(4 * N, H, D, D, device="cuda", generator=gen)
            idx = torch.randperm(4 * N, device="cuda", generator=gen)[:N].to(torch.int32)
            self.kw = dict(initial_state=pool, final_state=pool, state_indices=idx)
            if variant == "pool_hist":  # with has_initial_state (all True), as engines pass it
                self.kw["has_initial_state"] = torch.ones(N, dtype=torch.bool, device="cuda")
        elif variant == "pool_identity":  # probe: a pool of exactly N rows in sequence order, in place
            pool = x["h0"].clone()
            idx = torch.arange(N, device="cuda", dtype=torch.int32)
            self.kw = dict(initial_state=pool, final_state=pool, state_indices=idx)
        elif variant == "fp32_inplace":  # probe: contiguous states updated in place, no indices
            h = x["h0"].clone()
            self.kw = dict(initial_state=h, final_state=h)
        elif variant == "checkpoints":  # 2 per sequence: mid-chunk and at the end
            lens = (x["cu64"][1:] - x["cu64"][:-1])
            offs = torch.stack([lens // 3, lens], dim=1).to(torch.int32).contiguous()
            self.kw["checkpoint_offsets"] = offs
            self.kw["checkpoint_state"] = torch.empty(N, 2, H, D, D, device="cuda")

    def __call__(self):
        x = self.x
        torch.ops.flashkda.prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], self.out, self.ws, scale=D ** -0.5,
                                   gate_mode="bounded", A_log=x["A_log"], dt_bias=x["dt_bias"],
                                   lower_bound=LOWER_BOUND, cu_seqlens=x["cu32"], **self.kw)


VARIANT_CASES = (0, 3)  # 8x2048 H16, 1x8192 H64
VARIANTS = ("fp32_state_prefill_op", "bf16_state", "pool", "checkpoints")  # the first: the variants' own base


def time_graph(fn, iters):
    times = cuda_graph_times_us(fn, iters)
    return statistics.median(times), min(times)


def fla_fn(x):
    from fla.ops.kda import chunk_kda

    def run():
        return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=D ** -0.5, initial_state=x["h0"],
                         output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                         use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND,
                         state_v_first=True, cu_seqlens=x["cu64"], A_log=x["A_log"], dt_bias=x["dt_bias"])
    return run


def kernel_times(fn, iters):
    """Per-kernel GPU time per call (us) from the profiler over eager calls, by kernel_label."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return by_label(profiled_kernel_times_us(fn, iters))


def kernel_label(name):
    """A kernel's name without its template arguments, the context-parallel passes told apart."""
    label = name.split("<")[0].split("(")[0][-60:]
    if "RecurrenceMode)1" in name:  # context parallelism: the segment maps, then the walks
        label += " (segment maps)"
    elif "RecurrenceMode)2" in name:
        label += " (segment walks)"
    return label


def by_label(per_name):
    """Per-kernel times summed by kernel_label.  In a context-parallel call the whole-walk kernel is
    the head walk (segment 0 of every sequence, run beside the segment maps)."""
    per = {}
    for name, t in per_name.items():
        label = kernel_label(name)
        per[label] = per.get(label, 0.0) + t
    if any(l.endswith("(segment walks)") for l in per):
        for l in [l for l in per if l.endswith("state_recurrence_kernel")]:
            per[l + " (head walk)"] = per.pop(l)
    return per


def kernel_times_graph(fn, iters):
    """kernel_times from the replays of a captured graph (the execution the call time measures);
    None where the profiler does not trace the graph's kernels."""
    try:
        return by_label(cuda_graph_kernel_times_us(fn, iters)) or None
    except Exception as e:  # the benchmark's other figures do not depend on it
        print(f"per-kernel times from graph replays failed: {e}")
        return None


def time_profiler(fn, iters):
    return sum(kernel_times(fn, iters).values())


def numerics(have_fla):
    lens, H = [300, 17, 64, 131], 4
    x = make_inputs(lens, H, seed=1234)
    o_ref, s_ref = ref.prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=D ** -0.5, gate_mode="bounded",
                               A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=LOWER_BOUND,
                               initial_state=x["h0"], cu_seqlens=x["cu32"])
    ours = Ours(x, H)
    ours.out.fill_(float("nan"))
    ours.ht.fill_(float("nan"))
    ours()
    torch.cuda.synchronize()
    res = {"ours": {"out_rel": ref.rel_err(ours.out, o_ref), "state_rel": ref.rel_err(ours.ht, s_ref)}}
    if have_fla:
        o, s = fla_fn(x)()
        res["fla"] = {"out_rel": ref.rel_err(o, o_ref), "state_rel": ref.rel_err(s, s_ref)}
    return res


def run_meta():
    """What every benchmark JSON records of its run: GPU, driver, CUDA, torch, Python, commit, UTC date."""
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name, "sm_count": props.multi_processor_count,
        "driver": subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.strip(),
        "cuda": torch.version.cuda, "torch": torch.__version__, "python": platform.python_version(),
        "commit": git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def git_commit():
    if os.environ.get("FLASHKDA_COMMIT"):
        return os.environ["FLASHKDA_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--cases", default=None, help="comma-separated indices into CASES")
    ap.add_argument("--no-variants", action="store_true", help="skip the bf16-state / pool / checkpoint rows")
    ap.add_argument("--variant-cases", default=",".join(map(str, VARIANT_CASES)),
                    help="comma-separated indices into CASES for the serving-variant rows (default %(default)s; "
                         "2, 1x16384 H16, is a context-parallel case)")
    ap.add_argument("--head-dim", type=int, choices=(64, 128), default=128,
                    help="K = V (the spec's table and targets are D = 128; 64 is the second supported case)")
    args = ap.parse_args()
    global D
    D = args.head_dim
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return 0
    have_fla = False
    if not args.no_fla:
        try:
            import fla.ops.kda  # noqa: F401
            have_fla = True
        except Exception as e:  # fla is optional
            print(f"fla not importable ({e}); timing ours only")
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    print(f"GPU {props.name}, copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    meta = dict(run_meta(), copy_bandwidth_TBps=bw / 1e12, fla=None, head_dim=D)
    if have_fla:
        import fla
        meta["fla"] = getattr(fla, "__version__", "unknown")
        meta["fla_backend_dispatch"] = os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") != "1"
    num = numerics(have_fla)
    print("numerics ([300,17,64,131], H4):", json.dumps(num))
    rows = []
    sel = range(len(CASES)) if args.cases is None else [int(i) for i in args.cases.split(",")]
    for i in sel:
        name, lens, H = CASES[i]
        x = make_inputs(lens, H)
        ours = Ours(x, H)
        med, best = time_graph(ours, args.iters)
        row = {"case": name, "lens": lens, "H": H, "ours_us": med, "ours_min_us": best,
               "floor_us": floor_us(lens, H, bw), "fla_us": None, "fla_spec_us": FLA_US.get(name),
               "ours_kernels_us": kernel_times(ours, 5), "ours_kernels_graph_us": kernel_times_graph(ours, 20)}
        if have_fla:
            try:
                row["fla_us"] = time_profiler(fla_fn(x), 10)
            except Exception as e:
                print(f"fla failed on {name}: {e}")
        if len(lens) * H <= 32:  # the context-parallel choice: also time the sequence-parallel walk
            os.environ["FLASHKDA_PREFILL_SEGMENT_CHUNKS"] = "off"
            row["ours_no_cp_us"], _ = time_graph(Ours(x, H), args.iters)
            row["ours_no_cp_kernels_us"] = kernel_times(Ours(x, H), 5)
            del os.environ["FLASHKDA_PREFILL_SEGMENT_CHUNKS"]
        row["x_floor"] = row["ours_us"] / row["floor_us"]
        row["speedup_vs_fla"] = (row["fla_us"] / row["ours_us"]) if row["fla_us"] else None
        rows.append(row)
        fla_s = f"{row['fla_us']:8.1f}" if row["fla_us"] else "     n/a"
        sp = f"{row['speedup_vs_fla']:5.2f}x" if row["speedup_vs_fla"] else "  n/a"
        print(f"{name:38s} ours {med:8.1f} us  fla {fla_s} us  floor {row['floor_us']:7.1f} us  "
              f"x_floor {row['x_floor']:5.2f}  speedup {sp}", flush=True)
        print("    ours per kernel: " + ", ".join(f"{k} {v:.1f}" for k, v in row["ours_kernels_us"].items()))
        if row["ours_kernels_graph_us"]:
            print("    ours per kernel (graph replays): " +
                  ", ".join(f"{k} {v:.1f}" for k, v in row["ours_kernels_graph_us"].items()))
        if row.get("ours_no_cp_us"):
            print(f"    without context parallelism: {row['ours_no_cp_us']:.1f} us")
        del ours, x
        torch.cuda.empty_cache()
    variants = []
    if not args.no_variants:
        for i in (int(c) for c in args.variant_cases.split(",")):
            name, lens, H = CASES[i]
            x = make_inputs(lens, H)
            base, _ = time_graph(Ours(x, H), args.iters)
            row = {"case": name, "fp32_state_us": base}
            for v in VARIANTS:
                call = OursVariant(x, H, v)
                row[v + "_us"], _ = time_graph(call, args.iters)
                # per kernel too: what a serving feature adds (checkpoint_advance, the walk's stores)
                row[v + "_kernels_us"] = kernel_times(call, 5)
            variants.append(row)
            print(f"{name:38s} fp32 state {base:8.1f} us  " +
                  "  ".join(f"{v} {row[v + '_us']:8.1f} us" for v in VARIANTS), flush=True)
            for v in VARIANTS:
                print(f"    {v} per kernel: " + ", ".join(f"{k} {t:.1f}" for k, t in row[v + "_kernels_us"].items()))
            del x
            torch.cuda.empty_cache()
    result = {"meta": meta, "numerics": num, "prefill": rows, "prefill_variants": variants}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.md:
        write_md(result, args.md)
    return 0


def write_md(result, path):
    m = result["meta"]
    lines = [
        "# FlashKDA benchmarks",
        "",
        f"GPU {m['gpu']} ({m['sm_count']} SMs), driver {m['driver']}, CUDA {m['cuda']}, torch {m['torch']}, "
        f"fla {m['fla']}, commit {m['commit']}, {m['date']}. Copy bandwidth measured in the same run: "
        f"{m['copy_bandwidth_TBps']:.2f} TB/s (read + write).",
        "",
        f"Prefill, D = {m.get('head_dim', 128)}, bounded gate (lower_bound -5), l2norm + gate + beta sigmoid in "
        "kernel, fp32 state, "
        "varlen layout. Ours: median GPU time of CUDA-graph replays. fla: profiler kernel-time sum per call.",
        "",
        "| case | ours (us) | fla (us) | speed-up | memory floor (us) | ours / floor |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["prefill"]:
        fla_s = f"{r['fla_us']:.1f}" if r["fla_us"] else "n/a"
        sp = f"{r['speedup_vs_fla']:.2f}x" if r["speedup_vs_fla"] else "n/a"
        lines.append(f"| {r['case']} | {r['ours_us']:.1f} | {fla_s} | {sp} | {r['floor_us']:.1f} | {r['x_floor']:.2f} |")
    if result.get("prefill_variants"):
        lines += ["", "Serving variants of the same call (same inputs; GPU us per call): the fwd op with fp32 "
                  "states, then the general prefill op with fp32 states (the variants' base), bf16 state in and "
                  "out; initial/final state as rows of a 4N-row pool picked by state_indices (updated in place); "
                  "two checkpoint states per sequence (at len/3 and at the end).", "",
                  "| case | fp32 state (fwd) | fp32 state (prefill) | bf16 state | pool addressing | + 2 checkpoints |",
                  "|---|---|---|---|---|---|"]
        for r in result["prefill_variants"]:
            lines.append(f"| {r['case']} | {r['fp32_state_us']:.1f} | {r['fp32_state_prefill_op_us']:.1f} | "
                         f"{r['bf16_state_us']:.1f} | {r['pool_us']:.1f} | {r['checkpoints_us']:.1f} |")
    lines += ["", "Numerics, varlen [300, 17, 64, 131], H = 4, against the float64 recurrence:", "",
              "| implementation | out rel | final_state rel |", "|---|---|---|"]
    for k, v in result["numerics"].items():
        lines.append(f"| {k} | {v['out_rel']:.2e} | {v['state_rel']:.2e} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
