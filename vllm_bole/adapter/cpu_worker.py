"""vLLM's CPU worker with the tree runner (see :mod:`vllm_bole.adapter.worker`); CPU processes only."""
from __future__ import annotations

import contextlib

from vllm.v1.worker import cpu_worker as _cpu_worker_mod
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_bole.adapter.worker import (bole_capture_tree_graphs_rpc, bole_set_budget_rpc, bole_stats_rpc,
                                     bole_warm_up_rpc, kv_bytes_after_tree_buffers, model_side_config, runner_class,
                                     tree_config_of)

BoleCPUModelRunner = runner_class(CPUModelRunner)


@contextlib.contextmanager
def _swapped(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


class BoleCPUWorker(_cpu_worker_mod.CPUWorker):
    def __init__(self, vllm_config, *args, **kwargs):
        tree_config_of(vllm_config)  # fail early and clearly
        super().__init__(model_side_config(vllm_config), *args, **kwargs)

    def init_device(self):
        # CPUWorker.init_device builds `CPUModelRunner(...)` from its module namespace.
        with _swapped(_cpu_worker_mod, "CPUModelRunner", BoleCPUModelRunner):
            if getattr(self, "use_v2_model_runner", False):
                self.use_v2_model_runner = False
            super().init_device()

    def determine_available_memory(self) -> int:
        return kv_bytes_after_tree_buffers(self, super().determine_available_memory())

    bole_stats = bole_stats_rpc
    bole_set_budget = bole_set_budget_rpc
    bole_warm_up = bole_warm_up_rpc
    bole_capture_tree_graphs = bole_capture_tree_graphs_rpc
