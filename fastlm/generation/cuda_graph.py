"""Capturing a decode step in a CUDA graph, shared by the static generator's step and the engine's slot step."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(run: Callable[[], None], rewind: Callable[[], None], warmups: int = 3) -> torch.cuda.CUDAGraph:
    """Warm `run` up on a side stream (compiles, picks kernels), rewinding before each run, then capture it. The
    warm-up's writes land where `rewind` points (overwritten by the first real step)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            rewind()
            run()
    torch.cuda.current_stream().wait_stream(stream)
    rewind()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph
