"""Timing helpers shared by the demo and the benchmark: the GPU time of one call and its memory floor."""

from __future__ import annotations

from typing import Callable, List

import torch


def memory_floor_bytes(total_tokens: int, H: int, D: int, N: int) -> int:
    """Bytes a prefill call must move (kda_spec.md section 7): q, k, v, g read and out written in bf16,
    beta read, and the fp32 initial and final states."""
    return 5 * total_tokens * H * D * 2 + total_tokens * H * 2 + 2 * N * H * D * D * 4


def cuda_graph_times_us(fn: Callable[[], None], iters: int, warmup: int = 3, calls_per_graph: int = 1) -> List[float]:
    """GPU time of ``fn`` per call (us): ``fn`` is captured into a CUDA graph (after one eager call and
    one call on a side stream, as capture requires) ``calls_per_graph`` times back to back, each replay
    is timed with events and divided by ``calls_per_graph``.  Several calls per graph amortise the
    graph launch latency (several us) for short calls, as in an engine's per-step graph."""
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
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / calls_per_graph)
    return times
