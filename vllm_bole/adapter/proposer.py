"""The proposer class vLLM's speculative config names (``method: custom_class``) for vllm-bole.

vllm-bole's model runner drafts, verifies and commits trees itself and never builds vLLM's
proposer. If vLLM ever instantiates this class, the worker is not vllm-bole's (e.g. a user-set
``worker_cls`` or a model runner this release does not wire): fail loudly instead of decoding with
vLLM's chain verification.
"""


class TreeProposer:
    def __init__(self, vllm_config=None):
        raise RuntimeError(
            "vllm-bole: vLLM tried to build its own proposer for method 'bole_tree', so its model runner is "
            "not vllm-bole's tree runner (worker_cls overridden, or an unsupported runner). Tree speculation "
            "needs parallel_config.worker_cls = vllm_bole.adapter.worker.Bole{CPU,GPU}Worker (set automatically)."
        )

    def propose(self, *args, **kwargs):  # pragma: no cover - never reached
        raise RuntimeError("vllm-bole TreeProposer.propose must not be called")
