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
* ``async_scheduling`` -> off while vLLM validates the config (it refuses async scheduling with
  ``custom_class`` drafts), then set to the tree config's ``async_scheduling`` on the built config (the
  runner settles each step at the start of the next: :mod:`vllm_bole.adapter.runner`);
* ``enable_prefix_caching`` -> off (explicit True is refused, below);
* on GPU, ``VLLM_USE_V2_MODEL_RUNNER=0`` in the environment (the workers inherit it): the tree
  runner hooks vLLM's V1 model runner, and vLLM 0.33 defaults to V2 on GPU;
* CUDA graphs stay as vLLM configures them, except a ``cudagraph_mode`` whose mixed-batch mode is
  FULL (refused): a tree step is a mixed batch, and a full graph would replay the attention and
  recurrent layers without running the tree overrides. With PIECEWISE (the mixed mode of vLLM's
  default FULL_AND_PIECEWISE) those layers are vLLM's splitting ops and run eagerly between the
  captured pieces, so tree steps run under the captured graphs;
* on GPU without FlashInfer, ``additional_config["gdn_prefill_backend"] = "triton"`` unless set:
  vLLM 0.33 picks FlashInfer's GDN prefill on SM90 without checking that it is installed;
* ``additional_config["vllm_bole"]`` -> the validated settings, which travel to every worker;
  ``additional_config["vllm_bole_metrics"]`` -> a fresh directory for the worker's metrics snapshot
  (:mod:`vllm_bole.adapter.metrics`).

Everything that cannot work is refused here, before any engine process starts, with one line naming
the field and the allowed values (:class:`~vllm_bole.config.ConfigError`): the tree config itself
(strict types), a ``draft_model`` directory that does not exist or whose tokenizer differs from the
target's, ``kernels: triton`` on CPU without ``TRITON_INTERPRET=1``, a user ``worker_cls``,
``async_scheduling=True``, ``enable_prefix_caching=True`` (one recurrent state slot per request: vLLM's
prefix caching of hybrid states keeps several), a full-graph mixed ``cudagraph_mode``, and near
misses of the method name ("did you mean 'bole_tree'?").
"""
from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import tempfile
import uuid

from vllm_bole.config import METHOD, ConfigError, is_tree_spec, parse_config

logger = logging.getLogger("vllm_bole")

PROPOSER = "vllm_bole.adapter.proposer.TreeProposer"
CPU_WORKER = "vllm_bole.adapter.worker.BoleCPUWorker"
GPU_WORKER = "vllm_bole.adapter.worker.BoleGPUWorker"
ADDITIONAL_KEY = "vllm_bole"
METRICS_KEY = "vllm_bole_metrics"  # additional_config: directory of the workers' metrics snapshots
ASYNC_FLAG = "_vllm_bole_async"  # on vLLM's speculative config of an engine with the tree config's async_scheduling
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def _cudagraph_mode(compilation_config):
    cc = compilation_config
    mode = cc.get("cudagraph_mode") if isinstance(cc, dict) else getattr(cc, "cudagraph_mode", None)
    if mode is None:
        return None
    from vllm.config.compilation import CUDAGraphMode

    return mode if isinstance(mode, CUDAGraphMode) else CUDAGraphMode[str(mode).upper()]


def _check_near_miss(spec) -> None:
    """A method name close to 'bole_tree' that vLLM does not know: say so instead of vLLM's list."""
    import difflib

    method = spec.get("method") if isinstance(spec, dict) else None
    if isinstance(method, str) and method != METHOD and difflib.SequenceMatcher(
            None, method.lower().replace("-", "_"), METHOD).ratio() >= 0.75:
        raise ConfigError(f"speculative_config.method: {method!r} is not a speculative method; did you mean "
                          f"{METHOD!r} (vllm-bole's tree speculation)?")


def _check_draft_model(cfg, target: str) -> None:
    """The draft model must be a local checkpoint with the target's tokenizer (same vocabulary); a block
    or MTP drafter a checkpoint of its kind for the target's hidden size."""
    if cfg.drafter in ("block", "mtp"):
        from vllm_bole.spec_decode.block_drafter import check_head_dir

        hidden = None
        if os.path.isfile(os.path.join(target, "config.json")):
            with open(os.path.join(target, "config.json")) as f:
                hf = json.load(f)
            hidden = hf.get("hidden_size") or hf.get("text_config", {}).get("hidden_size")
        try:
            check_head_dir(cfg.model, cfg.drafter, hidden)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return
    if cfg.drafter != "draft_model":
        return
    if not os.path.isfile(os.path.join(cfg.model, "config.json")):
        raise ConfigError(f"model: {cfg.model!r} is not a model directory (no config.json); drafter 'draft_model' "
                          "needs a local checkpoint with the target's tokenizer")
    if os.path.isdir(target):
        from transformers import AutoTokenizer

        try:
            a, b = AutoTokenizer.from_pretrained(target), AutoTokenizer.from_pretrained(cfg.model)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model: cannot load the tokenizers of the target and draft {cfg.model!r}: {e}") from None
        if a.get_vocab() != b.get_vocab():
            raise ConfigError(f"model: the draft {cfg.model!r} has a different tokenizer from the target {target!r} "
                              "(vocabularies differ); drafter 'draft_model' needs the target's tokenizer")


