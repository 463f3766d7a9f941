"""FlashKDA decode / speculative-decode benchmark against fla's Triton fused_recurrent_kda (issue 6).

One call = one decode step of one layer on a state pool, in place: H = 16, D = 128, bounded gate at
lower_bound -5 with l2norm + gate + beta sigmoid in kernel, V-first pool ``[P, H, V, K]`` fp32 (and
bf16 rows), P = 8 N rows, indices drawn from a random permutation of the pool (not 0..N-1):

* plain decode: T = 1, 1-D ``ssm_state_indices [N]``;
* spec decode 1+3: T = 4, 2-D ``ssm_state_indices [N, 4]`` (distinct write slots) with
  ``num_accepted_tokens`` random in 1..4.

Timing: GPU time of one call, CUDA events around CUDA-graph replays (``flashkda.timing``), median of
``--iters``, for ours and for fla (fla's ``fused_recurrent_kda_fwd`` with ``inplace_final_state`` and
the same pool, indices and output buffer; its kernel is graph-capturable, else the profiler's kernel
time sum is used).  The warm numbers replay back to back, so a small pool stays in L2; the cold-L2
numbers overwrite a buffer of twice the L2 size before each timed replay (outside the timed events).

Memory floor of a call: each request's state read once and written once per write slot (1 for plain
decode, T for spec decode), plus q, k, v, g and out (bf16), beta and the index tensors, over the
device-to-device copy bandwidth measured in the same run (stream copies outside a graph).

    python3 bench/bench_decode.py --json bench_decode.json --md bench_decode.md [--quick] [--no-fla]
    python3 bench/bench_decode.py --from-json docs/benchmarks-decode.json --md docs/benchmarks-decode.md
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flashkda  # noqa: E402
from flashkda import reference as ref  # noqa: E402
from flashkda.timing import cuda_graph_times_us  # noqa: E402

import bench_prefill as bp  # noqa: E402  (copy_bandwidth, kernel_times, ...; sets FLA_DISABLE_BACKEND_DISPATCH)

H_DEFAULT = 16
D = 128
LOWER_BOUND = -5.0
NUM_SPEC = 3


def build_cases():
    """(name, N, T, spec, pool dtype); spec decode is 1 + NUM_SPEC tokens per request."""
    cases = []
    for dtype, Ns in ((torch.float32, (1, 8, 64, 256)), (torch.bfloat16, (64, 256))):
        dname = "fp32" if dtype == torch.float32 else "bf16"
        for N in Ns:
            cases.append((f"plain N={N} {dname}", N, 1, False, dtype))
            cases.append((f"spec 1+{NUM_SPEC} N={N} {dname}", N, 1 + NUM_SPEC, True, dtype))
    return cases


CASES = build_cases()


def decode_floor_bytes(N: int, T: int, H: int, D: int, state_bytes: int, spec: bool) -> int:
    """Bytes one decode call must move: states (one read + one write per write slot), q/k/v/g/out
    bf16, beta bf16, indices (int32) and num_accepted_tokens (int32)."""
    writes = T if spec else 1
    tokens = N * T
    states = N * H * D * D * state_bytes * (1 + writes)
    io = 5 * tokens * H * D * 2 + tokens * H * 2
    idx = N * (T if spec else 1) * 4 + (N * 4 if spec else 0)
    return states + io + idx


def decode_workspace(device="cuda"):
    return torch.empty(int(torch.ops.flashkda.get_decode_workspace_size()), dtype=torch.uint8, device=device)


def make_case(N, T, spec, pool_dtype, H, seed=0, layout="fixed", dev="cuda"):
    gen = torch.Generator(device=dev).manual_seed(seed)

    def rn(*shape):
        return torch.randn(*shape, device=dev, generator=gen)

    shape = (N, T) if layout == "fixed" else (1, N * T)
    x = dict(
        q=rn(*shape, H, D).bfloat16(), k=rn(*shape, H, D).bfloat16(), v=rn(*shape, H, D).bfloat16(),
        g=rn(*shape, H, D).bfloat16(), beta=rn(*shape, H).bfloat16(),
        A_log=torch.rand(H, device=dev, generator=gen), dt_bias=torch.rand(H, D, device=dev, generator=gen),
    )
    P = max(8 * N, 8)
    x["pool"] = (0.1 * rn(P, H, D, D)).to(pool_dtype)
    perm = torch.randperm(P, device=dev, generator=gen)
    if spec:
        x["idx"] = perm[:N * T].view(N, T).to(torch.int32).contiguous()
        x["acc"] = torch.randint(1, T + 1, (N,), device=dev, generator=gen, dtype=torch.int32)
    else:
        x["idx"] = perm[:N].to(torch.int32).contiguous()
        x["acc"] = None
    if layout == "varlen":
        x["cu32"] = torch.arange(0, N * T + 1, T, dtype=torch.int32, device=dev)
        x["cu64"] = x["cu32"].long()
    else:
        x["cu32"] = x["cu64"] = None
    x.update(N=N, T=T, H=H, P=P, spec=spec)
    return x


class Ours:
    """One torch.ops.flashkda.decode call on the case's pool (in place), no allocation."""

    def __init__(self, x):
        self.x = x
        self.out = torch.empty_like(x["v"])
        self.ws = decode_workspace()

    def __call__(self):
        x = self.x
        torch.ops.flashkda.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], self.out, x["pool"], x["idx"],
                                  num_accepted_tokens=x["acc"], cu_seqlens=x["cu32"], scale=D ** -0.5,
                                  gate_mode="bounded", A_log=x["A_log"], dt_bias=x["dt_bias"],
                                  lower_bound=LOWER_BOUND, use_qk_l2norm=True, use_beta_sigmoid=True,
                                  workspace=self.ws)


