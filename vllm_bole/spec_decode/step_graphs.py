"""CUDA graphs of the drafters' fixed-shape steps (the paged draft model's step, the heads' search): the
batch buckets they are captured for, the capture itself and :class:`GraphedStep`, a drafter's graphs per
bucket (with static buffers that hold every tensor the graph reads) and its fallback to eager steps when
a capture is refused."""
from __future__ import annotations

import logging
from typing import Callable

import torch

__all__ = ["BUCKETS", "GraphedStep", "bucket", "capture_graph", "graph_refused"]

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


class GraphedStep:
    """A drafter whose step replays a CUDA graph per batch bucket: ``_step_graph(B)`` (the subclass's) captures
    bucket ``B``'s graph (:func:`capture_graph`, memory from :meth:`_graph_pool`) into ``_graphs[B]`` =
    (graph, static buffers) on first use and returns it; :meth:`capture_graphs` captures them at engine
    start; a refused capture (:meth:`_graphs_failed`) leaves every later step eager."""

    buckets = BUCKETS  # the batch sizes captured
    graphs_of = "draft steps"  # what runs eagerly after a refused capture (the warning)

    def _init_graphs(self, device, cuda_graphs: bool) -> None:
        self.cuda_graphs = bool(cuda_graphs) and torch.device(device).type == "cuda"
        self.graph_error: str | None = None
        self._graphs: dict = {}
        self._pool = None

    def _graph_pool(self):
        """The memory pool every graph of this drafter captures into (they never run at once)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    @property
    def graphs_runtime(self) -> str:
        """The runtime line's part on graphs: "CUDA graphs", or "eager" with the refused capture's reason."""
        return "CUDA graphs" if self.cuda_graphs else f"eager{f': {self.graph_error}' if self.graph_error else ''}"

    def _graphs_failed(self, e: RuntimeError) -> None:
        """A capture was refused (e.g. a kernel that syncs): eager steps from now on, said once."""
        self.cuda_graphs, self.graph_error = False, graph_refused(e, self.graphs_of)

    def capture_graphs(self, max_batch: int) -> int:
        """Capture the step's graph of every batch bucket up to the one holding ``max_batch`` rows now
        (engine start) instead of at each bucket's first use inside a step. Returns the buckets
        captured (0: eager)."""
        if not self.cuda_graphs:
            return 0
        top = bucket(max_batch, self.buckets)
        try:
            for b in self.buckets[: self.buckets.index(top) + 1]:
                self._step_graph(b)
        except RuntimeError as e:
            self._graphs_failed(e)
            return 0
        return len(self._graphs)
