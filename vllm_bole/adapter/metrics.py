"""Tree metrics on the server's ``/metrics`` (Prometheus series ``vllm:bole_*``), from two sources.

**vLLM's scheduler statistics** (``vllm.stat_logger_plugins`` entry point, :class:`BoleStatLogger`).
vLLM's scheduler already sees every verified tree: per step and request it records the drafts it
scheduled (``num_draft_tokens`` = the tree's draft nodes) and the accepted tokens, counted per
position (``num_accepted_tokens_per_pos[d]`` = requests whose accepted path reached depth ``d +
1``). vLLM's own counters stay meaningful for trees that way: accepted tokens and their depth
positions are exact; only its "draft acceptance rate" divides by every tree node. From the same
statistics, per engine step:

* ``vllm:bole_accepted_tokens_per_tree`` (histogram): tokens emitted per verified tree (accepted
  depth + the bonus token);
* ``vllm:bole_accepted_depth`` (histogram): accepted depth per verified tree;
* ``vllm:bole_tree_nodes_per_step`` (histogram): tree nodes verified in one target forward (roots
  included);
* ``vllm:bole_trees_total``, ``vllm:bole_tree_nodes_total``, ``vllm:bole_accepted_tokens_total``.

**The worker's own measurements** (:class:`WorkerMetrics`, :data:`WORKER_SERIES`): drafting and
verification latency, the recurrent layers' transient bytes, the budget controller's chosen node
counts and its predicted against measured step times, the paged draft's pool. vLLM has no channel
from the worker to the frontend for a plugin's statistics, so the rank-0 worker keeps them
cumulative (histogram buckets, sums, counts) and a background thread writes a snapshot (JSON, at
most every :data:`SNAPSHOT_PERIOD_S`, atomically replaced) to a file whose directory the config hook
chose (``additional_config["vllm_bole_metrics"]``); the frontend's :class:`WorkerCollector` reads it
at every scrape. Multi-node workers (Ray across hosts) write on their own host: not exported there.

The logger does nothing on engines without ``method: bole_tree``. vLLM's Prometheus logger
unregisters every ``vllm:`` collector when it is built (after the plugin loggers), so the series
are registered at the first record.
"""
from __future__ import annotations

import json
import os
import threading

from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_bole.adapter.config_hook import METRICS_KEY, is_ours

_DEPTH_BUCKETS = [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
_NODE_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_SECONDS = [1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5]
_BYTES = [float(1 << k) for k in range(10, 41, 3)]  # 1 KiB .. 1 TiB
SNAPSHOT_PERIOD_S = 0.5

# name -> (kind, help, buckets): the worker's series (histograms observed per step; counters; gauges)
WORKER_SERIES = {
    "vllm:bole_draft_seconds": ("histogram", "Drafting time per engine step (drafter + tree building, whole batch)",
                                _SECONDS),
    "vllm:bole_verify_commit_seconds": ("histogram", "Verification + commit time per tree step (whole batch)",
                                        _SECONDS),
    "vllm:bole_transient_recurrent_bytes": ("histogram", "Bytes the recurrent layers hold between the tree forward "
                                            "and the commit, per tree step (vLLM's chain path: one full state "
                                            "per draft token instead)", _BYTES),
    "vllm:bole_budget_nodes": ("histogram", "Draft nodes the budget controller chose for the batch, per step",
                               _NODE_BUCKETS),
    "vllm:bole_step_predicted_seconds": ("histogram", "The budget controller's predicted tree-step time",
                                         _SECONDS),
    "vllm:bole_step_measured_seconds": ("histogram", "Measured tree-step time (input preparation to sampled "
                                        "tokens), where the controller predicted it", _SECONDS),
    "vllm:bole_speculating": ("gauge", "1 while the engine drafts trees, 0 while the speculation switch (budget "
                              "\"auto\") has it decode plainly, the faster mode as measured", None),
    "vllm:bole_draft_evictions": ("counter", "Requests evicted from the paged draft's KV pool", None),
    "vllm:bole_draft_pages_used": ("gauge", "Pages of the paged draft's KV pool in use", None),
}


class WorkerMetrics:
    """The worker side: cumulative series (:data:`WORKER_SERIES`) snapshotted to ``path`` by a
    daemon thread whenever they changed (``path`` None: kept in memory only)."""

    def __init__(self, path: str | None):
        self.path = path
        self._lock = threading.Lock()
        self._data = {name: (dict(buckets=[0] * len(b), sum=0.0, count=0) if kind == "histogram" else 0.0)
                      for name, (kind, _, b) in WORKER_SERIES.items()}
        self._dirty = threading.Event()
        if path is not None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            threading.Thread(target=self._writer, name="vllm-bole-metrics", daemon=True).start()

    def observe(self, name: str, value: float) -> None:
        bounds = WORKER_SERIES[name][2]
        with self._lock:
            h = self._data[name]
            h["sum"] += float(value)
            h["count"] += 1
            for i, b in enumerate(bounds):
                if value <= b:
                    h["buckets"][i] += 1
        self._dirty.set()

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._data[name] = float(value)
        self._dirty.set()

    def snapshot(self) -> dict:
        with self._lock:
            return json.loads(json.dumps(self._data))

    def _writer(self) -> None:
        while True:
            self._dirty.wait()
            self._dirty.clear()
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.snapshot(), f)
            os.replace(tmp, self.path)
            threading.Event().wait(SNAPSHOT_PERIOD_S)