def fla_decode_fn():
    """fla's pool-addressed recurrent kernel entry, or None with the reason.

    fla 0.6.0's public ``fused_recurrent_kda`` takes no state pool (ssm_state_indices would vanish
    into its **kwargs and it never writes in place), so the benchmark calls the function under it,
    ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd`` (what vLLM-style engines call)."""
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as e:  # fla is optional
        return None, f"fla not importable ({e})"
    params = inspect.signature(fused_recurrent_kda_fwd).parameters  # (follows functools.wraps)
    named = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    need = ("ssm_state_indices", "num_accepted_tokens", "inplace_final_state", "state_v_first", "out")
    missing = [n for n in need if n not in named] if named else []  # an opaque wrapper: just try it
    if missing:  # (a name swallowed by **kwargs would be silently ignored, so require them by name)
        return None, f"fla's fused_recurrent_kda_fwd lacks {missing}"
    return fused_recurrent_kda_fwd, None


class Fla:
    """fla's fused_recurrent_kda_fwd on the same pool / indices, writing into a preallocated out."""

    def __init__(self, x, fwd):
        self.x = x
        self.fwd = fwd
        self.out = torch.empty_like(x["v"])

    def __call__(self):
        x = self.x
        self.fwd(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                 initial_state=x["pool"], scale=D ** -0.5, output_final_state=False, inplace_final_state=True,
                 state_v_first=True, cu_seqlens=x["cu64"], ssm_state_indices=x["idx"],
                 num_accepted_tokens=x["acc"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND, out=self.out)


def cold_graph_times_us(fn, iters, flush, warmup=3):
    """Like cuda_graph_times_us, but L2 is flushed (a write of `flush`) before each timed replay."""
    return cuda_graph_times_us(fn, iters, warmup, before_replay=flush.zero_)


# Calls captured back to back in one graph (a serving step runs one decode per layer): amortises the
# graph launch latency, which otherwise dominates a few-us call.  The cold timing keeps 1 call per
# replay (an L2 flush before each call).
CALLS_PER_GRAPH = 20


def time_impl(fn, iters, flush):
    """(warm median, warm min, cold median or None, method)."""
    try:
        warm = cuda_graph_times_us(fn, iters, calls_per_graph=CALLS_PER_GRAPH)
        cold = cold_graph_times_us(fn, iters, flush) if flush is not None else None
        return statistics.median(warm), min(warm), (statistics.median(cold) if cold else None), "graph"
    except Exception as e:  # not capturable: the profiler's kernel-time sum per call (as bench_prefill for fla)
        print(f"    graph timing failed ({type(e).__name__}: {str(e)[:200]}); using the profiler")
        torch.cuda.synchronize()
        t = bp.time_profiler(fn, max(iters // 4, 10))
        return t, t, None, "profiler"


def state_rows_rel(pool, before, ref_pool):
    """rel err over the pool rows the reference changed, and whether every other row is bitwise untouched."""
    changed = ~(ref_pool == before.double()).flatten(1).all(1)
    untouched = bool(torch.equal(pool[~changed], before[~changed]))
    return ref.rel_err(pool[changed], ref_pool[changed]), untouched


def numerics(fla_fwd):
    """Ours (and fla) against the float64 reference on small cases (H 16, D 128)."""
    res = {}
    for name, N, T, spec, dtype in ((f"spec 1+{NUM_SPEC} N=8 fp32", 8, 1 + NUM_SPEC, True, torch.float32),
                                    ("plain N=8 fp32", 8, 1, False, torch.float32),
                                    ("plain N=8 bf16", 8, 1, False, torch.bfloat16)):
        x = make_case(N, T, spec, dtype, H_DEFAULT, seed=1234)
        before = x["pool"].clone()
        o_ref, p_ref = ref.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], before, x["idx"],
                                  num_accepted_tokens=x["acc"], cu_seqlens=x["cu32"], scale=D ** -0.5,
                                  gate_mode="bounded", A_log=x["A_log"], dt_bias=x["dt_bias"],
                                  lower_bound=LOWER_BOUND)
        row = {}
        try:
            ours = Ours(x)
            ours.out.fill_(float("nan"))
            ours()
            err = flashkda.read_device_error(ours.ws)
            s_rel, untouched = state_rows_rel(x["pool"], before, p_ref)
            row["ours"] = {"out_rel": ref.rel_err(ours.out, o_ref), "state_rel": s_rel,
                           "untouched_rows_ok": untouched, "device_error": err}
        except Exception as e:
            print(f"ours failed on {name}: {type(e).__name__}: {str(e)[:300]}")
        if fla_fwd is not None:
            try:
                x["pool"].copy_(before)
                f = Fla(x, fla_fwd)
                f.out.fill_(float("nan"))
                f()
                torch.cuda.synchronize()
                s_rel, untouched = state_rows_rel(x["pool"], before, p_ref)
                row["fla"] = {"out_rel": ref.rel_err(f.out, o_ref), "state_rel": s_rel,
                              "untouched_rows_ok": untouched}
            except Exception as e:
                print(f"fla numerics failed on {name}: {e}")
        res[name] = row
    return res


def collect_meta(bw, fla_ok, args):
    props = torch.cuda.get_device_properties(0)
    fla_version = None
    if fla_ok:
        import fla
        fla_version = getattr(fla, "__version__", "unknown")
    return dict(bp.run_meta(), l2_bytes=getattr(props, "L2_cache_size", None), copy_bandwidth_TBps=bw / 1e12,
                fla=fla_version, fla_backend_dispatch=os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") != "1",
                H=args.H, D=D, layout=args.layout, iters=args.iters, lower_bound=LOWER_BOUND)


def select_cases(spec):
    if spec is None:
        return list(range(len(CASES)))
    sel = []
    for tok in spec.split(","):
        tok = tok.strip()
        if tok.isdigit():
            sel.append(int(tok))
        else:  # a substring of case names, e.g. "spec", "bf16", "N=256"
            sel += [i for i, c in enumerate(CASES) if tok in c[0] and i not in sel]
    return sel


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="write the results (JSON) here")
    ap.add_argument("--md", default=None, help="write the markdown table here")
    ap.add_argument("--iters", type=int, default=None, help="timed replays per case (default 300, quick 50)")
    ap.add_argument("--quick", action="store_true", help="fewer replays")
    ap.add_argument("--no-fla", action="store_true", help="do not time fla")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-L2 timings")
    ap.add_argument("--cases", default=None,
                    help="comma-separated indices into CASES or substrings of case names, united (e.g. 'N=256,N=64')")
    ap.add_argument("--H", type=int, default=H_DEFAULT, help="heads (default 16)")
    ap.add_argument("--layout", choices=("fixed", "varlen"), default="fixed",
                    help="fixed [N, T] tensors (default) or varlen [1, N*T] with cu_seqlens")
    ap.add_argument("--from-json", default=None, help="only regenerate --md from a JSON this script wrote")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        text = markdown(result)
        print(text)
        if args.md:
            with open(args.md, "w") as f:
                f.write(text)
        return 0
    if args.iters is None:
        args.iters = 50 if args.quick else 300
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return 0
    fla_fwd = None
    if not args.no_fla:
        fla_fwd, why = fla_decode_fn()
        if fla_fwd is None:
            print(f"{why}; timing ours only")
    bw = bp.copy_bandwidth()
    meta = collect_meta(bw, fla_fwd is not None, args)
    print(f"GPU {meta['gpu']}, copy bandwidth {bw / 1e12:.2f} TB/s (read + write), fla {meta['fla']}")
    num = numerics(fla_fwd)
    print("numerics (vs float64 reference):", json.dumps(num))

    flush = None
    if not args.no_cold:
        l2 = meta["l2_bytes"] or (50 << 20)
        flush = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")
    rows = []
    for i in select_cases(args.cases):
        name, N, T, spec, dtype = CASES[i]
        x = make_case(N, T, spec, dtype, args.H, seed=i, layout=args.layout)
        floor_us = decode_floor_bytes(N, T, args.H, D, x["pool"].element_size(), spec) / bw * 1e6
        row = {"case": name, "N": N, "T": T, "spec": spec, "pool": str(dtype).replace("torch.", ""), "H": args.H,
               "P": x["P"], "ours_us": None, "ours_min_us": None, "ours_cold_us": None, "ours_timing": None,
               "ours_device_error": None, "floor_us": floor_us, "fla_us": None, "fla_min_us": None,
               "fla_cold_us": None, "fla_timing": None, "ours_kernels_us": None}
        try:
            ours = Ours(x)
            row["ours_us"], row["ours_min_us"], row["ours_cold_us"], row["ours_timing"] = \
                time_impl(ours, args.iters, flush)
            row["ours_device_error"] = err = flashkda.read_device_error(ours.ws)
            row["ours_kernels_us"] = bp.kernel_times(ours, 20)
            if err:
                print(f"    ours recorded device error {err} on {name}")
            del ours
        except Exception as e:
            print(f"    ours failed on {name}: {type(e).__name__}: {str(e)[:300]}")
        if fla_fwd is not None:
            try:
                f = Fla(x, fla_fwd)
                row["fla_us"], row["fla_min_us"], row["fla_cold_us"], row["fla_timing"] = time_impl(f, args.iters, flush)
            except Exception as e:
                print(f"    fla failed on {name}: {type(e).__name__}: {str(e)[:300]}")
        med, cold = row["ours_us"], row["ours_cold_us"]
        row["speedup_vs_fla"] = (row["fla_us"] / med) if (row["fla_us"] and med) else None
        row["speedup_vs_fla_cold"] = (row["fla_cold_us"] / cold) if (row["fla_cold_us"] and cold) else None
        row["pct_copy_bw"] = (100.0 * floor_us / med) if med else None
        row["pct_copy_bw_cold"] = (100.0 * floor_us / cold) if cold else None
        rows.append(row)
        print(line(row), flush=True)
        del x
        torch.cuda.empty_cache()
    result = {"meta": meta, "numerics": num, "decode": rows}
    text = markdown(result)
    print()
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    return 0