def apply_to_engine_args(args):
    """Rewrite ``args`` (a vLLM ``EngineArgs``) in place when it selects ``bole_tree``; returns the tree
    config (None for other engines)."""
    spec = args.speculative_config
    if not is_tree_spec(spec):
        _check_near_miss(spec)
        return None
    cfg = parse_config(spec)
    from vllm.platforms import current_platform

    cpu = current_platform.is_cpu()
    worker = CPU_WORKER if cpu else GPU_WORKER
    if args.worker_cls not in ("auto", worker):
        raise ConfigError(
            f"worker_cls: {args.worker_cls!r} conflicts with method 'bole_tree' (vllm-bole runs its own worker "
            f"{worker}); leave worker_cls at 'auto'"
        )
    if args.async_scheduling:
        raise ConfigError("async_scheduling: set it in the speculative config ({'method': 'bole_tree', ..., "
                          "'async_scheduling': true}), not in the engine arguments; leave it unset or False there")
    if args.enable_prefix_caching:
        raise ConfigError("enable_prefix_caching: True is not supported with method 'bole_tree' (one recurrent "
                          "state slot per request); leave it unset or False")
    if cpu and cfg.kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("kernels: 'triton' on CPU runs only under TRITON_INTERPRET=1 (tests); allowed values on "
                          "CPU: 'auto', 'torch'")
    mode = _cudagraph_mode(args.compilation_config)
    if mode is not None and mode.mixed_mode().name == "FULL":
        raise ConfigError(f"compilation_config.cudagraph_mode: {mode.name} replays mixed batches as full graphs, "
                          "which skip the tree overrides; allowed with method 'bole_tree': NONE, PIECEWISE, "
                          "FULL_DECODE_ONLY, FULL_AND_PIECEWISE")
    _check_draft_model(cfg, str(args.model))
    args.speculative_config = dict(
        method="custom_class", model=PROPOSER, num_speculative_tokens=cfg.num_speculative_tokens
    )
    extra = dict(args.additional_config or {})
    if not cpu:
        if os.environ.get(V2_ENV, "0").strip().lower() not in ("0", "false"):
            raise ConfigError(f"{V2_ENV}: {os.environ[V2_ENV]!r} selects vLLM's V2 model runner; method 'bole_tree' "
                              f"runs on the V1 runner: unset it or set it to 0")
        os.environ[V2_ENV] = "0"  # inherited by the workers (their model-side config has no speculation)
        if getattr(args, "gdn_prefill_backend", None) is None and "gdn_prefill_backend" not in extra \
                and importlib.util.find_spec("flashinfer") is None:
            extra["gdn_prefill_backend"] = "triton"
    args.worker_cls = worker
    args.async_scheduling = False
    args.enable_prefix_caching = False
    extra[ADDITIONAL_KEY] = cfg.model_dump()
    extra[METRICS_KEY] = os.path.join(tempfile.gettempdir(), f"vllm_bole_metrics_{os.getpid()}_{uuid.uuid4().hex[:8]}")
    args.additional_config = extra
    logger.debug("vllm-bole: tree speculation %s", cfg.model_dump())
    return cfg


def is_ours(speculative_config) -> bool:
    """Whether vLLM's (resolved) speculative config is the one :func:`apply_to_engine_args` made."""
    return getattr(speculative_config, "method", None) == "custom_class" and \
        getattr(speculative_config, "model", None) == PROPOSER


def install() -> None:
    """Idempotent, once per process: wrap ``EngineArgs.create_engine_config`` (the config mapping
    above) and ``SamplingParams._validate_spec_decode``: vLLM refuses ``min_p`` and ``logit_bias``
    with any speculative config because its chain rejection sampler ignores them; the tree runner
    applies both per node (``TreeRunnerMixin._bole_constrain``), so requests on an engine with
    ``bole_tree`` pass; with the tree config's ``async_scheduling`` a request with structured output is
    refused (alone, before it is added: vLLM's grammar layout counts the drafts the scheduler booked,
    which the runner cuts to its trees). Other speculative configs keep vLLM's check."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams

    orig = EngineArgs.create_engine_config
    if getattr(orig, "_vllm_bole", False):
        return

    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        cfg = apply_to_engine_args(self)
        out = orig(self, *args, **kwargs)
        if cfg is not None and cfg.async_scheduling:  # after vLLM's checks, which refuse it with custom_class drafts
            out.scheduler_config.async_scheduling = True
            object.__setattr__(out.speculative_config, ASYNC_FLAG, True)  # read by the requests' validation
        return out

    orig_validate = SamplingParams._validate_spec_decode

    @functools.wraps(orig_validate)
    def validate_spec_decode(self, speculative_config):
        if is_ours(speculative_config):
            if getattr(speculative_config, ASYNC_FLAG, False) and self.structured_outputs is not None:
                raise ValueError("structured_outputs: not supported with method 'bole_tree' and its async_scheduling "
                                 "(the scheduler books drafts the grammar's layout counts); leave structured_outputs "
                                 "unset, or run the engine with async_scheduling false")
            return None
        return orig_validate(self, speculative_config)

    create_engine_config._vllm_bole = True
    create_engine_config._vllm_bole_orig = orig
    EngineArgs.create_engine_config = create_engine_config
    SamplingParams._validate_spec_decode = validate_spec_decode