def snapshot_path(vllm_config) -> str | None:
    """The snapshot file of this engine's rank-0 worker (None when the config has no channel)."""
    d = (getattr(vllm_config, "additional_config", None) or {}).get(METRICS_KEY)
    if not d:
        return None
    dp = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_rank", 0) or 0
    return os.path.join(d, f"dp{dp}.json")


class WorkerCollector:
    """The frontend side: the latest worker snapshot as Prometheus metric families, at every scrape."""

    def __init__(self, path: str, labels: dict):
        self.path, self.labels = path, labels

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        try:
            with open(self.path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return
        names, values = list(self.labels), list(self.labels.values())
        for name, (kind, doc, bounds) in WORKER_SERIES.items():
            v = data.get(name)
            if v is None:
                continue
            if kind == "histogram":
                fam = HistogramMetricFamily(name, doc, labels=names)
                cum = [(str(b), c) for b, c in zip(bounds, v["buckets"])] + [("+Inf", v["count"])]
                fam.add_metric(values, cum, v["sum"])
            else:
                fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=names)
                fam.add_metric(values, v)
            yield fam


class BoleStatLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0):
        self.active = is_ours(getattr(vllm_config, "speculative_config", None))
        self.labels = dict(model_name=str(vllm_config.model_config.served_model_name), engine=str(engine_index))
        self._m = None
        self._worker_path = snapshot_path(vllm_config) if self.active else None

    def _metrics(self) -> dict:
        if self._m is None:
            import prometheus_client as pc

            if self._worker_path is not None:
                pc.REGISTRY.register(WorkerCollector(self._worker_path, self.labels))
            names = list(self.labels)
            self._m = dict(
                per_tree=pc.Histogram("vllm:bole_accepted_tokens_per_tree", "Tokens emitted per verified tree "
                                      "(accepted depth + bonus)", names, buckets=[b + 1 for b in _DEPTH_BUCKETS]),
                depth=pc.Histogram("vllm:bole_accepted_depth", "Accepted depth per verified tree", names,
                                   buckets=_DEPTH_BUCKETS),
                nodes=pc.Histogram("vllm:bole_tree_nodes_per_step", "Tree nodes (roots included) verified in one "
                                   "target forward", names, buckets=_NODE_BUCKETS),
                trees=pc.Counter("vllm:bole_trees", "Verified trees", names),
                tree_nodes=pc.Counter("vllm:bole_tree_nodes", "Verified tree nodes (roots included)", names),
                accepted=pc.Counter("vllm:bole_accepted_tokens", "Accepted draft tokens", names),
            )
        return {k: m.labels(**self.labels) for k, m in self._m.items()}

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if not self.active:
            return
        m = self._metrics()
        sd = getattr(scheduler_stats, "spec_decoding_stats", None)
        if sd is None or not sd.num_drafts:
            return
        per_pos = list(sd.num_accepted_tokens_per_pos) + [0]
        reached = [sd.num_drafts] + per_pos  # reached[d]: trees whose accepted path has depth >= d
        for d in range(len(reached) - 1):
            for _ in range(reached[d] - reached[d + 1]):
                m["depth"].observe(d)
                m["per_tree"].observe(d + 1)
        nodes = sd.num_draft_tokens + sd.num_drafts
        m["nodes"].observe(nodes)
        m["trees"].inc(sd.num_drafts)
        m["tree_nodes"].inc(nodes)
        m["accepted"].inc(sd.num_accepted_tokens)

    def log_engine_initialized(self):
        pass