def _f(v, fmt="{:.1f}", none="n/a"):
    return none if v is None else fmt.format(v)


def line(r):
    return (f"{r['case']:24s} ours {_f(r['ours_us']):>7s} us (cold {_f(r['ours_cold_us'])})  "
            f"fla {_f(r['fla_us'])} us (cold {_f(r['fla_cold_us'])})  "
            f"speedup {_f(r['speedup_vs_fla'], '{:.2f}x')}  floor {r['floor_us']:6.1f} us  "
            f"{_f(r['pct_copy_bw'], '{:.1f}%')} of copy BW (cold {_f(r['pct_copy_bw_cold'], '{:.1f}%')})")


def markdown(result):
    m = result["meta"]
    lines = [
        "# FlashKDA decode benchmarks",
        "",
        f"GPU {m['gpu']} ({m['sm_count']} SMs), driver {m['driver']}, CUDA {m['cuda']}, torch {m['torch']}, "
        f"fla {m['fla']}, commit {m['commit']}, {m['date']}. Copy bandwidth measured in the same run: "
        f"{m['copy_bandwidth_TBps']:.2f} TB/s (read + write).",
        "",
        f"Decode on a state pool, in place: H = {m['H']}, D = {m['D']}, bounded gate (lower_bound "
        f"{m['lower_bound']}), l2norm + gate + beta sigmoid in kernel, {m['layout']} layout, pool of 8 N rows "
        "addressed through a random permutation. plain: T = 1, 1-D ssm_state_indices; spec 1+3: T = 4, "
        "2-D ssm_state_indices [N, 4], num_accepted_tokens random in 1..4. Times: median GPU time of one call "
        f"over {m['iters']} CUDA-graph replays (warm: {CALLS_PER_GRAPH} calls back to back per replay, time / {CALLS_PER_GRAPH}; cold: one call per replay, L2 overwritten before each replay). "
        "fla: `fused_recurrent_kda_fwd` (inplace_final_state, same pool and indices). Memory floor: each "
        "request's state read once and written once per write slot, plus q, k, v, g, beta, out and indices, "
        "over the copy bandwidth; % of copy BW = floor / time.",
        "",
        "| case | ours (us) | fla (us) | speed-up | ours cold (us) | fla cold (us) | speed-up cold | "
        "floor (us) | % copy BW | % copy BW cold |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["decode"]:
        lines.append(
            f"| {r['case']} | {_f(r['ours_us'])} | {_f(r['fla_us'])} | {_f(r['speedup_vs_fla'], '{:.2f}x')} | "
            f"{_f(r['ours_cold_us'])} | {_f(r['fla_cold_us'])} | {_f(r['speedup_vs_fla_cold'], '{:.2f}x')} | "
            f"{r['floor_us']:.1f} | {_f(r['pct_copy_bw'], '{:.0f}%')} | {_f(r['pct_copy_bw_cold'], '{:.0f}%')} |")
    methods = {r["fla_timing"] for r in result["decode"] if r.get("fla_timing")}
    if "profiler" in methods:
        lines += ["", "fla rows timed with the profiler's kernel-time sum (graph capture failed) are marked in the "
                  "JSON (`fla_timing`)."]
    lines += ["", "Numerics against the float64 recurrence (H = 16, D = 128; state rel over the pool rows written):",
              "", "| case | implementation | out rel | state rel | other rows untouched |", "|---|---|---|---|---|"]
    for case, impls in result["numerics"].items():
        for impl, v in impls.items():
            lines.append(f"| {case} | {impl} | {v['out_rel']:.2e} | {v['state_rel']:.2e} | "
                         f"{'yes' if v['untouched_rows_ok'] else 'NO'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
