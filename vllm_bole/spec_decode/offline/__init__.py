"""Offline draft-tree tools, used by tests and benchmarks only (the tree runner uses
:func:`vllm_bole.spec_decode.best_first.best_first_tree`):

* :mod:`.trees`: :class:`DraftTree` (a tree plus per-node draft probabilities, scores and child
  distributions), the autoregressive drafter interface (:class:`Frontier`, ``StepFn``) and
  :func:`verify` (the lossless scheme for the way a tree's children were chosen);
* :mod:`.static`: static templates (:class:`StaticTree`: chain, full, k-ary), Sequoia's optimal
  static tree and positional acceptance statistics;
* :mod:`.templates`: template instantiation with top-k or sampled children;
* :mod:`.search`: best-first from dense marginals, batch-wide, and from an autoregressive drafter.
"""
from vllm_bole.spec_decode.offline.search import build_best_first, build_best_first_autoregressive, \
    build_best_first_batch
from vllm_bole.spec_decode.offline.static import StaticTree, acceptance_stats, expected_tokens, optimal_static_tree
from vllm_bole.spec_decode.offline.templates import build_sampled, build_static
from vllm_bole.spec_decode.offline.trees import CHILDREN_DETERMINISTIC, CHILDREN_WITH_REPLACEMENT, \
    CHILDREN_WITHOUT_REPLACEMENT, DraftTree, Frontier, StepFn, verify

__all__ = [
    "CHILDREN_DETERMINISTIC", "CHILDREN_WITH_REPLACEMENT", "CHILDREN_WITHOUT_REPLACEMENT", "DraftTree", "Frontier",
    "StaticTree", "StepFn", "acceptance_stats", "build_best_first", "build_best_first_autoregressive",
    "build_best_first_batch", "build_sampled", "build_static", "expected_tokens", "optimal_static_tree", "verify",
]
