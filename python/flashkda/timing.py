"""Timing helpers shared by the demo and the benchmark: the GPU time of one call and its memory floor."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch


def memory_floor_bytes(total_tokens: int, H: int, D: int, N: int) -> int:
    """Bytes a prefill call must move (kda_spec.md section 7): q, k, v, g read and out written in bf16,
    beta read, and the fp32 initial and final states."""
    return 5 * total_tokens * H * D * 2 + total_tokens * H * 2 + 2 * N * H * D * D * 4


def capture_graph(fn: Callable[[], None], calls_per_graph: int = 1) -> "torch.cuda.CUDAGraph":
    """``fn`` captured into a CUDA graph ``calls_per_graph`` times back to back, after one eager call and
    one call on a side stream (as capture requires)."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    return graph


def cuda_graph_times_us(fn: Callable[[], None], iters: int, warmup: int = 3, calls_per_graph: int = 1,
                        before_replay: Optional[Callable[[], None]] = None) -> List[float]:
    """GPU time of ``fn`` per call (us): ``fn`` is captured into a CUDA graph (capture_graph)
    ``calls_per_graph`` times back to back, each replay is timed with events and divided by
    ``calls_per_graph``.  Several calls per graph amortise the graph launch latency (several us) for
    short calls, as in an engine's per-step graph.  ``before_replay`` (if given) runs before each timed
    replay, outside the timed events (the benchmark's L2 flush for cold-cache times)."""
    graph = capture_graph(fn, calls_per_graph)
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(iters):
        if before_replay is not None:
            before_replay()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / calls_per_graph)
    return times


def profiled_kernel_times_us(step: Callable[[], None], iters: int) -> Dict[str, float]:
    """Per-kernel GPU time per ``step`` (us, by kernel name, the mean over ``iters`` steps) as the
    profiler traces it; ``step`` is one eager call or one graph replay."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    per: Dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            t = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
            per[evt.name] = per.get(evt.name, 0.0) + t / iters
    return per


def cuda_graph_kernel_times_us(fn: Callable[[], None], iters: int, warmup: int = 3) -> Dict[str, float]:
    """Per-kernel GPU time of ``fn`` per call (us, by kernel name, the mean over ``iters`` replays)
    in the same execution as cuda_graph_times_us: the replays of one captured graph, traced by the
    profiler.  The eager per-kernel split can differ from what the graph runs (2026-12-04: a change
    that took 7-20 us off the graph replays left the eager split unchanged)."""
    graph = capture_graph(fn)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    return profiled_kernel_times_us(graph.replay, iters)
