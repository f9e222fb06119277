"""CUDA graphs of the drafters' fixed-shape steps (the paged draft model's step, the heads' search): the
batch buckets they are captured for and the capture itself. A drafter keeps its graphs per bucket, with
static buffers that hold every tensor the graph reads, and falls back to eager steps when a capture is
refused."""
from __future__ import annotations

import logging
from typing import Callable

import torch

__all__ = ["BUCKETS", "bucket", "capture_graph", "graph_refused"]

logger = logging.getLogger("vllm_bole")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # CUDA-graph batch sizes of a step


def bucket(n: int, buckets=BUCKETS) -> int:
    """The smallest of ``buckets`` holding ``n`` rows (the largest when none does)."""
    return next((b for b in buckets if b >= n), buckets[-1])


def capture_graph(run: Callable[[], None], device, pool) -> torch.cuda.CUDAGraph:
    """``run`` (reads and writes static buffers only, no host synchronisation) run twice on a side stream
    (Triton's compilation and the allocator's warm-up outside the capture, as torch recommends), then
    captured into a graph in memory ``pool`` (``torch.cuda.graph_pool_handle()``, shared by a drafter's
    graphs). Raises RuntimeError where the capture is refused."""
    device = torch.device(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        run()
    return graph


def graph_refused(e: RuntimeError, what: str) -> str:
    """A refused capture's one-line reason, logged: ``what`` runs eagerly from now on."""
    why = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    logger.warning("vllm-bole: %s run eagerly: CUDA graph capture failed (%s)", what, why)
    return why
