"""The two prefill kernels on disjoint sets of SMs, measured before any such design is built (issue 4).

A batched call runs chunk_prepare on every SM (issue-bound: ~210 us on 8x2048 H16 on the H100 and the
H200 alike) and then the 8-warp walk on every SM (bound by its record stream): the call takes their sum.
A partitioned prefill would run chunk_prepare on P SMs and the walks on the other W, the walks following
prepare's records through per-chunk ready flags, so that a call takes about max(prepare on P SMs, walk
on W SMs) plus the first chunks' fill.  This measures both terms with CUDA green contexts
(torch.cuda.green_contexts), using the developer switches FLASHKDA_PREFILL_ONLY=prepare|recurrence (one
stage alone; the walk reads the records an earlier call left in the workspace) and
FLASHKDA_PREFILL_WALK_WARPS=4|8 (the whole walk's block size):

  sweep       each stage alone in a green context of P SMs, for P over --sms: prepare(P), walk8(P),
              walk4(P), and the whole call (auto) for reference;
  concurrent  prepare-only calls in a context of P SMs and walk-only calls in one of W SMs at the same
              time (P + W <= the GPU's SMs), each stream's time a call under the other's DRAM and L2
              traffic: the partitioned design's estimate is the larger of the two.

Each configuration runs in a subprocess of its own, which creates its green contexts before any
flashkda call (a kernel's shared-memory limit is set once a process).  Times: CUDA events around
--iters back-to-back eager calls on the context's stream (each call is 100s of us of GPU work, so the
launches stay ahead), median of --reps.
Usage: python3 bench/probe_sm_partition.py [--json out.json] [--cases 0,3]
"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys

import torch

SWEEP_SMS = (132, 120, 104, 96, 88, 72, 64, 48, 32, 16)  # 132: the primary context (every SM)
SPLITS = ((112, 16), (104, 24), (96, 32), (88, 40), (80, 48), (64, 64))


def set_env(only=None, warps=None):
    for key, val in (("FLASHKDA_PREFILL_ONLY", only), ("FLASHKDA_PREFILL_WALK_WARPS", warps)):
        if val is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = val


def sms_in_use(stream):
    """Distinct SM ids that a 4096-block Triton kernel lands on in the current context (None if Triton
    cannot run here): the green context's real size, which the driver may round."""
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def smid_kernel(out_ptr):
            pid = tl.program_id(0)
            sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32, is_pure=False,
                                           pack=1)
            tl.store(out_ptr + pid, sm)

        with torch.cuda.stream(stream):
            out = torch.zeros(4096, dtype=torch.int32, device="cuda")
            smid_kernel[(4096,)](out)
        stream.synchronize()
        return int(torch.unique(out).numel())
    except Exception as e:  # the timing does not depend on it
        print(f"smid count failed: {e}", file=sys.stderr)
        return None


def per_call_us(fn, stream, iters, reps):
    """Median over reps of (events around iters back-to-back calls on stream) / iters."""
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
        stream.synchronize()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(stream)
            for _ in range(iters):
                fn()
            e.record(stream)
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / iters)
    return statistics.median(times)


def make_case(case):
    from bench_prefill import CASES, Ours, make_inputs  # lazily: after the worker's green contexts exist
    name, lens, H = CASES[case]
    x = make_inputs(lens, H)
    return name, x, H, Ours


def worker_sweep(args):
    from torch.cuda.green_contexts import GreenContext
    ctx = None
    if args.sms < torch.cuda.get_device_properties(0).multi_processor_count:
        ctx = GreenContext.create(args.sms, 0)
        ctx.set_context()
        stream = ctx.Stream()
    else:
        stream = torch.cuda.current_stream()
    res = {"mode": "sweep", "sms": args.sms, "sms_seen": sms_in_use(stream), "cases": {}}
    for case in args.case_list:
        name, x, H, Ours = make_case(case)
        with torch.cuda.stream(stream):
            fn = Ours(x, H)
            set_env()
            fn()  # records in the workspace for the walk-only calls
        stream.synchronize()
        row = {}
        for key, only, warps in (("call", None, None), ("prepare", "prepare", None), ("walk8", "recurrence", "8"),
                                 ("walk4", "recurrence", "4")):
            set_env(only, warps)
            row[key] = per_call_us(fn, stream, args.iters, args.reps)
        set_env()
        res["cases"][name] = row
    if ctx is not None:
        ctx.pop_context()
    print("RESULT " + json.dumps(res))


@contextlib.contextmanager
def current(ctx):
    """ctx as the current CUDA context inside the block (the green context's stream and events need it)."""
    ctx.set_context()
    try:
        yield
    finally:
        ctx.pop_context()


