"""GPU timing the way bench numbers are quoted: CUDA events around CUDA-graph replays (no launch
gaps), median of many, with inputs rotated so weights that fit in L2 are not timed from L2."""
from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

L2_FLUSH_BYTES = 256 << 20  # rotate through at least this many bytes of weights (H200 L2: 50 MB)


def rotation_count(nbytes: int, cap: int = 32) -> int:
    """How many copies of an input of nbytes to rotate through so the set exceeds L2 several times."""
    return max(1, min(cap, -(-L2_FLUSH_BYTES // max(1, nbytes))))


def graph_median_ms(fn: Callable[[], object], calls_per_graph: int = 1, replays: int = 30) -> float:
    """Median time of one fn() call: fn is run twice eagerly (compile, allocate), captured
    `calls_per_graph` times into one graph, and the graph's replays are timed with events."""
    fn()
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for _ in range(calls_per_graph):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls_per_graph)
    return statistics.median(times)


def rotating_median_ms(fn_of: Callable[[int], object], count: int, replays: int = 30) -> float:
    """Median time of one call when call i uses the i-th of `count` input copies (fn_of(i))."""
    calls = [lambda i=i: fn_of(i) for i in range(count)]

    def all_copies():
        for c in calls:
            c()
    return graph_median_ms(all_copies, replays=replays) / count
