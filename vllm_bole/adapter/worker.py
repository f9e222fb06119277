"""vLLM workers that run vllm-bole's tree speculation (selected through ``parallel_config.worker_cls``
by the config hook whenever ``method: bole_tree`` is configured): ``BoleCPUWorker`` (vLLM's CPU
worker, :mod:`.cpu_worker`) and ``BoleGPUWorker`` (vLLM's V1 GPU worker, :mod:`.gpu_worker`).

Each lives in its own module and is imported only when vLLM asks for it by name: importing vLLM's
CPU worker patches ``torch.cuda.Event``, streams and memory queries process-wide with CPU
placeholders (``vllm/v1/worker/cpu/shm.py``), which breaks a GPU process (Triton's autotuner, the
runner's device-to-host copies, KV-cache sizing).

The workers keep vLLM's speculative config away from the model side: the engine core (scheduler)
sees the speculative config (node budget = ``num_speculative_tokens``: it allocates the KV slots of
the tree and rolls ``num_computed_tokens`` back by the rejected nodes), while the worker's config
has none, so the layers, KV-cache specs and attention metadata builders are exactly those of
non-speculative decoding: one recurrent state slot per request, plain conv-state widths, no
per-draft-token state copies. The tree settings travel in ``additional_config["vllm_bole"]``.
"""
from __future__ import annotations

import copy
import importlib
import logging

from vllm_bole.adapter.config_hook import ADDITIONAL_KEY
from vllm_bole.config import TreeSpecConfig

logger = logging.getLogger("vllm_bole")
_LAZY = {"BoleCPUWorker": "vllm_bole.adapter.cpu_worker", "BoleGPUWorker": "vllm_bole.adapter.gpu_worker"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def tree_config_of(vllm_config) -> TreeSpecConfig:
    extra = getattr(vllm_config, "additional_config", None) or {}
    if ADDITIONAL_KEY not in extra:
        raise RuntimeError(
            "vllm-bole worker started without its configuration (additional_config['vllm_bole']); "
            "configure speculation with speculative_config={'method': 'bole_tree', ...}"
        )
    return TreeSpecConfig(**extra[ADDITIONAL_KEY])


def model_side_config(vllm_config):
    """A shallow copy of ``vllm_config`` without the speculative config (see the module docstring)."""
    cfg = copy.copy(vllm_config)
    cfg.speculative_config = None
    return cfg


def runner_class(base):
    """vLLM's model runner class ``base`` with the tree runner mixed in."""
    from vllm_bole.adapter.runner import TreeRunnerMixin

    class BoleModelRunner(TreeRunnerMixin, base):
        def __init__(self, vllm_config, device):
            super().__init__(vllm_config, device)
            self._bole_setup(tree_config_of(vllm_config))

        def load_model(self, *args, **kwargs):
            out = super().load_model(*args, **kwargs)
            self._bole_load_drafter()
            return out

    BoleModelRunner.__name__ = BoleModelRunner.__qualname__ = f"Bole{base.__name__}"
    return BoleModelRunner


def kv_bytes_after_tree_buffers(worker, available: int) -> int:
    """The bytes vLLM may give its KV cache out of ``available`` once the tree runner's own buffers are set
    aside; vLLM sizes the cache from a profile run that never goes through the tree overrides (without
    this the 8B-shape engine ran out of GPU memory at ``gpu_memory_utilization`` 0.9 on the H200,
    d8485d7). Two buffers, fixed in size: the pending paths (each recurrent layer's, one row per request
    in flight: ``TreeRunnerMixin._bole_num_rows``) and the largest tree step's inputs held until its
    commit. Until the rows, the pending paths were indexed by vLLM's state slot, i.e. by KV block id, and
    took 14-19% of the cache (the 70M pair and the 8B shapes on the H200)."""
    pending, step = worker.model_runner.bole_tree_buffer_bytes()
    if not pending or available <= 0:
        return available
    kept = max(available - pending - step, 0)
    logger.info("vllm-bole: %.2f GiB of the KV cache's %.2f GiB set aside for tree steps: %.2f GiB for the largest "
                "step's inputs, %.2f MiB for the recurrent layers' pending paths (%d rows)", (available - kept) / 2**30,
                available / 2**30, step / 2**30, pending / 2**20, worker.model_runner._bole_num_rows)
    return kept


def bole_stats_rpc(self) -> dict:
    """Worker method (``collective_rpc("bole_stats")``): the tree runner's counters."""
    return self.model_runner.bole_stats()


def bole_warm_up_rpc(self) -> dict:
    """Worker method (``collective_rpc("bole_warm_up")``): :func:`vllm_bole.adapter.warmup.warm_up_tree_kernels`."""
    from vllm_bole.adapter.warmup import warm_up_tree_kernels

    return warm_up_tree_kernels(self.model_runner)


def bole_capture_tree_graphs_rpc(self) -> int:
    """Worker method (``collective_rpc("bole_capture_tree_graphs")``): the runner's, see there."""
    return self.model_runner.bole_capture_tree_graphs()


def bole_set_budget_rpc(self, budget) -> int | str:
    """Worker method (``collective_rpc("bole_set_budget", args=(budget,))``): see the runner's."""
    return self.model_runner.bole_set_budget(budget)