def worker_concurrent(args):
    from torch.cuda.green_contexts import GreenContext
    p_sms, w_sms = args.sms, args.sms_walk
    ctx_p = GreenContext.create(p_sms, 0)
    ctx_w = GreenContext.create(w_sms, 0)
    res = {"mode": "concurrent", "sms": p_sms, "sms_walk": w_sms, "cases": {}}
    with current(ctx_p):
        s_p = ctx_p.Stream()
        res["sms_seen"] = sms_in_use(s_p)
    with current(ctx_w):
        s_w = ctx_w.Stream()
        res["sms_walk_seen"] = sms_in_use(s_w)
    # (tag, context, stream): prepare-only calls in P's context, walk-only ones in W's
    sides = (("p", ctx_p, s_p), ("w", ctx_w, s_w))
    for case in args.case_list:
        name, x, H, Ours = make_case(case)
        fn = {"p": Ours(x, H), "w": Ours(x, H)}  # separate workspaces and outputs
        # the walk's records: chunk_prepare in P's context on the walk's workspace
        with current(ctx_p), torch.cuda.stream(s_p):
            set_env("prepare")
            fn["w"]()
        s_p.synchronize()
        with current(ctx_p):
            set_env("prepare")
            t_p = per_call_us(fn["p"], s_p, args.iters, args.reps)
        row = {}
        for warps in ("8", "4"):
            env = {"p": ("prepare",), "w": ("recurrence", warps)}
            with current(ctx_w):
                set_env(*env["w"])
                t_w = per_call_us(fn["w"], s_w, args.iters, args.reps)
            # both streams busy for about the same time: calls in proportion to the solo times
            calls = {"p": args.iters, "w": max(1, round(args.iters * t_p / t_w))}
            together = {"p": [], "w": []}
            for _ in range(args.reps):
                ev = {}
                for tag, ctx, s in sides:
                    with current(ctx):
                        s.synchronize()
                        ev[tag] = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                        ev[tag][0].record(s)
                for i in range(max(calls.values())):
                    for tag, ctx, s in sides:
                        if i < calls[tag]:
                            with current(ctx), torch.cuda.stream(s):
                                set_env(*env[tag])
                                fn[tag]()
                for tag, ctx, s in sides:
                    with current(ctx):
                        ev[tag][1].record(s)
                for tag, ctx, s in sides:
                    with current(ctx):
                        ev[tag][1].synchronize()
                        together[tag].append(ev[tag][0].elapsed_time(ev[tag][1]) * 1e3 / calls[tag])
            set_env()
            row[f"walk{warps}"] = {"prepare_alone": t_p, "walk_alone": t_w,
                                   "prepare_together": statistics.median(together["p"]),
                                   "walk_together": statistics.median(together["w"]), "calls": [calls["p"], calls["w"]]}
        res["cases"][name] = row
    print("RESULT " + json.dumps(res))


def run_worker(extra, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--cases", args.cases, "--iters", str(args.iters), "--reps",
           str(args.reps)] + extra
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"worker {extra} failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--cases", default="0,3")  # bench_prefill.CASES: 8x2048 H16, 1x8192 H64
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--worker", choices=("sweep", "concurrent"), default=None)
    ap.add_argument("--sms", type=int, default=0)
    ap.add_argument("--sms-walk", type=int, default=0)
    args = ap.parse_args()
    args.case_list = [int(c) for c in args.cases.split(",")]
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to probe")
        return 0
    if args.worker == "sweep":
        return worker_sweep(args)
    if args.worker == "concurrent":
        return worker_concurrent(args)

    total = torch.cuda.get_device_properties(0).multi_processor_count
    sweep = [r for r in (run_worker(["--worker", "sweep", "--sms", str(min(s, total))], args)
                         for s in SWEEP_SMS if s <= total) if r]
    conc = [r for r in (run_worker(["--worker", "concurrent", "--sms", str(p), "--sms-walk", str(w)], args)
                        for p, w in SPLITS if p + w <= total) if r]
    print(f"\n## Each stage alone on P SMs (us a call; {torch.cuda.get_device_name(0)}, {total} SMs)")
    for r in sweep:
        for name, row in r["cases"].items():
            print(f"P {r['sms']:3d} (seen {r['sms_seen']}) {name:14s} " +
                  "  ".join(f"{k} {v:8.1f}" for k, v in row.items()))
    print("\n## prepare on P SMs beside the walk on W SMs (us a call; estimate = the larger, against the call)")
    full = {name: row["call"] for r in sweep if r["sms"] == total for name, row in r["cases"].items()}
    for r in conc:
        for name, row in r["cases"].items():
            for wk, m in row.items():
                est = max(m["prepare_together"], m["walk_together"])
                base = full.get(name)
                rel = f"{100 * (est / base - 1):+.1f}% against the call's {base:.1f}" if base else ""
                print(f"P {r['sms']:3d} W {r['sms_walk']:3d} {name:14s} {wk}: prepare {m['prepare_alone']:.1f} -> "
                      f"{m['prepare_together']:.1f}, walk {m['walk_alone']:.1f} -> {m['walk_together']:.1f}; "
                      f"estimate {est:.1f} {rel}")
    if args.json:
        from bench_prefill import run_meta
        with open(args.json, "w") as f:
            json.dump({"meta": run_meta(), "sweep": sweep, "concurrent": conc}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
