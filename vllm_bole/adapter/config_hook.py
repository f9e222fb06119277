"""Turns the one user-facing speculative config (``{"method": "bole_tree", ...}``) into vLLM's own
configuration, before vLLM validates it.

vLLM's ``SpeculativeConfig.method`` is a closed ``Literal``; rather than widening vLLM's pydantic
schema at run time, the plugin wraps ``EngineArgs.create_engine_config`` (``LLM(...)``,
``vllm serve`` and ``AsyncLLM`` all build their engine config there, in the process that parses the
user's arguments, after vLLM has loaded the general plugins). When the speculative config names
``bole_tree`` it is validated (:func:`vllm_bole.config.parse_config`) and mapped onto vLLM's native
fields:

* ``speculative_config`` -> ``{"method": "custom_class", "model": TreeProposer,
  "num_speculative_tokens": budget}``: the scheduler reserves ``budget`` draft slots per request,
  passes the drafts to the runner and rolls back the rejected ones (its own bookkeeping);
* ``worker_cls`` -> vllm-bole's worker (its model runner drafts, verifies and commits trees);
* ``async_scheduling`` -> off (drafts depend on the accepted tokens of the step);
* ``enable_prefix_caching`` -> off unless set explicitly (vLLM's CPU hybrid path needs that);
* on GPU, ``VLLM_USE_V2_MODEL_RUNNER=0`` in the environment (the workers inherit it): the tree
  runner hooks vLLM's V1 model runner, and vLLM 0.33 defaults to V2 on GPU; and
  ``enforce_eager=True`` (logged): the GPU path is wired but has not run inside vLLM (no vLLM on our
  GPU machine), so CUDA graphs and torch.compile around tree steps stay off until it has;
* ``additional_config["vllm_bole"]`` -> the validated settings, which travel to every worker.

Conflicting explicit settings (a user ``worker_cls``, ``async_scheduling=True``) fail with a
message naming the field.
"""
from __future__ import annotations

import functools
import logging
import os

from vllm_bole.config import ConfigError, is_tree_spec, parse_config

logger = logging.getLogger("vllm_bole")

PROPOSER = "vllm_bole.adapter.proposer.TreeProposer"
CPU_WORKER = "vllm_bole.adapter.worker.BoleCPUWorker"
GPU_WORKER = "vllm_bole.adapter.worker.BoleGPUWorker"
ADDITIONAL_KEY = "vllm_bole"
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def apply_to_engine_args(args) -> None:
    """Rewrite ``args`` (a vLLM ``EngineArgs``) in place when it selects ``bole_tree``."""
    spec = args.speculative_config
    if not is_tree_spec(spec):
        return
    cfg = parse_config(spec)
    from vllm.platforms import current_platform

    worker = CPU_WORKER if current_platform.is_cpu() else GPU_WORKER
    if args.worker_cls not in ("auto", worker):
        raise ConfigError(
            f"worker_cls: {args.worker_cls!r} conflicts with method 'bole_tree' (vllm-bole runs its own worker "
            f"{worker}); leave worker_cls at 'auto'"
        )
    if args.async_scheduling:
        raise ConfigError("async_scheduling: True is not supported with method 'bole_tree'; leave it unset or False")
    args.speculative_config = dict(
        method="custom_class", model=PROPOSER, num_speculative_tokens=cfg.num_speculative_tokens
    )
    if worker == GPU_WORKER:
        if os.environ.get(V2_ENV, "0").strip().lower() not in ("0", "false"):
            raise ConfigError(f"{V2_ENV}: {os.environ[V2_ENV]!r} selects vLLM's V2 model runner; method 'bole_tree' "
                              f"runs on the V1 runner: unset it or set it to 0")
        os.environ[V2_ENV] = "0"  # inherited by the workers (their model-side config has no speculation)
        if not args.enforce_eager:
            logger.warning("vllm-bole: enforce_eager=True on GPU (CUDA graphs / torch.compile with tree steps are "
                           "not verified: vLLM does not run on our GPU machine)")
            args.enforce_eager = True
    args.worker_cls = worker
    args.async_scheduling = False
    if args.enable_prefix_caching is None:
        args.enable_prefix_caching = False
    extra = dict(args.additional_config or {})
    extra[ADDITIONAL_KEY] = cfg.model_dump()
    args.additional_config = extra
    logger.info("vllm-bole: tree speculation %s", cfg.model_dump())


def is_ours(speculative_config) -> bool:
    """Whether vLLM's (resolved) speculative config is the one :func:`apply_to_engine_args` made."""
    return getattr(speculative_config, "method", None) == "custom_class" and \
        getattr(speculative_config, "model", None) == PROPOSER


def install() -> None:
    """Idempotent, once per process: wrap ``EngineArgs.create_engine_config`` (the config mapping
    above) and ``SamplingParams._validate_spec_decode``: vLLM refuses ``min_p`` and ``logit_bias``
    with any speculative config because its chain rejection sampler ignores them; the tree runner
    applies both per node (``TreeRunnerMixin._bole_constrain``), so requests on an engine with
    ``bole_tree`` pass. Other speculative configs keep vLLM's check."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams

    orig = EngineArgs.create_engine_config
    if getattr(orig, "_vllm_bole", False):
        return

    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        apply_to_engine_args(self)
        return orig(self, *args, **kwargs)

    orig_validate = SamplingParams._validate_spec_decode

    @functools.wraps(orig_validate)
    def validate_spec_decode(self, speculative_config):
        if is_ours(speculative_config):
            return None
        return orig_validate(self, speculative_config)

    create_engine_config._vllm_bole = True
    create_engine_config._vllm_bole_orig = orig
    EngineArgs.create_engine_config = create_engine_config
    SamplingParams._validate_spec_decode = validate_spec_decode
