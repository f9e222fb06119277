"""Tree metrics through vLLM's stat-logger path (``vllm.stat_logger_plugins`` entry point): Prometheus
series ``vllm:bole_*`` on the server's ``/metrics``.

vLLM's scheduler already sees every verified tree: per step and request it records the drafts it
scheduled (``num_draft_tokens`` = the tree's draft nodes) and the accepted tokens, counted per
position (``num_accepted_tokens_per_pos[d]`` = requests whose accepted path reached depth ``d +
1``). vLLM's own counters stay meaningful for trees that way: accepted tokens and their depth
positions are exact; only its "draft acceptance rate" divides by every tree node. From the same
statistics this logger derives, per engine step:

* ``vllm:bole_accepted_tokens_per_tree`` (histogram): tokens emitted per verified tree (accepted
  depth + the bonus token);
* ``vllm:bole_accepted_depth`` (histogram): accepted depth per tree;
* ``vllm:bole_tree_nodes_per_step`` (histogram): tree nodes verified in one target forward (roots
  included);
* ``vllm:bole_trees_total``, ``vllm:bole_tree_nodes_total``, ``vllm:bole_accepted_tokens_total``.

The worker's own timings (drafting, verification + commit) are not in vLLM's scheduler statistics;
they are read with ``llm.collective_rpc("bole_stats")`` (``draft_s``, ``verify_commit_s``, counts).
The logger does nothing on engines without ``method: bole_tree``. vLLM's Prometheus logger
unregisters every ``vllm:`` collector when it is built (after the plugin loggers), so the series are
created at the first record.
"""
from __future__ import annotations

from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_bole.adapter.config_hook import is_ours

_DEPTH_BUCKETS = [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
_NODE_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


class BoleStatLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0):
        self.active = is_ours(getattr(vllm_config, "speculative_config", None))
        self.labels = dict(model_name=str(vllm_config.model_config.served_model_name), engine=str(engine_index))
        self._m = None

    def _metrics(self) -> dict:
        if self._m is None:
            import prometheus_client as pc

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
        sd = getattr(scheduler_stats, "spec_decoding_stats", None) if self.active else None
        if sd is None or not sd.num_drafts:
            return
        m = self._metrics()
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
