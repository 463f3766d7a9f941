"""The timing helpers shared by the demo and the benchmark."""

import pytest
import torch

from flashkda.timing import cuda_graph_kernel_times_us, cuda_graph_times_us, memory_floor_bytes


def test_memory_floor_matches_spec_table():
    # kda_spec.md section 7: 8x2048 H16 at 4.24 TB/s is about 83 us; 1x8192 H96 about 241 us.
    assert memory_floor_bytes(8 * 2048, 16, 128, 8) / 4.24e12 * 1e6 == pytest.approx(83.2, rel=0.01)
    assert memory_floor_bytes(8192, 96, 128, 1) / 4.24e12 * 1e6 == pytest.approx(240.0, rel=0.02)


def test_memory_floor_counts_states_per_sequence():
    one = memory_floor_bytes(1024, 4, 64, 1)
    two = memory_floor_bytes(1024, 4, 64, 2)
    assert two - one == 2 * 4 * 64 * 64 * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_times_replays_the_captured_work():
    x = torch.zeros(1024, device="cuda")
    times = cuda_graph_times_us(lambda: x.add_(1.0), iters=5, warmup=2)
    torch.cuda.synchronize()
    assert len(times) == 5 and all(t > 0 for t in times)
    assert x[0].item() == 1 + 1 + 2 + 5  # eager, side stream, (capture runs nothing), warm-ups, timed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_kernel_times_trace_the_replayed_kernels():
    x = torch.zeros(1 << 20, device="cuda")
    per = cuda_graph_kernel_times_us(lambda: x.mul_(0.5).add_(1.0), iters=4, warmup=1)
    assert len(per) >= 1 and all(t > 0 for t in per.values()), per
