"""vLLM's V1 GPU worker with the tree runner (see :mod:`vllm_bole.adapter.worker`).

vLLM 0.33 defaults to its V2 model runner on GPU; tree speculation runs on the V1 runner
(``GPUModelRunner``): V2 keeps request state on the GPU and drives speculation through a closed set
of speculators and a chain rejection sampler, with no hook for a tree step (its ``custom_class``
speculation raises ``NotImplementedError``). The engine config already resolves to V1 (vLLM's V2
runner does not take ``custom_class``); the model-side config has no speculative config, so
``VLLM_USE_V2_MODEL_RUNNER=0`` (set by the config hook, inherited by the workers) keeps it on V1 too.
"""
from __future__ import annotations

import logging
import os
import sys

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker as _GPUWorker

from vllm_bole.adapter.config_hook import V2_ENV
from vllm_bole.adapter.worker import (bole_capture_tree_graphs_rpc, bole_set_budget_rpc, bole_stats_rpc,
                                     bole_warm_up_rpc, kv_bytes_after_tree_buffers, model_side_config, runner_class,
                                     tree_config_of)

logger = logging.getLogger("vllm_bole")
BoleGPUModelRunner = runner_class(GPUModelRunner)
_CPU_PATCH = "vllm.v1.worker.cpu.shm"  # vLLM's CPU worker's process-wide torch.cuda placeholders


class BoleGPUWorker(_GPUWorker):
    def __init__(self, vllm_config, *args, **kwargs):
        tree_config_of(vllm_config)
        if _CPU_PATCH in sys.modules:
            raise RuntimeError(f"vllm-bole: {_CPU_PATCH} is imported in this GPU worker process; it replaces "
                               "torch.cuda.Event and streams with CPU placeholders")
        os.environ.setdefault(V2_ENV, "0")
        cfg = model_side_config(vllm_config)
        if cfg.use_v2_model_runner:
            raise RuntimeError(
                f"vllm-bole: vLLM selected its V2 model runner for the model side ({V2_ENV}="
                f"{os.environ.get(V2_ENV)!r}); tree speculation runs on the V1 runner: set {V2_ENV}=0"
            )
        super().__init__(cfg, *args, **kwargs)
        self.use_v2_model_runner = False

    def _make_model_runner(self):
        return BoleGPUModelRunner(self.vllm_config, self.device)

    def determine_available_memory(self) -> int:
        return kv_bytes_after_tree_buffers(self, super().determine_available_memory())

    def compile_or_warm_up_model(self):
        out = super().compile_or_warm_up_model()
        try:  # the tree step's Triton kernels compile here, not inside the first requests
            self.bole_warm_up()
        except Exception:  # noqa: BLE001 - serving still works: the kernels then compile at first use
            logger.warning("vllm-bole: the tree-step warm-up failed; its kernels compile at their first use "
                           "instead", exc_info=True)
        try:  # opt-in (VLLM_BOLE_TREE_GRAPHS=1): tree steps of tree requests alone from CUDA graphs
            self.bole_capture_tree_graphs()
        except Exception:  # noqa: BLE001 - tree steps then run piecewise, as without the option
            self.model_runner._bole_graphs = None
            logger.warning("vllm-bole: capturing the tree-step CUDA graphs failed; tree steps run piecewise",
                           exc_info=True)
        return out

    bole_stats = bole_stats_rpc
    bole_set_budget = bole_set_budget_rpc
    bole_warm_up = bole_warm_up_rpc
    bole_capture_tree_graphs = bole_capture_tree_graphs_rpc
